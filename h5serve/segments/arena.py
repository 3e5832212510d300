"""The stream arena (docs/architecture.md, *Stream arena*): one shm
file per (source file identity, key, dtype, block rows) holding a stream's blocks of fixed-size
rows in fixed slots, so that a rank maps each key once and a batch is one gather.

Layout: page 0 is the header (``HEADER``: magic, version, slot count, bytes a slot, rows a
slot, bytes a row, where the data starts, then the rows' dtype and shape as msgpack); from
``TABLE_OFFSET`` the slot table, ``n_slots`` rows of three int64 (block start row, generation,
state), written only by the daemon; from ``data_offset`` (a whole number of pages) the slots,
``slot_bytes`` apart (a block's rows rounded up to pages).

Leases are OFD byte-range locks (``F_OFD_SETLK``) on a slot's data range: a rank holds a read
lock on its own open file description while it reads the slot; the daemon rewrites a slot only
under a write lock taken without waiting on its own descriptor. Linux only (OFD locks).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import struct
from dataclasses import dataclass

import msgpack
import numpy as np

from ..errors import SegmentError
from ..util.units import PAGE_BYTES

__all__ = ["ArenaLayout", "ArenaTarget", "FREE", "LOADING", "READY", "read_layout", "write_header", "table_of",
           "lock_range", "punch_hole", "locked_by_others", "ARENA_MARK",
           "ARENA_VERSION", "TABLE_OFFSET"]

ARENA_MARK = "arena-"  # after the daemon's prefix: the arena files among its segments
_MAGIC, _VERSION = b"H5SARENA", 1
ARENA_VERSION = _VERSION  # what a daemon's ping offers and a client maps (the layout's version)
# magic, version, pad, n_slots, slot_bytes, rows_per_slot, row_bytes, data_offset, meta length
HEADER = struct.Struct("<8sIIQQQQQI")
TABLE_OFFSET = PAGE_BYTES
FREE, LOADING, READY = 0, 1, 2  # a slot's state in the table
_FLOCK = struct.Struct("hh4xqqi4x")  # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)


def _pages(size: int) -> int:
    return -(-size // PAGE_BYTES) * PAGE_BYTES


@dataclass(frozen=True)
class ArenaLayout:
    """Where everything is in one arena file."""

    n_slots: int
    rows_per_slot: int
    row_bytes: int
    dtype: str
    row_shape: tuple[int, ...]

    @property
    def slot_bytes(self) -> int:
        return _pages(self.rows_per_slot * self.row_bytes)

    @property
    def data_offset(self) -> int:
        return TABLE_OFFSET + _pages(self.n_slots * 24)

    @property
    def file_size(self) -> int:
        return self.data_offset + self.n_slots * self.slot_bytes

    def slot_offset(self, slot: int) -> int:
        return self.data_offset + slot * self.slot_bytes


@dataclass(frozen=True)
class ArenaTarget:
    """Where a loader writes a block: the arena file ``name`` (inode ``ino``) in the shm dir,
    ``offset`` bytes in (a whole number of pages), ``nbytes`` of rows."""

    name: str
    ino: int
    offset: int
    nbytes: int


def write_header(fd: int, layout: ArenaLayout) -> None:
    """Write ``layout``'s header into a new arena file (the table is zeros: every slot free)."""
    blob = msgpack.packb({"dtype": layout.dtype, "row_shape": list(layout.row_shape)})
    head = HEADER.pack(_MAGIC, _VERSION, 0, layout.n_slots, layout.slot_bytes, layout.rows_per_slot,
                       layout.row_bytes, layout.data_offset, len(blob))
    if HEADER.size + len(blob) > TABLE_OFFSET:
        raise SegmentError("an arena's header does not fit its page")
    os.pwrite(fd, head + blob, 0)


def read_layout(header: bytes) -> ArenaLayout:
    """The layout an arena's first page describes.

    Raised when it is no arena of this version or does not add up: SegmentError."""
    try:
        magic, version, _, n_slots, slot_bytes, rows, row_bytes, data_offset, length = HEADER.unpack_from(header)
        meta = msgpack.unpackb(header[HEADER.size:HEADER.size + length])
        layout = ArenaLayout(n_slots, rows, row_bytes, str(meta["dtype"]), tuple(int(d) for d in meta["row_shape"]))
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise SegmentError(f"not a stream arena: {exc}") from exc
    if (magic, version) != (_MAGIC, _VERSION) or (layout.slot_bytes, layout.data_offset) != (slot_bytes, data_offset):
        raise SegmentError("not a stream arena of this version, or its header does not add up")
    if np.dtype(layout.dtype).itemsize * int(np.prod(layout.row_shape, dtype=np.int64)) != row_bytes:
        raise SegmentError("a stream arena's row size does not match its dtype and shape")
    return layout


def table_of(buffer: mmap.mmap, layout: ArenaLayout) -> np.ndarray:
    """The slot table in ``buffer`` (the arena mapped from offset 0): ``[slot] = (block start,
    generation, state)``, int64."""
    return np.ndarray((layout.n_slots, 3), dtype="<i8", buffer=buffer, offset=TABLE_OFFSET)


def lock_range(fd: int, start: int, length: int, kind: int) -> bool:
    """Take (``fcntl.F_RDLCK``/``F_WRLCK``) or drop (``F_UNLCK``) an OFD lock on ``[start, start
    + length)`` of ``fd``'s open file description, without waiting. False: another description
    holds a conflicting lock."""
    try:
        fcntl.fcntl(fd, _F_OFD_SETLK, _FLOCK.pack(kind, 0, start, length, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def locked_by_others(fd: int, start: int, length: int) -> bool:
    """Whether another open file description holds any lock on ``[start, start + length)``
    (``F_OFD_GETLK``: ``fd``'s own locks never count)."""
    found = fcntl.fcntl(fd, _F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, 0, start, length, 0))
    return bool(_FLOCK.unpack(found)[0] != fcntl.F_UNLCK)


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def punch_hole(fd: int, start: int, length: int) -> None:
    """Give back the pages of ``[start, start + length)`` of a tmpfs file (the size stays).

    Raised when the kernel refuses: OSError."""
    if _LIBC.fallocate(fd, _FALLOC_FL_KEEP_SIZE | _FALLOC_FL_PUNCH_HOLE, start, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
