"""Ready at once (client/backends/progressive.py): while the daemon loads a shard, batches come through
h5py, and each process switches to the segments between batches once they are ready.

The load is made slow deterministically, not by size: the daemon's spare loader (the process
that runs its next load) is SIGSTOPped before the dataset asks, so the shard stays loading
until the test sends SIGCONT. Every assertion is on states and bytes, never on time: the
backend is ``"lazy (loading)"`` while the loader is stopped and ``"shm"`` after; the samples
equal h5py's on both sides of the switch; DataLoader workers (fork, spawn) switch on their
own; a daemon SIGKILLed mid-load leaves h5py serving; two torchrun ranks in global mode.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from torch.utils.data import DataLoader, get_worker_info

from h5serve.client import SharedH5Dataset, collate
from h5serve.client.backends.progressive import LOADING

from ..helpers import Daemon, descendant_pids, make_h5, torchrun_two_ranks, wait_for

pytestmark = pytest.mark.timeout(180)

ROWS = 4096
JOB = Path(__file__).resolve().parents[1] / "jobs" / "ready_job.py"


def _spare(daemon_pid: int) -> int | None:
    for pid in descendant_pids(daemon_pid):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "h5serve-spare":
                    return pid
        except OSError:
            continue
    return None


@dataclass
class StoppedLoads:
    """A daemon whose next load runs on a stopped loader."""

    daemon: Daemon
    loader: int

    def resume(self) -> None:
        try:
            os.kill(self.loader, signal.SIGCONT)
        except ProcessLookupError:
            pass


@contextmanager
def stopped_loads(tmp_path: Path) -> Iterator[StoppedLoads]:
    """A fresh daemon, warmed by one load, whose spare loader (its next load's) is SIGSTOPped;
    resumed and the daemon stopped on the way out."""
    d = Daemon("--stall-timeout", "600")
    stopped = None
    try:
        d.start()
        SharedH5Dataset(make_h5(tmp_path / "warm.h5", rows=8), "x", rank=0, world_size=1,
                        runtime_dir=d.runtime_dir, fallback="error").close()
        found: list[int] = []
        assert wait_for(lambda: bool(found.append(_spare(d.pid) or 0) or found[-1]), 30, 0.05), "no spare loader"
        os.kill(found[-1], signal.SIGSTOP)
        stopped = StoppedLoads(d, found[-1])
        yield stopped
    finally:
        if stopped is not None:
            stopped.resume()
        d.stop()


def _open(path: Path, d: Daemon, **kw: Any) -> SharedH5Dataset:
    return SharedH5Dataset(path, "x", "y", mode="global", rank=0, world_size=1, runtime_dir=d.runtime_dir,
                           wait_ready=False, **kw)


def _check(ds: SharedH5Dataset, rows: np.ndarray, path: Path) -> None:
    batch = collate(ds.__getitems__(rows))
    order = np.argsort(rows)
    with h5py.File(path) as f:
        x = f["x"][np.sort(rows)]
    assert np.array_equal(batch[0].numpy()[order], x) and batch[1].tolist() == rows.tolist()


def test_first_batches_come_from_h5py_while_the_load_runs_and_the_same_rows_from_shm_after(tmp_path: Path) -> None:
    path = make_h5(tmp_path / "data.h5", rows=ROWS)
    order = np.random.default_rng(0).permutation(ROWS)
    with stopped_loads(tmp_path) as load:
        ds = _open(path, load.daemon)
        try:
            assert ds.backend == LOADING  # the constructor returned while the load cannot finish
            for rows in np.array_split(order[:2048], 8):
                _check(ds, rows, path)
            assert ds.backend == LOADING
            load.resume()
            assert ds.wait_until_ready(timeout=60) == "shm"
            for rows in np.array_split(order[2048:], 8):
                _check(ds, rows, path)
            assert ds.backend == "shm"
        finally:
            ds.close()


def test_a_daemon_killed_mid_load_leaves_h5py_serving(tmp_path: Path) -> None:
    path = make_h5(tmp_path / "data.h5", rows=ROWS)
    with stopped_loads(tmp_path) as load:
        ds = _open(path, load.daemon)
        try:
            _check(ds, np.arange(0, ROWS, 7), path)
            assert ds.backend == LOADING
            os.kill(load.daemon.pid, signal.SIGKILL)
            with pytest.warns(RuntimeWarning, match="lazily through h5py"):
                assert wait_for(lambda: ds.backend == "lazy", 30)
            _check(ds, np.arange(ROWS - 1, -1, -3), path)  # every batch still served, the same bytes
            assert ds.backend == "lazy"
        finally:
            ds.close()
            for name in load.daemon.segment_files():  # what the killed daemon published stays in /dev/shm
                (Path("/dev/shm") / name).unlink(missing_ok=True)


def batch_and_backend(batch: Any) -> tuple[Any, str, int]:
    """collate_fn of the worker test: the batch, the worker's backend and pid."""
    info = get_worker_info()
    assert info is not None
    return collate(batch), info.dataset.backend, os.getpid()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_switch_on_their_own(tmp_path: Path, context: str) -> None:
    path = make_h5(tmp_path / "data.h5", rows=ROWS)
    with h5py.File(path) as f:
        x = f["x"][:]
    with stopped_loads(tmp_path) as load:
        ds = _open(path, load.daemon)
        try:
            loader = DataLoader(ds, batch_size=256, num_workers=2, multiprocessing_context=context,
                                persistent_workers=True, collate_fn=batch_and_backend, timeout=60)
            seen: dict[int, list[str]] = {}
            for epoch in range(2):
                if epoch == 1:
                    load.resume()
                    assert ds.wait_until_ready(timeout=60) == "shm"  # this process's; each worker decides its own
                for (bx, by), backend, pid in loader:
                    assert np.array_equal(bx.numpy(), x[by.numpy()])
                    seen.setdefault(pid, []).append(backend)
            assert len(seen) == 2, seen
            for backends in seen.values():
                half = len(backends) // 2
                assert set(backends[:half]) == {LOADING}, backends  # epoch 0: the loader was stopped
                assert backends[-1] == "shm", backends
            del loader
        finally:
            ds.close()


def test_two_torchrun_ranks_in_global_mode_switch_mid_epoch(tmp_path: Path) -> None:
    path = make_h5(tmp_path / "data.h5", rows=ROWS)
    with stopped_loads(tmp_path) as load:
        out = tmp_path / "out"
        resumed = threading.Event()

        def resume_once_both_served_lazily() -> None:
            if wait_for(lambda: all((out / f"lazy{r}").exists() for r in range(2)), 150, 0.05):
                load.resume()
                resumed.set()

        helper = threading.Thread(target=resume_once_both_served_lazily, daemon=True)
        helper.start()
        reports = torchrun_two_ranks(JOB, [str(path), str(out)], out, load.daemon.runtime_dir, 160)
        helper.join(timeout=5)
    assert resumed.is_set()
    labels: list[int] = []
    for r in reports:
        assert r["backends"][0] == LOADING and r["backends"][-1] == "shm", r["backends"]
        assert r["equal"], "a batch differed from h5py's rows"
        labels += r["labels"]
    assert sorted(labels) == list(range(ROWS))  # every row once in the epoch across the two ranks


def test_bench_first_batch_against_size_runs_end_to_end(tmp_path: Path) -> None:
    """bench/ready.py on a small file: every system gives its first batch, and the table renders."""
    from bench.ready import SYSTEMS, first_batch, markdown

    report = first_batch(tmp_path, [4])
    row = report["4 MiB"]
    assert all(row[s]["first_s"] > 0 for s in SYSTEMS)
    assert row["global-wait"]["backend"] == "shm" and row["stream"]["backend"] == "shm"
    assert "| 4 MiB (0.00 GB) |" in markdown({"sizes": report})


def test_a_load_not_done_within_timeout_leaves_h5py_serving_with_the_warning(tmp_path: Path) -> None:
    path = make_h5(tmp_path / "data.h5", rows=ROWS)
    with stopped_loads(tmp_path) as load:
        ds = _open(path, load.daemon, timeout=1.0)
        try:
            assert ds.backend == LOADING
            _check(ds, np.arange(ROWS // 2), path)
            with pytest.warns(RuntimeWarning, match="did not finish within timeout=1s"):
                assert wait_for(lambda: ds.backend == "lazy", 30)
            _check(ds, np.arange(ROWS // 2, ROWS), path)
        finally:
            ds.close()
