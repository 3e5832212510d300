"""The stream arena's file layout and leases (segments/arena.py):
the header read back as written, a file that is no arena refused, OFD locks that conflict
between open file descriptions and never within one, and a punched slot's pages given back."""

from __future__ import annotations

import fcntl
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from h5serve.errors import SegmentError
from h5serve.segments.arena import (
    ArenaLayout,
    lock_range,
    locked_by_others,
    punch_hole,
    read_layout,
    table_of,
    write_header,
)
from h5serve.util.units import PAGE_BYTES

LAYOUT = ArenaLayout(n_slots=300, rows_per_slot=100, row_bytes=3 * 4 * 4 * 4, dtype="<f4", row_shape=(3, 4, 4))


@pytest.fixture
def arena_file() -> Iterator[Path]:
    path = Path("/dev/shm") / f"h5serve-test-arena-{secrets.token_hex(8)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, LAYOUT.file_size)
        write_header(fd, LAYOUT)
        yield path
    finally:
        os.close(fd)
        path.unlink()


def test_the_layout_reads_back_and_slots_are_whole_pages(arena_file: Path) -> None:
    layout = read_layout(arena_file.read_bytes()[:PAGE_BYTES])
    assert layout == LAYOUT
    assert layout.data_offset % PAGE_BYTES == 0 and layout.slot_bytes % PAGE_BYTES == 0
    assert layout.slot_bytes >= layout.rows_per_slot * layout.row_bytes
    assert layout.data_offset >= PAGE_BYTES + 300 * 24  # the table fits before the slots
    assert layout.slot_offset(2) == layout.data_offset + 2 * layout.slot_bytes


def test_a_file_that_is_no_arena_is_refused() -> None:
    with pytest.raises(SegmentError):
        read_layout(bytes(PAGE_BYTES))
    with pytest.raises(SegmentError):
        read_layout(b"H5SARENA" + bytes(PAGE_BYTES - 8))


def test_a_read_lock_keeps_the_daemons_write_lock_off_its_slot_only(arena_file: Path) -> None:
    daemon, rank, other = (os.open(arena_file, flags) for flags in (os.O_RDWR, os.O_RDONLY, os.O_RDONLY))
    try:
        slot0, slot1, size = LAYOUT.slot_offset(0), LAYOUT.slot_offset(1), LAYOUT.slot_bytes
        assert lock_range(rank, slot0, size, fcntl.F_RDLCK) and lock_range(other, slot0, size, fcntl.F_RDLCK)
        assert not lock_range(daemon, slot0, size, fcntl.F_WRLCK)  # two readers: no reuse
        assert lock_range(daemon, slot1, size, fcntl.F_WRLCK)  # the next slot is free to take
        assert locked_by_others(daemon, slot0, size) and not locked_by_others(daemon, slot1, size)  # own: not counted
        assert not lock_range(rank, slot1, size, fcntl.F_RDLCK)  # being rewritten: the rank asks again
        lock_range(rank, slot0, size, fcntl.F_UNLCK)
        assert not lock_range(daemon, slot0, size, fcntl.F_WRLCK)  # the other reader still holds it
        os.close(other)  # its last descriptor: its lease goes with it, as with a dead rank
        other = -1
        assert lock_range(daemon, slot0, size, fcntl.F_WRLCK)
        dup = os.dup(daemon)  # one open file description: never a conflict with itself
        assert lock_range(dup, slot0, size, fcntl.F_RDLCK)
        os.close(dup)
    finally:
        for fd in (daemon, rank, other):
            if fd >= 0:
                os.close(fd)


def test_a_punched_slot_gives_its_pages_back(arena_file: Path) -> None:
    fd = os.open(arena_file, os.O_RDWR)
    try:
        os.pwrite(fd, b"\1" * LAYOUT.slot_bytes, LAYOUT.slot_offset(3))
        before = os.fstat(fd).st_blocks
        punch_hole(fd, LAYOUT.slot_offset(3), LAYOUT.slot_bytes)
        assert os.fstat(fd).st_blocks * 512 <= before * 512 - LAYOUT.slot_bytes
        assert os.fstat(fd).st_size == LAYOUT.file_size
        assert os.pread(fd, 16, LAYOUT.slot_offset(3)) == bytes(16)
    finally:
        os.close(fd)


def test_the_table_is_every_slots_block_generation_and_state(arena_file: Path) -> None:
    import mmap

    fd = os.open(arena_file, os.O_RDWR)
    try:
        with mmap.mmap(fd, LAYOUT.data_offset) as m:
            table = table_of(m, LAYOUT)
            assert table.shape == (300, 3) and not table.any()  # every slot free at creation
            table[5] = (1200, 3, 2)
            del table
        assert read_layout(arena_file.read_bytes()[:PAGE_BYTES]) == LAYOUT  # the header untouched
    finally:
        os.close(fd)
