"""Many segments' rows side by side in one address range, so one gather reads across them.

A stream key's blocks are segments of their own (one per block, shared by the node's ranks and
jobs). Mapped one by one, a batch drawn across a window of W blocks is W gathers, a numpy call
and a Python step each: the cost per batch grows with the window. A ``Stitch`` reserves one
range of address space (``PROT_NONE``, no memory behind it) cut into equal slots, and maps
each block's rows into a slot of it (``MAP_FIXED`` over the reservation, read-only, shared): a
batch is then one fancy index over one strided array, ``view[slots, local_rows]``, whatever the
window. Removing a block maps the reservation back over its slot.

A slot's mapping holds the segment file open (the kernel's reference), so the segment's lease
(its ``flock``) lasts exactly as long as the block is in a slot, as it did while its own mapping
lived. Reading a slot that holds no block faults: callers gather only rows of placed blocks.

Fork: a child inherits the reservation and the mappings; it never places into or removes from
its parent's stitch (``close`` in the child unmaps the child's copy only). Linux only (libc's
``mmap`` through ctypes: Python's mmap module cannot map at a fixed address).
"""

from __future__ import annotations

import ctypes
import math
import os

import numpy as np

from ..errors import SegmentError
from ..util.units import PAGE_BYTES

__all__ = ["Stitch", "can_stitch", "mappings_in_use", "max_mappings"]

_PROT_NONE, _PROT_READ = 0, 1
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
_MAP_NORESERVE, _MAP_POPULATE = 0x4000, 0x8000
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


_LIBC = _libc() if os.uname().sysname == "Linux" else None


def _pages(size: int) -> int:
    return -(-size // PAGE_BYTES) * PAGE_BYTES


def max_mappings() -> int:
    """The most memory mappings the kernel lets a process have (``vm.max_map_count``; its
    default where it cannot be read)."""
    try:
        with open("/proc/sys/vm/max_map_count", "rb") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


def mappings_in_use() -> int:
    """The memory mappings this process has now (lines of ``/proc/self/maps``; 0 where it cannot be read)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def can_stitch(data_offset: int) -> bool:
    """Whether rows starting ``data_offset`` bytes into a segment can be mapped into a slot
    (the offset a whole number of pages, on Linux)."""
    return _LIBC is not None and data_offset % PAGE_BYTES == 0


class Stitch:
    """``slots`` slots of ``slot_bytes`` in one reserved range, each rounded up to whole pages
    and to whole ``row_bytes`` (so that the slots' rows are one evenly strided run of rows:
    ``flat``)."""

    def __init__(self, slots: int, slot_bytes: int, row_bytes: int = 1) -> None:
        if _LIBC is None:
            raise SegmentError("stitching segments needs Linux")
        self.slots = int(slots)
        unit = math.lcm(PAGE_BYTES, max(int(row_bytes), 1))
        self.slot_bytes = -(-max(int(slot_bytes), 1) // unit) * unit
        self.size = self.slots * self.slot_bytes
        self._pid = os.getpid()
        self._used = np.zeros(self.slots, dtype=bool)
        self._address = self._map(None, self.size, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0,
                                  "reserve address space for a stream's window")

    @staticmethod
    def _map(address: int | None, size: int, prot: int, flags: int, fd: int, offset: int, what: str) -> int:
        assert _LIBC is not None
        got = _LIBC.mmap(address, size, prot, flags, fd, offset)
        if got in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise SegmentError(f"could not {what}: {os.strerror(err)}; lower the window (window=) or raise "
                               "vm.max_map_count")
        if address is not None and got != address:
            raise SegmentError(f"could not {what}: the kernel mapped it elsewhere")
        return int(got)

    @property
    def free(self) -> int:
        """Slots holding no block."""
        return self.slots - int(self._used.sum()) if self._address else 0

    def place(self, fd: int, offset: int, length: int, slot: int | None = None) -> int:
        """Map ``length`` bytes of the file ``fd`` from ``offset`` (whole pages) read-only into
        ``slot`` (None: the lowest free one), which must be free; returns the slot. Its pages are
        faulted in at once (``MAP_POPULATE``: one call, not a fault per page as rows are read).

        Raised when no slot is free, the rows do not fit a slot, or the kernel refuses: SegmentError."""
        self._own()
        if length > self.slot_bytes or offset % PAGE_BYTES:
            raise SegmentError(f"{length} bytes from offset {offset} do not fit a slot of {self.slot_bytes} bytes")
        if slot is None:
            free = np.flatnonzero(~self._used[:])
            if not len(free):
                raise SegmentError(f"every one of the {self.slots} slots of the stream's window holds a block")
            slot = int(free[0])
        elif not 0 <= slot < self.slots or self._used[slot]:
            raise SegmentError(f"slot {slot} of the stream's window holds a block already (or does not exist)")
        if length:
            self._map(self._address + slot * self.slot_bytes, _pages(length), _PROT_READ,
                      _MAP_SHARED | _MAP_FIXED | _MAP_POPULATE,
                      fd, offset, "map a block into the stream's window")
        self._used[slot] = True
        return slot

    def remove(self, slot: int) -> None:
        """Map the reservation back over ``slot`` (its block's mapping, and with it the file, let go)."""
        self._own()
        self._map(self._address + slot * self.slot_bytes, self.slot_bytes, _PROT_NONE,
                  _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1, 0,
                  "free a slot of the stream's window")
        self._used[slot] = False

    def view(self, dtype: np.dtype, row_shape: tuple[int, ...]) -> np.ndarray:
        """The slots as one read-only array ``[slot, row, *row_shape]`` of ``dtype`` (rows packed
        from each slot's start). Index only rows of placed blocks; never hand the array out: it
        dies with ``close``."""
        self._own()
        row = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
        if row <= 0 or self.slot_bytes < row:
            raise SegmentError(f"a row of {row} bytes does not fit a slot of {self.slot_bytes} bytes")
        buffer = memoryview((ctypes.c_char * self.size).from_address(self._address)).cast("B")
        inner = [dtype.itemsize] * len(row_shape)  # C order within a row
        for i in range(len(row_shape) - 2, -1, -1):
            inner[i] = inner[i + 1] * int(row_shape[i + 1])
        array = np.ndarray((self.slots, self.slot_bytes // row, *row_shape), dtype=dtype, buffer=buffer,
                           strides=(self.slot_bytes, row, *inner))
        array.flags.writeable = False
        return array

    def flat(self, dtype: np.dtype, row_shape: tuple[int, ...]) -> np.ndarray:
        """``view`` with its slot and row axes as one: row ``r`` of slot ``s`` is row
        ``s * rows_per_slot + r`` (``rows_per_slot = slot_bytes // row bytes``), so a gather is one
        ``take`` along the first axis. Raised when a slot is not whole rows: SegmentError."""
        view = self.view(dtype, row_shape)
        if self.slot_bytes % view.strides[1]:
            raise SegmentError(f"a slot of {self.slot_bytes} bytes is not whole rows of {view.strides[1]} bytes")
        return view.reshape((-1, *row_shape))

    def close(self) -> None:
        """Unmap the whole range (every slot's block let go); in a forked child, its copy only."""
        if self._address and _LIBC is not None:
            _LIBC.munmap(self._address, self.size)
        self._address = 0

    def __del__(self) -> None:
        # freed unclosed (a dataset nobody closed, collected): the blocks' mappings, and with them
        # their files and leases, go too, or the daemon could not evict them until this process exits
        if getattr(self, "_address", 0):
            self.close()

    def _own(self) -> None:
        if self._pid != os.getpid():
            raise SegmentError("a stitch belongs to the process that made it; a forked child makes its own")
        if not self._address:
            raise SegmentError("the stitch is closed")
