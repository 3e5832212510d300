"""The stream arena with DataLoader workers: forked and spawned
workers yield every row once, in the order a rank gets without the arena (and without workers);
and a forked process's leases are its own: it never unlocks through the open file description it
inherited (its parent's leases), it opens the arenas anew and its leases hold a slot by
themselves."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.client import SharedH5Dataset, make_loader
from h5serve.segments.arena import lock_range
from h5serve.wire.runtime import ARENA_ENV, resolve_shm_dir

from ..helpers import make_h5, running_daemon

pytestmark = pytest.mark.timeout(300)

ROWS, SHAPE, BLOCK_ROWS = 4097, (1024,), 128  # 33 blocks of 128 KiB (the last of 1 row): 4 MiB of x
BUDGET = 2 * 1024 * 1024  # half the file: slots reused within an epoch


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_h5(tmp_path_factory.mktemp("arena-workers") / "data.h5", rows=ROWS, row_shape=SHAPE)


def _dataset(h5: Path, runtime_dir: Path) -> SharedH5Dataset:
    return SharedH5Dataset(h5, "x", "y", rank=0, world_size=1, runtime_dir=runtime_dir, fallback="error",
                           mode="stream", window="512KiB", block_rows=BLOCK_ROWS, timeout=60)


def _epochs(h5: Path, runtime_dir: Path, workers: int, context: str | None = None) -> list[np.ndarray]:
    """Two epochs' rows in the order the loader yields them, each batch's x checked against the file."""
    with h5py.File(h5) as f:
        x = f["x"][:]
    ds = _dataset(h5, runtime_dir)
    kwargs = {} if context is None else {"multiprocessing_context": context}
    try:
        loader = make_loader(ds, 32, seed=0, num_workers=workers, timeout=120 if workers else 0, **kwargs)
        epochs = []
        for epoch in range(2):
            loader.batch_sampler.set_epoch(epoch)  # type: ignore[union-attr]
            seen = []
            for xb, yb in loader:
                rows = yb.numpy()
                np.testing.assert_array_equal(xb.numpy(), x[rows])
                seen.append(rows)
            order = np.concatenate(seen)
            np.testing.assert_array_equal(np.sort(order), np.arange(ROWS))
            epochs.append(order)
        assert ds.backend == "shm"
        return epochs
    finally:
        ds.close()


def test_workers_forked_and_spawned_yield_the_order_without_the_arena(
        h5: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ARENA_ENV, "1")
    with running_daemon("--max-memory", str(BUDGET), "--loaders", "2") as d:
        monkeypatch.setenv(ARENA_ENV, "0")
        reference = _epochs(h5, d.runtime_dir, 0)
        assert d.status()["arenas"]["arenas"] == 0  # the reference took a segment per block
        monkeypatch.setenv(ARENA_ENV, "1")
        for workers, context in ((2, "fork"), (2, "spawn")):
            got = _epochs(h5, d.runtime_dir, workers, context)
            for mine, theirs in zip(got, reference):
                np.testing.assert_array_equal(mine, theirs, err_msg=f"{workers} {context} workers")
        status = d.status()
        assert status["arenas"]["arenas"] == 2 and status["arenas"]["loads"] > 0  # the workers used the arenas
        assert status["memory"]["used"] <= BUDGET


def _write_lockable(path: Path, start: int, length: int) -> bool:
    """Whether a write lock on [start, start + length) of ``path`` can be had now (the daemon's
    test before it reuses a slot), through a description of its own, let go at once."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        return lock_range(fd, start, length, fcntl.F_WRLCK)
    finally:
        os.close(fd)  # the lock, if taken, goes with the description


def test_a_forked_process_leases_on_its_own(h5: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent leases block 0; a forked child (as a DataLoader worker is) lets go of block 0
    through the very ArenaBlocks it inherited, then gathers block 0 itself: the parent's lease
    stands (the child never unlocked through the parent's description), and once the parent lets
    go, the child's own lease still holds the slot, until the child exits."""
    monkeypatch.setenv(ARENA_ENV, "1")
    with running_daemon("--max-memory", str(BUDGET), "--loaders", "1") as d:
        ds = _dataset(h5, d.runtime_dir)
        try:
            blocks = ds._backend.cache  # type: ignore[attr-defined]
            arena_blocks = blocks._arena
            assert arena_blocks is not None, "the stream does not use the arenas"
            rows = np.arange(10, dtype=np.int64)
            blocks.gather(rows)
            mapped = arena_blocks._arena[0]
            slot = int(arena_blocks._slot[0][0])
            path = resolve_shm_dir() / mapped.name
            span = (mapped.layout.slot_offset(slot), mapped.layout.slot_bytes)
            assert not _write_lockable(path, *span)  # the parent's lease
            to_child_r, to_child_w = os.pipe()
            to_parent_r, to_parent_w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: exits with 0 only when every step held
                code = 1
                try:
                    os.close(to_child_w)
                    os.close(to_parent_r)
                    arena_blocks.release(np.array([0]))  # inherited: must not unlock the parent's lease
                    ok = not _write_lockable(path, *span)
                    blocks.gather(rows)  # its own lease, through its own description
                    mine = blocks._arena._arena[0]  # the arena opened anew in this process
                    ok = ok and mine is not mapped and mine.pid == os.getpid()
                    os.write(to_parent_w, b"1" if ok else b"0")
                    os.read(to_child_r, 1)  # until the parent has let go of its own lease
                    code = 0 if ok else 2
                finally:
                    os._exit(code)
            os.close(to_child_r)
            os.close(to_parent_w)
            try:
                assert os.read(to_parent_r, 1) == b"1", "the child let go of the parent's lease"
                assert not _write_lockable(path, *span)  # parent and child hold it
                arena_blocks.release(np.array([0]))  # the parent lets go
                assert int(arena_blocks._slot[0][0]) == -1
                assert not _write_lockable(path, *span), "the child's lease was not its own"
                os.write(to_child_w, b"1")
            finally:
                _, status = os.waitpid(pid, 0)
                os.close(to_child_w)
                os.close(to_parent_r)
            assert os.waitstatus_to_exitcode(status) == 0
            assert _write_lockable(path, *span)  # nobody holds the slot now
        finally:
            ds.close()
