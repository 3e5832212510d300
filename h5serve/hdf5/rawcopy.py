"""Copying a dataset's stored bytes from its file straight into a segment file.

When a dataset's rows sit in the file exactly as numpy holds them (no filters, the file's
type equal to the native memory type, whole rows per chunk), a load does not need HDF5 to
read them: it asks HDF5 once where the rows are, then moves them into the segment file
kernel-side with ``splice`` through a pipe (``FileCopier``): the file's cached pages go into
the pipe by reference and are copied once, into tmpfs, never through user memory. Where
splice is refused (another kernel or file system) it ``pread``s them into a small reused
buffer and ``pwrite``s them. Either is about twice as fast as a ``read_direct`` into the
segment's mapping, which has to fault in every 4 KiB tmpfs page one by one; splice measured
1.24x pread/pwrite (median of 15 paired runs of a 293 MiB copy from a cached ext4 file into a
fallocated /dev/shm file, 1.07x-1.79x; ``sendfile`` 1.19x, but it writes at the shared file
position; ``copy_file_range`` is refused across file systems: EXDEV).

A copy whose bytes must be hashed (a load's checksum) goes through a small buffer instead,
``pread``, hash, ``pwrite``: the bytes are hashed while they sit in the CPU's cache. Hashing
them afterwards through the segment's mapping reads every byte from memory a second time and
faults in every page; on the bench's 2-core VM, whose copies are bound by memory bandwidth,
that made the copy 1.6x slower (307 MB: splice 77-84 ms, splice followed by a hashing thread
133-141 ms, hashed through a 512 KiB buffer 111-128 ms; 12 alternating runs). Anything else
(filters, conversions, unallocated chunks, other drivers and layouts) goes through h5py as
before: ``stored_rows`` says which.

``data_extents`` says which bytes of the file reading a row range reads (for any chunked or
contiguous dataset, filtered or not), so that a load can drop exactly those pages from the
page cache afterwards (``drop_cached``): the rows then live once on the node, in the segment.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import h5py
import numpy as np

from ..util.units import row_nbytes
from .source import DatasetInfo

__all__ = ["COPY_BUFFER_BYTES", "HASHED_COPY_BYTES", "MAX_MAPPED_CHUNKS", "WRITE_BEHIND_MIN_BYTES", "FileCopier",
           "Hasher", "StoredRows", "WriteBehind", "copy_rows", "data_extents", "drop_cached", "raw_layout",
           "read_stored_rows", "stored_rows", "write_all"]

COPY_BUFFER_BYTES = 4 * 1024 * 1024  # big enough for few syscalls, small enough to stay in cache
HASHED_COPY_BYTES = 512 * 1024  # a hashed copy's buffer: read, hashed and written from the CPU's cache
# a hashed copy of fewer bytes has no second buffer to read while the first is written: a writer
# thread (WriteBehind) would only cost its start (a stream block of a few small chunks)
WRITE_BEHIND_MIN_BYTES = 2 * HASHED_COPY_BYTES
PIPE_BYTES = 1024 * 1024  # splice's pipe: Linux's default pipe-max-size (an unprivileged process may ask for it)
# splice refused for these file descriptors: copy through a buffer instead
_NO_SPLICE = {errno.EINVAL, errno.ENOSYS, errno.EXDEV, errno.EOPNOTSUPP, errno.EBADF, errno.ESPIPE}
# Mapping a dataset's chunks costs ~0.6 us and 8 bytes each, in every process that reads: past
# this many chunks (tiny chunks of a huge dataset), its rows go through h5py instead.
MAX_MAPPED_CHUNKS = 1_000_000


# Sees every byte a copy writes, in the order of the destination: a running checksum's update.
Hasher = Callable[[memoryview], None]


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


def raw_layout(dset: h5py.Dataset, info: DatasetInfo, dtype: np.dtype) -> int | None:
    """``dset``'s storage layout (h5py.h5d.CONTIGUOUS, CHUNKED, ...) when its stored bytes are
    the rows as an array of ``dtype`` holds them (no filter, no external file, the same byte
    order and width); None when they must be read through h5py, or there are no rows."""
    if not _same_bytes_as_numpy(dset, dtype) or info.rows == 0:
        return None
    dcpl = dset.id.get_create_plist()
    if dcpl.get_nfilters() or dcpl.get_external_count():
        return None
    return int(dcpl.get_layout())


def stored_rows(dset: h5py.Dataset, info: DatasetInfo, dtype: np.dtype) -> StoredRows | None:
    """Where ``dset``'s rows are in its file, or None when they cannot be copied byte for byte
    into an array of ``dtype`` (then read them through h5py)."""
    layout = raw_layout(dset, info, dtype) if dset.file.driver == "sec2" else None
    if layout is None:
        return None
    row_bytes = row_nbytes(info.row_shape, dtype)
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


class FileCopier:
    """Copies byte ranges from one file into another: ``splice`` through a pipe of its own
    (explicit offsets on both sides, so processes sharing a destination descriptor never race
    on its file position), else ``pread``/``pwrite`` through a buffer; a copy that is hashed
    as it goes, through a buffer of at most HASHED_COPY_BYTES. Close it when done."""

    def __init__(self, buffer_bytes: int = COPY_BUFFER_BYTES, splice: bool = True, write_behind: bool = False) -> None:
        self._buffer_bytes = buffer_bytes
        self._buffer: memoryview | None = None
        self._hash_buffer: memoryview | None = None
        self._write_behind = write_behind  # hashed copies: pwrite in a thread of their own (WriteBehind)
        self._writer: WriteBehind | None = None
        self._pipe: tuple[int, int] | None = None
        self._pipe_bytes = 0
        self.splice = splice and hasattr(os, "splice")

    @property
    def buffer(self) -> memoryview:
        if self._buffer is None:
            self._buffer = memoryview(bytearray(self._buffer_bytes))
        return self._buffer

    @property
    def hash_buffer(self) -> memoryview:
        if self._hash_buffer is None:
            self._hash_buffer = memoryview(bytearray(min(self._buffer_bytes, HASHED_COPY_BYTES)))
        return self._hash_buffer

    def _open_pipe(self) -> tuple[int, int]:
        if self._pipe is None:
            r, w = os.pipe()
            self._pipe, self._pipe_bytes = (r, w), 65536
            try:
                import fcntl

                self._pipe_bytes = fcntl.fcntl(w, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
            except OSError:  # over /proc/sys/fs/pipe-max-size: the default 64 KiB pipe
                pass
        return self._pipe

    def copy(self, src_fd: int, src_offset: int, size: int, dest_fd: int, dest_offset: int,
             hashed: Hasher | None = None) -> None:
        """``size`` bytes of ``src_fd`` at ``src_offset`` into ``dest_fd`` at ``dest_offset``,
        each byte passed to ``hashed`` on its way, in order.

        Raised when the source ends first (truncated while it is read), or cannot be read or
        written: OSError.
        """
        if hashed is not None and self._write_behind:
            if self._writer is None:
                self._writer = WriteBehind(min(self._buffer_bytes, HASHED_COPY_BYTES))
            self._writer.copy(src_fd, src_offset, size, dest_fd, dest_offset, hashed)
            return
        if hashed is not None:
            _copy_buffered(src_fd, src_offset, size, dest_fd, dest_offset, self.hash_buffer, hashed)
            return
        done = 0
        while done < size and self.splice:
            r, w = self._open_pipe()
            try:
                n = os.splice(src_fd, w, min(size - done, self._pipe_bytes), offset_src=src_offset + done)
            except OSError as exc:
                if exc.errno not in _NO_SPLICE:
                    raise
                self.splice = False  # the pipe is empty: carry on through the buffer
                break
            if n <= 0:
                raise OSError(f"the file ends at byte {src_offset + done}, inside the rows' data (truncated?)")
            moved = 0
            while moved < n:
                try:
                    moved += os.splice(r, dest_fd, n - moved, offset_dst=dest_offset + done + moved)
                except OSError as exc:
                    if exc.errno not in _NO_SPLICE:
                        raise
                    self.splice = False  # write what the pipe holds, then carry on through the buffer
                    while moved < n:
                        piece = os.read(r, n - moved)
                        write_all(dest_fd, memoryview(piece), dest_offset + done + moved)
                        moved += len(piece)
            done += n
        if done < size:
            _copy_buffered(src_fd, src_offset + done, size - done, dest_fd, dest_offset + done, self.buffer)

    def finish(self) -> None:
        """Return once every byte copied is written.

        Raised when a write behind failed: OSError.
        """
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Release the pipe, the buffers and the writer thread (after waiting for its writes);
        never raises: ``finish`` reports a failed write."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._pipe is not None:
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None
        self._buffer = self._hash_buffer = None

    def __enter__(self) -> FileCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WriteBehind:
    """A hashed copy on two cores: this thread reads and hashes the next buffer while a thread
    of its own ``pwrite``s the last one (every call releases the GIL). One process alone hashed
    and wrote a 307 MB load's rows in 125-155 ms on the bench's VM against 80-95 ms for the
    bare copy; reading and writing side by side takes the hash off the copy's path. Buffers
    are reused only once written; ``flush`` waits for every write."""

    _BUFFERS = 3
    # the buffers of the last writer closed in this process, for the next: a loader kept for
    # stream blocks (daemon/loading/streamloader.py) copies one small block after another, and fresh
    # buffers cost each load their page faults (about a sixth of a 1.5 MiB block's loader time)
    _spare: list[memoryview] = []
    _spare_lock = threading.Lock()

    def __init__(self, buffer_bytes: int) -> None:
        self._free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        with WriteBehind._spare_lock:
            reused = [b for b in WriteBehind._spare if len(b) == buffer_bytes][: self._BUFFERS]
            WriteBehind._spare = []
        for buffer in reused + [memoryview(bytearray(buffer_bytes)) for _ in range(self._BUFFERS - len(reused))]:
            self._free.put(buffer)
        self._todo: queue.SimpleQueue[tuple[memoryview, int, int, int] | None] = queue.SimpleQueue()
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._write, name="h5serve-write", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        while (item := self._todo.get()) is not None:
            buffer, size, fd, offset = item
            if self._error is None:
                try:
                    write_all(fd, buffer[:size], offset)
                except Exception as exc:  # noqa: BLE001 - raised by the copying thread; the buffer still goes back,
                    self._error = exc  # or flush() would wait for it forever
            self._free.put(buffer)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def copy(self, src_fd: int, src_offset: int, size: int, dest_fd: int, dest_offset: int, hashed: Hasher) -> None:
        """As ``_copy_buffered`` with ``hashed``, the writes done behind.

        Raised when the source ends first, or a read or an earlier write failed: OSError.
        """
        done = 0
        while done < size:
            buffer = self._free.get()
            self._check()
            piece = buffer[: min(len(buffer), size - done)]
            _read_exactly(src_fd, piece, src_offset + done)
            hashed(piece)
            self._todo.put((buffer, len(piece), dest_fd, dest_offset + done))
            done += len(piece)

    def flush(self) -> None:
        """Wait until every buffer handed over is written (every buffer is free again).

        Raised when a write failed: OSError.
        """
        buffers = [self._free.get() for _ in range(self._BUFFERS)]
        for buffer in buffers:
            self._free.put(buffer)
        self._check()

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join()
        buffers = []  # every buffer is back once the thread has ended
        while not self._free.empty():
            buffers.append(self._free.get())
        with WriteBehind._spare_lock:
            WriteBehind._spare = buffers


def _copy_buffered(src_fd: int, src_offset: int, size: int, dest_fd: int, dest_offset: int, buffer: memoryview,
                   hashed: Hasher | None = None) -> None:
    for done in range(0, size, len(buffer)):
        piece = buffer[: min(len(buffer), size - done)]
        _read_exactly(src_fd, piece, src_offset + done)
        if hashed is not None:
            hashed(piece)
        write_all(dest_fd, piece, dest_offset + done)


def copy_rows(stored: StoredRows, lo: int, hi: int, dest_fd: int, dest_offset: int,
              copier: FileCopier | memoryview, hashed: Hasher | None = None) -> bool:
    """Copy rows ``[lo, hi)`` as stored into ``dest_fd`` at ``dest_offset``, with ``copier``
    (a memoryview: through that buffer, with pread/pwrite), passing the bytes to ``hashed``
    in row order. Returns False, having copied nothing, when some of those rows are in an
    unallocated chunk.

    Raised when the file cannot be read or ends early (a truncated file): OSError.
    """
    c0, c1 = lo // stored.chunk_rows, -(-hi // stored.chunk_rows)
    if (stored.chunk_offsets[c0:c1] < 0).any():
        return False
    extents: list[tuple[int, int]] = []  # (file offset, bytes), merged where chunks follow each other in the file
    for c in range(c0, c1):
        a, b = max(lo, c * stored.chunk_rows), min(hi, (c + 1) * stored.chunk_rows)
        start = int(stored.chunk_offsets[c]) + (a - c * stored.chunk_rows) * stored.row_bytes
        size = (b - a) * stored.row_bytes
        if extents and extents[-1][0] + extents[-1][1] == start:
            extents[-1] = (extents[-1][0], extents[-1][1] + size)
        else:
            extents.append((start, size))
    for start, size in extents:
        if isinstance(copier, FileCopier):
            copier.copy(stored.fd, start, size, dest_fd, dest_offset, hashed)
        else:
            _copy_buffered(stored.fd, start, size, dest_fd, dest_offset, copier, hashed)
        dest_offset += size
    return True


def data_extents(dset: h5py.Dataset, first: int, last: int) -> list[tuple[int, int]] | None:
    """The byte ranges ``(offset, length)`` of ``dset``'s file that reading rows
    ``[first, last)`` reads, sorted and merged where they touch: for a filtered chunk, the
    whole stored chunk (HDF5 reads it whole); for an unfiltered chunk (or a contiguous
    dataset) of whole rows, exactly those rows' bytes; for an unfiltered chunk of parts of
    rows, the chunk when all its rows are among them. None when this is not known: other
    drivers, compact, virtual or external storage, HDF5 without chunk queries, too many chunks.
    """
    if dset.file.driver != "sec2" or last <= first or not dset.shape:
        return [] if last <= first else None
    dcpl = dset.id.get_create_plist()
    if dcpl.get_external_count():
        return None
    layout = dcpl.get_layout()
    rows = int(dset.shape[0])
    last = min(last, rows)
    if layout == h5py.h5d.CONTIGUOUS:
        offset = dset.id.get_offset()
        if offset is None or rows == 0:
            return []  # never written: nothing was read
        per_row = dset.id.get_storage_size() // rows
        return [(offset + first * per_row, (last - first) * per_row)] if per_row else []
    if layout != h5py.h5d.CHUNKED or not hasattr(dset.id, "chunk_iter"):
        return None
    chunk_rows = int(dset.chunks[0])
    chunks = 1
    for n, c in zip(dset.shape, dset.chunks):
        chunks *= -(-int(n) // int(c))
    if chunks > MAX_MAPPED_CHUNKS:  # listing them would cost more than the pages are worth
        return None
    filtered = dcpl.get_nfilters() > 0
    whole_rows = tuple(dset.chunks[1:]) == tuple(dset.shape[1:])
    found: list[tuple[int, int]] = []

    def visit(chunk: h5py.h5d.StoreInfo) -> None:
        c0 = int(chunk.chunk_offset[0])
        a, b = max(first, c0), min(last, c0 + chunk_rows)
        if a >= b or chunk.byte_offset is None or chunk.size == 0:
            return
        if filtered:
            found.append((chunk.byte_offset, chunk.size))
        elif whole_rows:
            per_row = chunk.size // chunk_rows
            found.append((chunk.byte_offset + (a - c0) * per_row, (b - a) * per_row))
        elif (a, b) == (c0, min(c0 + chunk_rows, rows)):
            found.append((chunk.byte_offset, chunk.size))

    dset.id.chunk_iter(visit)
    merged: list[tuple[int, int]] = []
    for start, size in sorted(found):
        if merged and merged[-1][0] + merged[-1][1] >= start:
            end = max(merged[-1][0] + merged[-1][1], start + size)
            merged[-1] = (merged[-1][0], end - merged[-1][0])
        else:
            merged.append((start, size))
    return merged


def drop_cached(fd: int, extents: list[tuple[int, int]]) -> int:
    """Ask the kernel to drop ``fd``'s cached pages over ``extents`` (``POSIX_FADV_DONTNEED``:
    only pages wholly inside a range, only clean ones; other processes' mappings keep theirs).
    Returns the bytes advised (0 where posix_fadvise is missing). Never raises."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    advised = 0
    for start, size in extents:
        try:
            os.posix_fadvise(fd, start, size, os.POSIX_FADV_DONTNEED)
        except OSError:
            return advised
        advised += size
    return advised


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
    flat = out.reshape(-1).view(np.uint8).data
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
