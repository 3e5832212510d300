"""Copying a dataset's stored bytes from its file straight into a segment file.

When a dataset's rows sit in the file exactly as numpy holds them (no filters, the file's
type equal to the native memory type, whole rows per chunk), a load does not need HDF5 to
read them: it asks HDF5 once where the rows are, then ``pread``s them into a small reused
buffer and ``pwrite``s them into the segment file. That is about twice as fast as a
``read_direct`` into the segment's mapping, which has to fault in every 4 KiB tmpfs page
one by one (a ``pwrite`` fills tmpfs pages without faulting, and the buffer's pages are
faulted once). Anything else (filters, conversions, unallocated chunks, other drivers and
layouts) goes through h5py as before: ``stored_rows`` says which.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import h5py
import numpy as np

from .source import DatasetInfo

__all__ = ["COPY_BUFFER_BYTES", "MAX_MAPPED_CHUNKS", "StoredRows", "copy_rows", "read_stored_rows", "stored_rows", "write_all"]

COPY_BUFFER_BYTES = 4 * 1024 * 1024  # big enough for few syscalls, small enough to stay in cache
# Mapping a dataset's chunks costs ~0.6 us and 8 bytes each, in every process that reads: past
# this many chunks (tiny chunks of a huge dataset), its rows go through h5py instead.
MAX_MAPPED_CHUNKS = 1_000_000


@dataclass(frozen=True)
class StoredRows:
    """Where a dataset's rows are in its file. ``chunk_offsets[c]`` is the file offset of
    chunk ``c`` (rows ``c*chunk_rows ...``), -1 when that chunk was never written (HDF5
    returns the fill value for it, which only h5py knows); a contiguous dataset is one chunk."""

    fd: int  # HDF5's own descriptor of the file that holds the rows (valid while it is open)
    row_bytes: int
    chunk_rows: int
    chunk_offsets: np.ndarray


def _same_bytes_as_numpy(dset: h5py.Dataset, dtype: np.dtype) -> bool:
    """True when the file stores the rows in exactly the bytes numpy holds for ``dtype``."""
    if dset.dtype.kind not in "iufc" or dset.dtype.newbyteorder("=") != dtype or not dtype.isnative:
        return False
    try:
        return dset.id.get_type() == h5py.h5t.py_create(dtype)
    except (TypeError, ValueError):
        return False


def stored_rows(dset: h5py.Dataset, info: DatasetInfo, dtype: np.dtype) -> StoredRows | None:
    """Where ``dset``'s rows are in its file, or None when they cannot be copied byte for byte
    into an array of ``dtype`` (then read them through h5py)."""
    if dset.file.driver != "sec2" or not _same_bytes_as_numpy(dset, dtype) or info.rows == 0:
        return None
    dcpl = dset.id.get_create_plist()
    if dcpl.get_nfilters() or dcpl.get_external_count():
        return None
    row_bytes = int(np.prod(info.row_shape, dtype=np.int64)) * dtype.itemsize
    layout = dcpl.get_layout()
    if layout == h5py.h5d.CONTIGUOUS:
        offset = dset.id.get_offset()
        if offset is None:  # never written: HDF5 serves the fill value
            return None
        offsets = np.array([offset], dtype=np.int64)
        chunk_rows = info.rows
    elif layout == h5py.h5d.CHUNKED:
        if tuple(dset.chunks[1:]) != info.row_shape or not hasattr(dset.id, "chunk_iter"):
            return None  # a chunk holds parts of rows, or HDF5 < 1.14 cannot list chunks cheaply
        chunk_rows = int(dset.chunks[0])
        if -(-info.rows // chunk_rows) > MAX_MAPPED_CHUNKS:
            return None
        offsets = np.full(-(-info.rows // chunk_rows), -1, dtype=np.int64)
        chunk_bytes = chunk_rows * row_bytes

        def visit(chunk: h5py.h5d.StoreInfo) -> None:
            if chunk.size == chunk_bytes:
                offsets[chunk.chunk_offset[0] // chunk_rows] = chunk.byte_offset

        dset.id.chunk_iter(visit)
    else:  # compact (tiny, inside the object header) or virtual
        return None
    stored = StoredRows(fd=dset.file.id.get_vfd_handle(), row_bytes=row_bytes, chunk_rows=chunk_rows,
                        chunk_offsets=offsets)
    return stored if _offsets_check_out(dset, stored, dtype) else None


def _offsets_check_out(dset: h5py.Dataset, stored: StoredRows, dtype: np.dtype) -> bool:
    """True when the first and last stored rows read at their offsets equal h5py's reads.

    HDF5 2.0 reports offsets from the start of the file, user block included; this guards
    against any library that counts them differently (or any layout this module misreads):
    then the rows simply go through h5py.
    """
    allocated = np.flatnonzero(stored.chunk_offsets >= 0)
    if allocated.size == 0:
        return False
    rows = int(dset.shape[0])
    for row in (int(allocated[0]) * stored.chunk_rows, min((int(allocated[-1]) + 1) * stored.chunk_rows, rows) - 1):
        want = np.empty((1, *dset.shape[1:]), dtype=dtype)
        dset.read_direct(want, np.s_[row : row + 1])
        chunk = row // stored.chunk_rows
        at = int(stored.chunk_offsets[chunk]) + (row - chunk * stored.chunk_rows) * stored.row_bytes
        if os.pread(stored.fd, stored.row_bytes, at) != want.tobytes():
            return False
    return True


def copy_rows(stored: StoredRows, lo: int, hi: int, dest_fd: int, dest_offset: int, buffer: memoryview) -> bool:
    """Copy rows ``[lo, hi)`` as stored into ``dest_fd`` at ``dest_offset``, through ``buffer``.
    Returns False, having copied nothing, when some of those rows are in an unallocated chunk.

    Raised when the file cannot be read or ends early (a truncated file): OSError.
    """
    c0, c1 = lo // stored.chunk_rows, -(-hi // stored.chunk_rows)
    if (stored.chunk_offsets[c0:c1] < 0).any():
        return False
    extents = []  # (file offset, bytes), merged where chunks follow each other in the file
    for c in range(c0, c1):
        a, b = max(lo, c * stored.chunk_rows), min(hi, (c + 1) * stored.chunk_rows)
        start = int(stored.chunk_offsets[c]) + (a - c * stored.chunk_rows) * stored.row_bytes
        size = (b - a) * stored.row_bytes
        if extents and extents[-1][0] + extents[-1][1] == start:
            extents[-1] = (extents[-1][0], extents[-1][1] + size)
        else:
            extents.append((start, size))
    for start, size in extents:
        for done in range(0, size, len(buffer)):
            piece = buffer[: min(len(buffer), size - done)]
            _read_exactly(stored.fd, piece, start + done)
            write_all(dest_fd, piece, dest_offset + done)
        dest_offset += size
    return True


def read_stored_rows(stored: StoredRows, rows: np.ndarray, out: np.ndarray) -> bool:
    """Read the sorted, distinct global ``rows`` into ``out`` (one row each, C-contiguous, the
    source dtype) with one ``preadv`` per run of rows that follow each other in the file: a
    couple of microseconds a row, where an h5py read call costs tens. Returns False, having
    read nothing, when some of the rows are in unallocated chunks.

    Raised when the file cannot be read or ends early (a truncated file): OSError.
    """
    chunks = rows // stored.chunk_rows
    starts = stored.chunk_offsets[chunks]
    if (starts < 0).any():
        return False
    at = starts + (rows - chunks * stored.chunk_rows) * stored.row_bytes
    edges = [0, *(np.flatnonzero(np.diff(at) != stored.row_bytes) + 1).tolist(), len(rows)]
    flat = memoryview(out.reshape(-1).view(np.uint8))
    size = stored.row_bytes
    for s, e in zip(edges, edges[1:]):
        _read_exactly(stored.fd, flat[s * size : e * size], int(at[s]))
    return True


def _read_exactly(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` from ``fd`` at ``offset`` (a read may be short).

    Raised when the file ends first (truncated while it is read): OSError.
    """
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"the file ends at byte {offset + done}, inside the rows' data (truncated?)")
        done += n


def write_all(fd: int, data: memoryview, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset`` (a write may be short)."""
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
