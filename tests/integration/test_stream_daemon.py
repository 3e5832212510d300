"""Stream mode served by a real daemon (client/streaming/daemon_blocks.py): a file 4x the daemon's
--max-memory streamed by a DDP job under torchrun (2 gloo ranks): every row once per epoch,
h5py's bytes, the blocks mapped from shared memory, the daemon's memory never over its budget
(sampled during the job), every block loaded once per node per epoch (the ranks share them),
a second job at the same time shares them too, the same order without a daemon; DataLoader
workers forked and spawned; a stopped rank never stops the other (it ends its epoch within the
budget), and both finish once it goes on; the node stays usable."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from contextlib import AbstractContextManager
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.client import SharedH5Dataset, make_loader
from h5serve.wire.connection import DaemonClient
from h5serve.wire.runtime import arena_wanted

from ..helpers import Daemon, make_h5, running_daemon, torchrun_two_ranks, wait_for, watch_memory

pytestmark = pytest.mark.timeout(300)

TESTS = Path(__file__).resolve().parents[1]
JOB, STOP_JOB = TESTS / "jobs" / "stream_job.py", TESTS / "jobs" / "stream_stop_job.py"
ROWS, SHAPE, BLOCK_ROWS = 8193, (1024,), 128  # 65 blocks of 128 rows (the last of 1): 8 MiB of x, 64 KiB of y
BLOCKS, KEYS = 65, 2
BUDGET = 2 * 1024 * 1024  # the data is 4x the daemon's budget
WINDOW = "1MiB"  # 7 blocks of 129 KiB (rows), 137 KiB each in shared memory with the two header pages
LOADERS = ["make:0", "make:2", "make:1:spawn"]


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_h5(tmp_path_factory.mktemp("streamd") / "data.h5", rows=ROWS, row_shape=SHAPE)


def daemon(budget: int = BUDGET) -> AbstractContextManager[Daemon]:
    return running_daemon("--max-memory", str(budget), "--loaders", "2")


def counters(d: Daemon) -> dict[str, int]:
    """The daemon's counters; with the stream arena (unless H5SERVE_ARENA=0)
    a block is a slot load, not a segment's: ``loads`` counts both, ``evictions`` a slot reused
    or punched for another block as well as a segment evicted."""
    with DaemonClient(d.runtime_dir) as client:
        status = client.status()
    found = dict(status["counters"])
    if arena_wanted():
        arenas = status["arenas"]
        found["loads"] += arenas["loads"]
        found["evictions"] += arenas["reclaims"] + arenas["punches"]
    return found


def job_args(h5: Path, out: Path, *extra: str) -> list[str]:
    return [str(h5), str(out), "--window", WINDOW, "--block-rows", str(BLOCK_ROWS), "--batch-size", "32", *extra]


def rows_of(batches: list[list[int]]) -> list[int]:
    return [row for batch in batches for row in batch]


def check_epoch(per_rank: list[list[list[int]]]) -> None:
    """Every row once across the ranks (padding repeats less than a batch on each), equal batch counts."""
    assert len(per_rank[0]) == len(per_rank[1])
    rows = rows_of(per_rank[0]) + rows_of(per_rank[1])
    assert set(rows) == set(range(ROWS)) and len(rows) - ROWS < 2 * 32


def test_ddp_job_streams_4x_the_budget_from_shared_memory(h5: Path, tmp_path: Path) -> None:
    with daemon() as d, watch_memory(d) as memory:
        reports = torchrun_two_ranks(JOB, job_args(h5, tmp_path / "out", "--epochs", "1", "--loaders",
                                                   ",".join(LOADERS)), tmp_path / "out", d.runtime_dir, 280)
        after = counters(d)
    assert all(r["backend"] == "shm" and r["len"] == ROWS for r in reports)  # (the job checks h5py's bytes)
    for name in LOADERS:
        check_epoch([r["runs"][name][0] for r in reports])
    for r in reports:  # forked and spawned workers gather the same batches as the main process
        assert r["runs"]["make:2"] == r["runs"]["make:0"] == r["runs"]["make:1:spawn"]
        assert r["peak_blocks"] <= r["capacity"] < BLOCKS
        assert r["rest"] == r["whole"][7:]  # a mid-epoch checkpoint resumes the same rest
    assert memory.samples > 10 and 0 < memory.used <= BUDGET and memory.allocated <= BUDGET, vars(memory)
    assert after["evictions"] > 0 and after["load_errors"] == 0


def test_blocks_load_once_per_node_and_jobs_share_them(h5: Path, tmp_path: Path) -> None:
    args = ("--epochs", "1", "--loaders", "make:0", "--resume-at", "0")
    with daemon() as d:
        with watch_memory(d) as memory:
            first = torchrun_two_ranks(JOB, job_args(h5, tmp_path / "a", *args), tmp_path / "a", d.runtime_dir, 200)
        loads = counters(d)["loads"]
        # every block of every key once for the node: the two ranks share them (each alone: twice)
        assert loads == BLOCKS * KEYS, loads
        assert memory.used <= BUDGET and memory.allocated <= BUDGET, vars(memory)
        assert all(r["backend"] == "shm" for r in first)
        check_epoch([r["runs"]["make:0"][0] for r in first])
        table = d.cli("status").stdout  # the blocks still resident, as a user reads them
        if not arena_wanted():  # (an arena's slots are not in the table yet: only status's "arenas")
            assert "ranks or rows" in table and " stream " in table
            assert re.search(r"\bx\s+rows \d+-\d+\s+stream\b", table), table

        # two more jobs at once, in the same order: they share the blocks both have in their windows
        outs: dict[str, list[dict]] = {}

        def run(name: str) -> None:
            outs[name] = torchrun_two_ranks(JOB, job_args(h5, tmp_path / name, *args), tmp_path / name,
                                            d.runtime_dir, 250)

        threads = [threading.Thread(target=run, args=(name,)) for name in ("b", "c")]
        with watch_memory(d) as memory:
            for t in threads:
                t.start()
            for t in threads:
                t.join(280)
        assert set(outs) == {"b", "c"}
        both = counters(d)["loads"] - loads
        # two jobs share the blocks both hold at the same time; how many depends on how far apart
        # they run (on a busy machine one can fall a window behind, and a block the other dropped
        # is loaded again: 258-265 seen against 260 for two jobs alone). What must never happen is
        # thrashing: the deeper prefetch tried in issue 22 had them evict each other (386)
        assert both <= 2.2 * BLOCKS * KEYS, both
        assert memory.used <= BUDGET and memory.allocated <= BUDGET, vars(memory)
        for name in ("b", "c"):
            assert [r["runs"] for r in outs[name]] == [r["runs"] for r in first]
    # without a daemon (lazy blocks read in each rank): the same rows in the same order
    alone = torchrun_two_ranks(JOB, job_args(h5, tmp_path / "lazy", *args), tmp_path / "lazy",
                               tmp_path / "no-daemon", 200)
    assert all(r["backend"] == "lazy" for r in alone)
    assert [r["runs"] for r in alone] == [r["runs"] for r in first]


def _start_stop_job(h5: Path, out: Path, runtime_dir: Path, window: str, timeout: float) -> subprocess.Popen[str]:
    out.mkdir()
    env = {**os.environ, "H5SERVE_RUNTIME_DIR": str(runtime_dir), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(TESTS.parent)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(STOP_JOB),
           str(h5), str(out), "--window", window, "--block-rows", str(BLOCK_ROWS), "--timeout", str(timeout)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _step(out: Path, rank: int) -> int:
    try:
        return int((out / f"rank{rank}.step").read_text() or 0)
    except (OSError, ValueError):
        return 0


def _holders(d: Daemon) -> int:
    with DaemonClient(d.runtime_dir) as client:
        return sum(s["holders"] for s in client.status()["segments"])


def _node_still_serves(h5: Path, d: Daemon) -> None:
    """A new job streams from the daemon once the stopped one is gone (its leases with it)."""
    assert wait_for(lambda: _holders(d) == 0, 30)
    ds = SharedH5Dataset(h5, "x", "y", mode="stream", window=WINDOW, block_rows=BLOCK_ROWS, rank=0, world_size=1,
                         runtime_dir=d.runtime_dir, fallback="error")
    try:
        with h5py.File(h5) as f:
            x = f["x"]
            for i, (xb, yb) in enumerate(make_loader(ds, 64, seed=1)):
                assert np.array_equal(xb.numpy(), x[np.sort(yb.numpy())][np.argsort(np.argsort(yb.numpy()))])
                if i == 5:
                    break
        assert ds.backend == "shm"
    finally:
        ds.close()


# a window of 7 blocks in a budget of 8: a rank stopped holding its window leaves the other one block of room
TIGHT_BUDGET = 8 * (BLOCK_ROWS * (1024 + 8) + 2 * 4096) + 4096


def test_a_stopped_rank_never_stops_the_other(h5: Path, tmp_path: Path) -> None:
    """Rank 1 stopped (SIGSTOP) holding the blocks of its window, nearly the whole budget: rank 0
    lets its own blocks go whenever it waits for room, so it goes on a block at a time and ends
    its epoch (it used to wait for rank 1 until its deadline, and two ranks a few steps apart
    waited for each other's blocks the same way); memory never goes over the budget, rank 1
    ends too once it goes on, every row once, and the node stays usable."""
    out = tmp_path / "out"
    with daemon(TIGHT_BUDGET) as d:
        with watch_memory(d) as memory:
            job = _start_stop_job(h5, out, d.runtime_dir, WINDOW, 60.0)
            try:
                assert wait_for(lambda: _step(out, 1) >= 4 or job.poll() is not None, 120), "rank 1 never started"
                assert job.poll() is None, job.communicate()[0][-3000:]
                stopped = int((out / "rank1.pid").read_text())
                os.kill(stopped, signal.SIGSTOP)
                try:
                    at_stop = _step(out, 1)
                    assert wait_for(lambda: (out / "rank0.json").exists(), 120), "rank 0 waited for the stopped rank"
                    assert _step(out, 1) == at_stop  # it ended while rank 1 was stopped
                    report = json.loads((out / "rank0.json").read_text())
                    assert "error" not in report and report["backend"] == "shm", report.get("error")
                finally:
                    os.kill(stopped, signal.SIGCONT)
                output, _ = job.communicate(timeout=150)
                assert job.returncode == 0, output[-3000:]
                reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
                assert all("error" not in r and r["backend"] == "shm" for r in reports)
                rows = reports[0]["labels"] + reports[1]["labels"]
                assert set(rows) == set(range(ROWS)) and len(rows) - ROWS < 2 * 32
            finally:
                if job.poll() is None:
                    os.killpg(job.pid, signal.SIGKILL)
                job.wait(30)
        assert 0 < memory.used <= TIGHT_BUDGET and memory.allocated <= TIGHT_BUDGET, vars(memory)
        _node_still_serves(h5, d)


def test_a_block_is_closed_right_after_its_last_use(h5: Path) -> None:
    """Each batch closes the blocks whose last use on the rank it was: an epoch's last batch
    leaves nothing mapped (the window's room is free for the next epoch, another job, or this
    job's DataLoader workers), where closing only what left the window kept the last blocks
    mapped until the next batch came."""
    with daemon() as d:
        ds = SharedH5Dataset(h5, "x", "y", mode="stream", block_rows=BLOCK_ROWS, window=WINDOW, rank=0,
                             world_size=1, runtime_dir=d.runtime_dir, fallback="error")
        try:
            loader = make_loader(ds, 32, seed=1)
            rows = [int(r) for _, y in loader for r in y]
            assert sorted(rows) == list(range(ROWS))
            assert ds.stream is not None and ds.stream.cache.held == []
            with DaemonClient(d.runtime_dir) as client:
                held = [s for s in client.status()["segments"] if s["holders"]]
            assert held == [], held
        finally:
            ds.close()
