"""Segments side by side in one address range (h5serve/segments/stitch.py): one gather reads
across them, a placed block keeps its file's lease, and a removed one lets it go."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import numpy as np
import pytest

from h5serve.errors import SegmentError
from h5serve.segments.stitch import Stitch, can_stitch
from h5serve.util.units import PAGE_BYTES

pytestmark = pytest.mark.skipif(not can_stitch(0), reason="stitching needs Linux")

ROW = (3, 5)


def _block(tmp_path: Path, name: str, rows: np.ndarray) -> Path:
    """A file shaped as a segment: one header page, then the rows."""
    path = tmp_path / name
    path.write_bytes(b"h" * PAGE_BYTES + rows.tobytes())
    return path


def test_one_gather_reads_rows_of_many_blocks(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 1 << 30, (n, *ROW)).astype(np.int32) for n in (100, 100, 37)]
    stitch = Stitch(8, blocks[0].nbytes)
    try:
        slots = []
        for i, rows in enumerate(blocks):
            fd = os.open(_block(tmp_path, f"b{i}", rows), os.O_RDONLY)
            try:
                slots.append(stitch.place(fd, PAGE_BYTES, rows.nbytes))
            finally:
                os.close(fd)  # the mapping keeps the file
        view = stitch.view(np.dtype(np.int32), ROW)
        which = rng.integers(0, 3, 500)
        local = np.array([rng.integers(0, len(blocks[b])) for b in which])
        got = view[np.array(slots)[which], local]
        want = np.stack([blocks[b][r] for b, r in zip(which, local)])
        assert np.array_equal(got, want)
        assert not view.flags.writeable
    finally:
        stitch.close()


def test_a_placed_block_keeps_its_lease_and_a_removed_one_lets_it_go(tmp_path: Path) -> None:
    path = _block(tmp_path, "leased", np.arange(40, dtype=np.int64))
    stitch = Stitch(2, 40 * 8)
    try:
        fd = os.open(path, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        slot = stitch.place(fd, PAGE_BYTES, 40 * 8)
        os.close(fd)  # only the slot's mapping holds the file (and its lease) now
        other = os.open(path, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # an eviction finds it held
            assert stitch.view(np.dtype(np.int64), ())[slot, 39] == 39
            stitch.remove(slot)
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # let go with its slot
        finally:
            os.close(other)
        assert stitch.free == 2
    finally:
        stitch.close()


def test_slots_run_out_and_bad_placements_are_refused(tmp_path: Path) -> None:
    path = _block(tmp_path, "one", np.zeros(10, dtype=np.uint8))
    stitch = Stitch(1, 10)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(SegmentError, match="do not fit"):
            stitch.place(fd, PAGE_BYTES, 2 * PAGE_BYTES)
        with pytest.raises(SegmentError, match="do not fit"):
            stitch.place(fd, 100, 10)
        stitch.place(fd, PAGE_BYTES, 10)
        with pytest.raises(SegmentError, match="every one of the 1 slots"):
            stitch.place(fd, PAGE_BYTES, 10)
    finally:
        os.close(fd)
        stitch.close()
    with pytest.raises(SegmentError, match="closed"):
        stitch.view(np.dtype(np.uint8), ())


def test_a_forked_child_never_touches_its_parents_stitch(tmp_path: Path) -> None:
    path = _block(tmp_path, "forked", np.arange(16, dtype=np.int64))
    stitch = Stitch(2, 16 * 8)
    try:
        fd = os.open(path, os.O_RDONLY)
        slot = stitch.place(fd, PAGE_BYTES, 16 * 8)
        os.close(fd)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                try:
                    stitch.place(os.open(path, os.O_RDONLY), PAGE_BYTES, 8)
                except SegmentError:
                    stitch.close()  # the child's copy only
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert stitch.view(np.dtype(np.int64), ())[slot, 15] == 15  # the parent's mapping is intact
    finally:
        stitch.close()
