"""The stream arena (docs/architecture.md,
*Stream arena*) on a real daemon: every row of every epoch exactly once and equal to the file's
with a budget a quarter of the file (slots reused all along), each key's arena mapped once (the
process's mappings do not grow with the blocks it reads); the lease protocol: a slot a rank
holds a read lock on is never reused, one it let go is, a rank that locks a slot reused since
its answer sees another generation in the table and asks again, a killed rank's lease goes with
it; two torchrun ranks with and without workers sharing the arenas within the budget; a daemon
killed mid-epoch and started again."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.client import SharedH5Dataset, make_loader
from h5serve.client.streaming.arena_blocks import ArenaBlocks, _Mapped
from h5serve.client.streaming.refusal import NoRoom
from h5serve.daemon.config import FAILURE_MEMORY_S
from h5serve.errors import BudgetExceeded, SegmentError
from h5serve.order.stream_order import BlockLayout
from h5serve.segments import segment_prefix
from h5serve.segments.arena import ARENA_MARK, READY, lock_range
from h5serve.wire.connection import DaemonClient
from h5serve.wire.protocol import Acquire
from h5serve.wire.runtime import ARENA_ENV, resolve_runtime

from ..helpers import (
    alive,
    descendant_pids,
    h5serve_cli,
    holding,
    make_h5,
    running_daemon,
    torchrun_two_ranks,
    wait_for,
    watch_memory,
)
from .test_metrics import scrape

pytestmark = pytest.mark.timeout(300)

ROWS, SHAPE, BLOCK_ROWS = 8193, (1024,), 128  # 65 blocks of 128 KiB (the last of 1 row): 8 MiB of x
BUDGET = 2 * 1024 * 1024  # a quarter of the file
LOADERS = "make:0,make:2,make:1:spawn"  # no workers, 2 forked, 1 spawned: each opens the arenas itself


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_h5(tmp_path_factory.mktemp("arena") / "data.h5", rows=ROWS, row_shape=SHAPE)


def test_every_row_once_as_in_the_file(h5: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ARENA_ENV, "1")
    with h5py.File(h5) as f:
        x = f["x"][:]
    with running_daemon("--max-memory", str(BUDGET), "--loaders", "2", "--metrics-port", "0") as d:
        ds = SharedH5Dataset(h5, "x", "y", rank=0, world_size=1, runtime_dir=d.runtime_dir, fallback="error",
                             mode="stream", window="1MiB", block_rows=BLOCK_ROWS)
        try:
            loader = make_loader(ds, 32, seed=0)
            maps = []
            for epoch in range(2):
                loader.batch_sampler.set_epoch(epoch)  # type: ignore[union-attr]
                seen = []
                for xb, yb in loader:
                    rows = yb.numpy()
                    np.testing.assert_array_equal(xb.numpy(), x[rows])
                    seen.append(rows)
                    maps.append(shm_mappings())
                np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(ROWS))
            assert ds.backend == "shm"
            prefix = segment_prefix(resolve_runtime(d.runtime_dir).namespace) + ARENA_MARK
            arenas = [p for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix)]
            assert arenas, "no arena was made: the blocks did not go through the arena"
            # each key's arena mapped once: 130 blocks leased over two epochs, the same few mappings of
            # shm files all along (counting every mapping, the allocator's own come and go)
            assert set(maps) == {maps[0]} and maps[0] <= 4, sorted(set(maps))
            with DaemonClient(d.runtime_dir) as client:
                info = client.status()
            assert info["memory"]["used"] <= BUDGET
            # the admin's view: the two keys' arenas and their loads, in the status table
            shown = h5serve_cli("status", env=d.env)
            assert shown.returncode == 0, shown.stderr
            assert f"stream arenas: 2 open, {info['arenas']['ready']} of {info['arenas']['slots']}" in shown.stdout
            assert f"{info['arenas']['loads']} block load(s)" in shown.stdout and info["arenas"]["loads"] >= 2 * 65

            def scraped() -> bool:  # and the Prometheus metrics (a snapshot at most a second old)
                text = scrape(info["metrics_port"])
                loads = re.search(r"^h5serve_stream_slot_loads_total (\S+)$", text, re.M)
                return (loads is not None and float(loads.group(1)) >= info["arenas"]["loads"]
                        and "h5serve_stream_arenas 2.0" in text)

            assert wait_for(scraped, 10, 0.2), scrape(info["metrics_port"])
            assert re.search(r"^h5serve_stream_arena_bytes [1-9]", scrape(info["metrics_port"]), re.M)
        finally:
            ds.close()


def shm_mappings() -> int:
    """This process's mappings of files in /dev/shm (segments and arenas)."""
    with open("/proc/self/maps") as f:
        return sum(" /dev/shm/" in line for line in f)


def _blocks(path: Path) -> list[Acquire]:
    return [Acquire(str(path), "x", 1, 0, "stream", None, rows=(a, min(a + 64, 1000)), arena=64)
            for a in range(0, 1000, 64)]


def test_leases_keep_a_slot_and_a_reused_slot_is_seen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ARENA_ENV, "1")  # the daemon offers arenas
    path = make_h5(tmp_path / "small.h5", rows=1000, row_shape=(1024,))  # 16 blocks of 64 KiB
    with running_daemon("--max-memory", str(1024 * 1024), "--loaders", "1") as d, DaemonClient(d.runtime_dir) as c:
        blocks = _blocks(path)
        first = c.acquire(blocks[0])
        arena = _Mapped(first)
        try:
            assert arena.lock(first.slot, fcntl.F_RDLCK) and arena.shows(first.slot, 0, first.generation)
            # the budget holds 15 slots: blocks 1..14 fill them, block 15 must reuse one, never the leased
            answers = [c.acquire(b) for b in blocks[1:15]]
            fifteenth = c.acquire(blocks[15])
            assert fifteenth.slot == answers[0].slot != first.slot  # block 1's: the least recently used unleased
            assert arena.shows(first.slot, 0, first.generation)
            with h5py.File(path) as f:
                np.testing.assert_array_equal(arena.take(np.full(64, first.slot), np.arange(64)), f["x"][:64])
            # let go: the least recently used slot is block 0's, reused for the next new block
            arena.lock(first.slot, fcntl.F_UNLCK)
            again = c.acquire(blocks[1])
            assert (again.slot, again.generation) == (first.slot, first.generation + 1)
            # the answer for block 0 a rank held: locked now, the table shows another block: asked again
            assert arena.lock(first.slot, fcntl.F_RDLCK)
            assert not arena.shows(first.slot, 0, first.generation)
            assert int(arena.table[first.slot, 2]) == READY
            # every slot leased: a new block has no room, and the daemon says so (no slot taken from a reader)
            for slot in np.flatnonzero(arena.table[:, 2] == READY).tolist():
                assert arena.lock(slot, fcntl.F_RDLCK)
            with pytest.raises(BudgetExceeded):
                c.acquire(blocks[0])
        finally:
            arena.close()


def test_a_stale_answer_naming_a_slot_leased_for_another_block_keeps_that_lease(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process holds block 15 in the slot block 0 had, and block 0's old answer names that slot:
    asked again, the lease on block 15 kept. The unlock after the table check (it shows block 15)
    used to drop it (one open file description, one lock a range) and the daemon reused the slot
    under block 15: wrong rows (test_stream_workers, 2 ranks with forked workers)."""
    monkeypatch.setenv(ARENA_ENV, "1")
    path = make_h5(tmp_path / "small.h5", rows=1000, row_shape=(1024,))  # 16 blocks of 64 KiB
    with running_daemon("--max-memory", str(1024 * 1024), "--loaders", "1") as d, DaemonClient(d.runtime_dir) as c:
        blocks = _blocks(path)
        stale = c.acquire(blocks[0])  # block 0's slot, nobody leasing it
        for request in blocks[1:16]:  # the budget holds 15 slots: block 15 reuses block 0's (least recently used)
            c.acquire(request)
        held = ArenaBlocks(BlockLayout(1000, 64), 1, lambda block, prefetch: [blocks[block]], lambda: c,
                           NoRoom(False, 30.0, 16, 64 * 1024, 1024 * 1024), 8, False)
        other = os.open(Path(stale.shm_dir) / stale.name, os.O_RDWR)  # another description, as the daemon has
        try:
            with h5py.File(path) as f:
                x = f["x"][:]
            np.testing.assert_array_equal(held.gather(np.arange(960, 1000))[0], x[960:1000])
            assert held._slot[0][15] == stale.slot  # block 15 in block 0's old slot
            held._asked[0], held._state[0] = [stale], 1  # block 0 asked for before: its old answer
            np.testing.assert_array_equal(held.gather(np.arange(64))[0], x[:64])
            assert held.asked_again >= 1
            offset, size = held._arena[0].layout.slot_offset(stale.slot), held._arena[0].layout.slot_bytes
            assert not lock_range(other, offset, size, fcntl.F_WRLCK)  # block 15's lease held: no reuse
        finally:
            os.close(other)
            held.close()


def test_two_ranks_share_one_arena(h5: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two torchrun ranks (a DDP job, every batch checked against h5py's rows by the job) read
    the same arenas, without workers and with forked and spawned DataLoader workers (each
    process opens the arenas itself: its own open file description, its own leases): every row
    once per epoch between them, the workers' batches the rank's own, each block loaded once for
    the node an epoch, within the budget all along."""
    monkeypatch.setenv(ARENA_ENV, "1")
    job = Path(__file__).resolve().parents[1] / "jobs" / "stream_job.py"
    args = [str(h5), str(tmp_path / "out"), "--window", "1MiB", "--block-rows", str(BLOCK_ROWS), "--batch-size", "32",
            "--epochs", "2", "--loaders", LOADERS, "--resume-at", "0"]
    with running_daemon("--max-memory", str(BUDGET), "--loaders", "2") as d, watch_memory(d) as memory:
        reports = torchrun_two_ranks(job, args, tmp_path / "out", d.runtime_dir, 250)
        with DaemonClient(d.runtime_dir) as client:
            status = client.status()
    for name in LOADERS.split(","):
        for epoch in range(2):  # every row once between the ranks (the padding repeats a few: equal batch counts)
            per_rank = [r["runs"][name][epoch] for r in reports]
            assert len(per_rank[0]) == len(per_rank[1])
            rows = [row for batches in per_rank for batch in batches for row in batch]
            assert set(rows) == set(range(ROWS)) and len(rows) - ROWS < 2 * 32
    for r in reports:  # workers, forked or spawned, gather the same batches as the rank itself
        assert r["runs"]["make:2"] == r["runs"]["make:0"] == r["runs"]["make:1:spawn"]
    arenas, counters = status["arenas"], status["counters"]
    # x and y in arenas (removed once the job's last stream closed them), no block in a segment of its own
    assert arenas["arenas"] <= 2 <= arenas["arenas"] + arenas["removed"] and counters["loads"] == 0
    blocks = -(-ROWS // BLOCK_ROWS)
    # x's blocks (4x the budget) loaded once a node an epoch, y's (a small arena) at least once: the
    # ranks share each load; a slot reused while the other rank still needed it would load again
    epochs = 2 * len(LOADERS.split(","))  # each loader's two epochs, one after the other
    assert epochs * blocks + blocks <= arenas["loads"] <= epochs * blocks * 2 * 1.1, arenas
    # sampled all along: the budget's count, and what the arenas' files took in tmpfs
    assert memory.samples > 10 and 0 < memory.used <= BUDGET and 0 < memory.allocated <= BUDGET, vars(memory)


_HOLDER = """
import fcntl, sys, time
from h5serve.client.streaming.arena_blocks import _Mapped
from h5serve.wire.protocol import AcquireResult
result = AcquireResult(**eval(sys.argv[1]))
arena = _Mapped(result)
assert arena.lock(result.slot, fcntl.F_RDLCK) and arena.shows(result.slot, 0, result.generation)
print("leased", flush=True)
time.sleep(300)
"""


def test_a_dead_ranks_lease_goes_with_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank killed while it leases a slot (SIGKILL: no cleanup of its own) holds it no more:
    the kernel drops its OFD locks with its last descriptor, and the daemon reuses the slot."""
    monkeypatch.setenv(ARENA_ENV, "1")  # the daemon offers arenas
    path = make_h5(tmp_path / "small.h5", rows=1000, row_shape=(1024,))
    with running_daemon("--max-memory", str(1024 * 1024), "--loaders", "1") as d, DaemonClient(d.runtime_dir) as c:
        blocks = _blocks(path)
        first = c.acquire(blocks[0])
        holder = subprocess.Popen([sys.executable, "-c", _HOLDER, repr(vars(first))], stdout=subprocess.PIPE,
                                  text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "leased"
            answers = [c.acquire(b) for b in blocks[1:15]]  # every slot the budget holds
            arena = _Mapped(answers[0])
            try:
                for answer in answers:  # the other slots leased here: only block 0's could be reused
                    assert arena.lock(answer.slot, fcntl.F_RDLCK)
                with pytest.raises(BudgetExceeded):  # block 0's slot is the rank's, alive
                    c.acquire(blocks[15])
                holder.kill()
                holder.wait(timeout=10)
                reused = c.acquire(blocks[15])
                assert (reused.slot, reused.generation) == (first.slot, first.generation + 1)
            finally:
                arena.close()
        finally:
            holder.kill()
            holder.wait(timeout=10)


def test_a_daemon_killed_mid_epoch_and_started_again(h5: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon SIGKILLed mid-epoch and started again on its runtime dir: the rank reads the
    blocks it leases from the old arena's mapping meanwhile (unlinked by the new daemon with the
    other leftovers), then leases in the new daemon's arenas; every row of the epoch once, as in
    the file."""
    monkeypatch.setenv(ARENA_ENV, "1")
    with h5py.File(h5) as f:
        x = f["x"][:]
    with running_daemon("--max-memory", str(BUDGET), "--loaders", "2") as d:
        ds = SharedH5Dataset(h5, "x", "y", rank=0, world_size=1, runtime_dir=d.runtime_dir, fallback="error",
                             mode="stream", window="1MiB", block_rows=BLOCK_ROWS, timeout=60)
        try:
            seen = []
            for i, (xb, yb) in enumerate(make_loader(ds, 32, seed=0)):
                rows = yb.numpy()
                np.testing.assert_array_equal(xb.numpy(), x[rows])
                seen.append(rows)
                if i == 100:
                    old = set(d.segment_files())
                    os.kill(d.pid, signal.SIGKILL)
                    assert wait_for(lambda: not d.alive(), 10)
                    d.start()
            np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(ROWS))
            assert not old & set(d.segment_files())  # the old arenas removed, new ones made
            assert any(ARENA_MARK in name for name in d.segment_files())
        finally:
            ds.close()


def test_a_stalled_slot_load_is_killed_failed_and_loaded_again(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot load that makes no progress (its loader stopped: a hung file system) is killed after
    ``--stall-timeout``, its block answered with the stall's error (never a wait without end), the
    slot freed, and loaded again by a new loader once the error is forgotten."""
    monkeypatch.setenv(ARENA_ENV, "1")  # the daemon offers arenas
    path = make_h5(tmp_path / "small.h5", rows=1000, row_shape=(1024,))  # 16 blocks of 64 KiB
    stopped: list[int] = []
    with running_daemon("--max-memory", str(1024 * 1024), "--loaders", "1", "--stall-timeout", "2") as d, \
            DaemonClient(d.runtime_dir, timeout=5) as c:
        try:
            blocks = _blocks(path)
            assert c.acquire(blocks[0]).state == "ready"  # a kept loader now holds the file open
            assert wait_for(lambda: bool(holding(descendant_pids(d.pid), str(path))), 10)
            stopped = holding(descendant_pids(d.pid), str(path))
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)
            assert c.request(blocks[1])["state"] == "loading"
            assert wait_for(lambda: not any(alive(p) for p in stopped), 15), "the stopped loader was never killed"
            with pytest.raises(SegmentError, match=r"small\.h5\[x\] .*made no progress for 2s"):
                c.request(blocks[1])
            status = c.status()
            assert status["counters"]["stalled"] == 1, status["counters"]
            # the failure is answered for FAILURE_MEMORY_S, then the block loads again
            assert wait_for(lambda: _ready_or_stalled(c, blocks[1]), FAILURE_MEMORY_S + 30, interval=0.2)
            again = c.acquire(blocks[1])
            arena = _Mapped(again)
            try:
                assert arena.lock(again.slot, fcntl.F_RDLCK) and arena.shows(again.slot, 64, again.generation)
                with h5py.File(path) as f:
                    np.testing.assert_array_equal(arena.take(np.full(64, again.slot), np.arange(64)), f["x"][64:128])
            finally:
                arena.close()
            assert "made no progress for" in (d.runtime_dir / "h5serve.log").read_text()
        finally:
            for pid in stopped:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


def _ready_or_stalled(client: DaemonClient, request: Acquire) -> bool:
    """Whether ``request`` is answered without the stall's error (its new load queued or done)."""
    try:
        client.request(request)
    except SegmentError as exc:
        assert "made no progress" in str(exc), exc
        return False
    return True
