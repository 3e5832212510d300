"""Stream blocks from a real daemon, fast: loaders kept between blocks (daemon/loading/loaderpool.py,
streamloader.py) and prefetches that never evict (daemon/store/prefetch.py). Successive blocks are
loaded by one loader process that stays (shown as ``h5serve-kept`` while it waits) and exits
once idle for KEPT_IDLE_S; a file replaced at its path between two blocks is read anew (the
loader never serves rows of the file it kept open for a new identity); a prefetch is refused
rather than evict a block prefetched for another rank and not needed yet."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.client.backends.attach import open_acquired
from h5serve.daemon.loading.loaderpool import KEPT_IDLE_S
from h5serve.wire.connection import DaemonClient
from h5serve.wire.protocol import Acquire

from ..helpers import make_h5, running_daemon, wait_for

pytestmark = pytest.mark.timeout(120)

ROWS, BLOCK = 1024, 128


def _named(daemon_pid: int, name: str) -> list[int]:
    """The daemon's descendants whose /proc comm is ``name``."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    parents[int(entry)] = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, todo = [], [daemon_pid]
    while todo:
        parent = todo.pop()
        for child, ppid in parents.items():
            if ppid == parent:
                todo.append(child)
                try:
                    with open(f"/proc/{child}/comm") as f:
                        if f.read().strip() == name:
                            found.append(child)
                except OSError:
                    pass
    return found


def _block(client: DaemonClient, path: Path, key: str, block: int) -> np.ndarray:
    result = client.acquire(Acquire(str(path), key, 1, 0, "stream", rows=(block * BLOCK, (block + 1) * BLOCK)))
    segment = open_acquired(client, result)
    try:
        return np.array(segment.data)
    finally:
        segment.close()


def test_successive_stream_blocks_are_loaded_by_one_kept_loader(tmp_path: Path) -> None:
    h5 = make_h5(tmp_path / "data.h5", rows=ROWS, row_shape=(64,))
    with h5py.File(h5) as f:
        x, y = f["x"][:], f["y"][:]
    with running_daemon("--loaders", "1") as d, DaemonClient(d.runtime_dir, timeout=30) as client:
        kept: set[int] = set()
        for block in range(ROWS // BLOCK):
            for key, want in (("x", x), ("y", y)):
                got = _block(client, h5, key, block)
                np.testing.assert_array_equal(got, want[block * BLOCK:(block + 1) * BLOCK])
                assert wait_for(lambda: len(_named(d.pid, "h5serve-kept")) == 1, 10), "no loader kept"
                kept |= set(_named(d.pid, "h5serve-kept"))
        assert len(kept) == 1, f"16 block loads went to {len(kept)} kept loaders, not one"
        loads = client.status()["counters"]["loads"]
        assert loads >= 2 * ROWS // BLOCK
        # idle for KEPT_IDLE_S: it exits (the daemon closes its job pipe), and the next block starts another
        assert wait_for(lambda: not _named(d.pid, "h5serve-kept"), KEPT_IDLE_S + 15), "the kept loader stayed"
        np.testing.assert_array_equal(_block(client, h5, "x", 0), x[:BLOCK])


def test_a_kept_loader_never_locks_writers_out(tmp_path: Path) -> None:
    """HDF5 locks the files it opens: the file a kept loader holds open must not make a writer
    of it fail (a one-load loader held it for one load only)."""
    h5 = make_h5(tmp_path / "data.h5", rows=ROWS, row_shape=(64,))
    with running_daemon("--loaders", "1") as d, DaemonClient(d.runtime_dir, timeout=30) as client:
        _block(client, h5, "x", 0)
        assert wait_for(lambda: len(_named(d.pid, "h5serve-kept")) == 1, 10)
        with h5py.File(h5, "r+") as f:  # raised "unable to lock file" with HDF5's lock held
            f["x"][0] = 1
        with h5py.File(h5, "w") as f:
            f.create_dataset("x", data=np.zeros((ROWS, 64), np.uint8), chunks=(64, 64))


def test_a_file_replaced_between_blocks_is_read_anew(tmp_path: Path) -> None:
    """The kept loader holds the first file open; after the path is replaced by another file
    (another inode), the next block's rows are the new file's, never the kept one's."""
    h5 = make_h5(tmp_path / "data.h5", rows=ROWS, row_shape=(64,))
    with running_daemon("--loaders", "1") as d, DaemonClient(d.runtime_dir, timeout=30) as client:
        first = _block(client, h5, "x", 0)
        assert wait_for(lambda: len(_named(d.pid, "h5serve-kept")) == 1, 10)
        other = tmp_path / "other.h5"
        with h5py.File(other, "w") as f:
            f.create_dataset("x", data=np.full((ROWS, 64), 7, np.uint8), chunks=(64, 64))
        os.replace(other, h5)
        # the daemon resolves the path again once it sees the change (its stale sweep, or a miss)
        assert wait_for(lambda: bool((_block(client, h5, "x", 1) == 7).all()), 30), "block 1 of the old file served"
        assert (_block(client, h5, "x", 2) == 7).all()
        assert not (first == 7).all()


def test_a_prefetch_is_refused_rather_than_evict_another_ranks_next_block(tmp_path: Path) -> None:
    """A budget of 3 blocks: blocks 0-1 needed (then let go), blocks 2-3 prefetched. A prefetch
    of block 4 may evict the needed blocks but not the prefetched ones nobody needed yet: it is
    refused once only they are left; a request that needs block 5 still gets it."""
    from h5serve.errors import BudgetExceeded

    h5 = make_h5(tmp_path / "data.h5", rows=ROWS, row_shape=(64,))
    cost = 4096 + BLOCK * 64  # a header page and the rows
    with running_daemon("--max-memory", str(3 * cost), "--loaders", "1") as d, \
            DaemonClient(d.runtime_dir, timeout=30) as client:
        def ask(block: int, prefetch: bool) -> None:
            client.acquire(Acquire(str(h5), "x", 1, 0, "stream", rows=(block * BLOCK, (block + 1) * BLOCK),
                                   prefetch=prefetch))

        _block(client, h5, "x", 0)
        _block(client, h5, "x", 1)
        ask(2, prefetch=True)  # evicts nothing: room for a third
        ask(3, prefetch=True)  # evicts block 0 (needed, let go)
        ask(4, prefetch=True)  # evicts block 1
        with pytest.raises(BudgetExceeded):
            ask(5, prefetch=True)  # only blocks 2-4 are left, prefetched and not needed yet
        counters = client.status()["counters"]
        assert counters["evictions"] == 2 and counters["loads"] == 5, counters
        ask(5, prefetch=False)  # needed: evicts a prefetched block (the least recently asked)
        assert client.status()["counters"]["evictions"] == 3


def test_a_file_rewritten_in_place_between_blocks_is_read_at_its_new_places(tmp_path: Path) -> None:
    """A kept loader remembers where each dataset's chunks are in the file it keeps open; the
    same file (same inode) rewritten with another layout between two blocks is a new identity:
    its rows are read from where the new file stores them, never from the old offsets."""
    h5 = make_h5(tmp_path / "data.h5", rows=ROWS, row_shape=(64,))
    with running_daemon("--loaders", "1") as d, DaemonClient(d.runtime_dir, timeout=30) as client:
        inode = os.stat(h5).st_ino
        with h5py.File(h5) as f:
            np.testing.assert_array_equal(_block(client, h5, "x", 0), f["x"][:BLOCK])
        assert wait_for(lambda: len(_named(d.pid, "h5serve-kept")) == 1, 10)
        new = np.arange(ROWS * 64, dtype=np.uint64).reshape(ROWS, 64).astype(np.uint8) ^ 0x5A
        with h5py.File(h5, "w") as f:  # truncated in place: x's chunks now start after 1 MiB of padding
            f.create_dataset("pad", data=np.ones(1 << 20, np.uint8))
            f.create_dataset("x", data=new, chunks=(32, 64))
            f.create_dataset("y", data=np.arange(ROWS, dtype=np.int64))
        assert os.stat(h5).st_ino == inode
        assert wait_for(lambda: np.array_equal(_block(client, h5, "x", 1), new[BLOCK:2 * BLOCK]), 30), \
            "block 1 of the rewritten file was not served from its new places"
        for block in (2, 3):
            np.testing.assert_array_equal(_block(client, h5, "x", block), new[block * BLOCK:(block + 1) * BLOCK])
