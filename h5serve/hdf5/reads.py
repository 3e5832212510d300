"""Reading a row selection (a shard, or the whole file: sharding.RowRange) out of HDF5: chunk-aligned
blocks, straight into their destination.

Shared by the daemon's loaders, the lazy client backend and the in-memory compat backend, so
all of them read the same rows the same way and cast with the same numpy rule (never HDF5's
own conversion, which can differ from numpy's for out-of-range values).

Why blocks and not fancy indexing: every h5py call costs tens of microseconds, and a
selection of scattered rows (``d[[3, 900, 17000]]``) costs far more than reading the whole
chunks that hold them. Interleaved shards read contiguous blocks and stride them in memory
(h5py is slow at ``d[r::W]``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import h5py
import numpy as np

from ..errors import DataError
from ..order.sharding import RowRange, Selection, as_rows
from ..util.units import row_nbytes
from .rawcopy import FileCopier, Hasher, StoredRows, copy_rows, read_stored_rows, stored_rows, write_all
from .source import DatasetInfo

__all__ = ["BLOCK_BYTES", "ShardWrite", "local_range", "shard_span", "split_span", "read_block_into", "read_shard_into",
           "read_rows"]

BLOCK_BYTES = 32 * 1024 * 1024  # rows per read are chunk-aligned and about this large
# ... or this large when rows are pwritten through a staging buffer: small enough to stay in the
# CPU's cache (measured on the bench: 1.2x the load speed of 32 MiB blocks, as good as 1 MiB)
STAGED_BLOCK_BYTES = 4 * 1024 * 1024


def shard_span(info: DatasetInfo, selection: Selection | RowRange) -> tuple[int, int]:
    """The global rows ``[first, last)`` that hold the selection (``(0, 0)`` when it is empty)."""
    return as_rows(selection, info.rows).span


def _aligned_rows(info: DatasetInfo) -> int:
    """Reads start at multiples of this many rows: whole chunks, or any row when not chunked."""
    return info.chunk_rows if info.chunked else 1


def split_span(first: int, last: int, info: DatasetInfo, parts: int) -> list[tuple[int, int]]:
    """``[first, last)`` cut at chunk boundaries into at most ``parts`` ranges of about equal
    size, so each range can be read by its own process without two decompressing one chunk."""
    if last <= first:
        return []
    unit = _aligned_rows(info)
    c0, c1 = first // unit, -(-last // unit)
    cuts = np.linspace(c0, c1, min(max(parts, 1), c1 - c0) + 1).round().astype(np.int64) * unit
    edges = [first, *(int(c) for c in cuts[1:-1]), last]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def _blocks(start: int, end: int, info: DatasetInfo, block_bytes: int) -> Iterator[tuple[int, int]]:
    unit = _aligned_rows(info)
    step = max(block_bytes // max(row_nbytes(info.row_shape, info.dtype), 1) // unit, 1) * unit
    a = start
    while a < end:
        b = min((a // unit + 1) * unit + step - unit, end)
        yield a, b
        a = b


def read_error(exc: OSError, dset: h5py.Dataset, info: DatasetInfo, lo: int, hi: int) -> DataError:
    """The error for rows ``lo..hi-1`` that HDF5 failed to read (``exc`` says why)."""
    return DataError(
        f"cannot read rows {lo}..{hi - 1} of dataset {info.key!r} in {dset.file.filename}: {exc}; the file "
        "may be damaged or truncated (check it with `h5dump -H` / `h5ls -rv`, or rewrite it)"
    )


def _as_source_dtype(array: np.ndarray, info: DatasetInfo) -> np.ndarray:
    """``array`` (of the source dtype) viewed with h5py's string metadata, for byte strings:
    HDF5 converts UTF-8 strings only into a UTF-8 memory type (equal numpy dtypes can differ there)."""
    return array.view(info.dtype) if info.is_bytes else array


def local_range(a: int, b: int, first: int, step: int, count: int) -> tuple[int, int]:
    """Local positions ``[k0, k1)`` of the shard rows ``first + k*step`` that lie in ``[a, b)``."""
    k0 = max(-(-(a - first) // step), 0)
    k1 = min(max(-(-(b - first) // step), 0), count)
    return k0, max(k1, k0)


def _read_positions(dset: h5py.Dataset, info: DatasetInfo, first: int, step: int, k0: int, k1: int,
                    target: np.ndarray, buffer: np.ndarray | None) -> np.ndarray | None:
    """Read the shard rows at local positions ``[k0, k1)`` (global rows ``first + k*step``) into
    ``target`` (``k1 - k0`` rows, C-contiguous). Returns the scratch buffer for next time.

    Rows go straight into ``target`` when they are consecutive and no cast is needed; otherwise
    the block is read once into ``buffer`` and strided or cast from there.
    """
    lo, hi = first + k0 * step, first + (k1 - 1) * step + 1  # the rows actually needed
    try:
        if step == 1 and target.dtype == info.dtype:
            dset.read_direct(_as_source_dtype(target, info), np.s_[lo:hi])
        else:
            if buffer is None or buffer.shape[0] < hi - lo:
                buffer = np.empty((hi - lo, *info.row_shape), dtype=info.dtype)
            block = buffer[: hi - lo]
            dset.read_direct(block, np.s_[lo:hi])
            np.copyto(target, block[::step], casting="unsafe")
    except OSError as exc:
        raise read_error(exc, dset, info, lo, hi) from exc
    return buffer


def read_block_into(
    dset: h5py.Dataset,
    info: DatasetInfo,
    selection: Selection | RowRange,
    out: np.ndarray,
    a: int,
    b: int,
    buffer: np.ndarray | None = None,
) -> tuple[int, int, np.ndarray | None]:
    """Read the shard's rows among global rows ``[a, b)`` into their local positions in ``out``
    (the whole shard, in ``out.dtype``). Returns ``(k0, k1, buffer)``: the local positions
    written, and a scratch buffer to pass back in next time.

    Raised when HDF5 cannot read the rows (a damaged chunk, a failing filter): DataError.
    """
    rows = as_rows(selection, info.rows)
    first, step = rows.start, rows.step
    k0, k1 = local_range(a, b, first, step, len(out))
    if k1 > k0:
        buffer = _read_positions(dset, info, first, step, k0, k1, out[k0:k1], buffer)
    return k0, k1, buffer


@dataclass(frozen=True)
class ShardWrite:
    """How ``read_shard_into`` writes the rows, for a load into a segment (the defaults: a plain
    read into ``out``).

    ``dest``: ``(fd, offset)``, a file that ``out`` maps and the byte offset of ``out[0]`` in
    it. Then nothing is written through ``out``: rows the file stores exactly as ``out`` holds
    them are copied file to file (rawcopy), and the others are read into a reused staging
    buffer and ``pwrite``n, because filling a fresh tmpfs mapping page fault by page fault is
    slower than either.

    ``hashed``: called with every byte of ``out[k0:k1]`` as it is written, in ascending
    order (a load's checksum, computed while the bytes are in the CPU's cache). ``ready``:
    called once the rows' places in the file are known, before the first write (a load
    waits there for its segment's reservation: daemon/loading/reserve.py). ``write_behind``: hashed
    copies are written by a thread of their own (rawcopy.WriteBehind), for a load that has a
    core to spare. ``places``: where the rows of each dataset (by name and dtype) are stored in
    the file ``dset`` is in, memoised there for the next call on that same open file (a loader
    kept for stream blocks: listing a dataset's chunks is per file, not per block).
    """

    dest: tuple[int, int] | None = None
    hashed: Hasher | None = None
    ready: Callable[[], None] | None = None
    write_behind: bool = False
    places: dict[tuple[str, ...], StoredRows | None] | None = None


def read_shard_into(
    dset: h5py.Dataset,
    info: DatasetInfo,
    selection: Selection | RowRange,
    out: np.ndarray,
    progress: Callable[[int], None] | None = None,
    span: tuple[int, int] | None = None,
    how: ShardWrite = ShardWrite(),
) -> int:
    """Fill ``out`` (the whole shard) with the shard's rows, cast to ``out.dtype``, in
    chunk-aligned blocks of about BLOCK_BYTES (STAGED_BLOCK_BYTES with ``how.dest``), written as
    ``how`` says. ``span``: only the global rows ``[a, b)`` (one part of a parallel load, from
    split_span); ``progress(n)``: ``n`` rows of this call done. Returns the bytes copied file to
    file (with ``how.dest``).

    Raised when HDF5 cannot read the rows (a damaged chunk, a failing filter) or the file
    ends early: DataError.
    """
    dest, hashed, ready = how.dest, how.hashed, how.ready
    rows = as_rows(selection, info.rows)
    first, last = span if span is not None else rows.span
    start, step = rows.start, rows.step
    done = copied = 0
    out_row = row_nbytes(info.row_shape, out.dtype)
    buffer: np.ndarray | None = None
    stage: np.ndarray | None = None
    copier = FileCopier(write_behind=how.write_behind) if dest is not None else None
    try:
        copy = None
        if dest is not None and copier is not None:
            copy = _row_copier(dset, info, rows, out.dtype, dest, copier, hashed, how.places)
        if ready is not None:
            ready()
        for a, b in _blocks(first, last, info, STAGED_BLOCK_BYTES if dest is not None else BLOCK_BYTES):
            k0, k1 = local_range(a, b, start, step, len(out))
            if k1 <= k0:
                continue
            if copy is not None and copy(k0, k1):
                copied += (k1 - k0) * out_row
            elif dest is not None:
                if stage is None or len(stage) < k1 - k0:
                    stage = np.empty((k1 - k0, *out.shape[1:]), dtype=out.dtype)
                buffer = _read_positions(dset, info, start, step, k0, k1, stage[: k1 - k0], buffer)
                staged = stage[: k1 - k0].reshape(-1).view(np.uint8).data
                if hashed is not None:
                    hashed(staged)
                write_all(dest[0], staged, dest[1] + k0 * out_row)
            else:
                buffer = _read_positions(dset, info, start, step, k0, k1, out[k0:k1], buffer)
                if hashed is not None:
                    hashed(out[k0:k1].reshape(-1).view(np.uint8).data)
            done += k1 - k0
            if progress is not None:
                progress(done)
        if copier is not None:
            copier.finish()  # every row is written before the caller publishes
    finally:
        if copier is not None:
            copier.close()
    return copied


def _row_copier(dset: h5py.Dataset, info: DatasetInfo, rows: RowRange, out_dtype: np.dtype,
                dest: tuple[int, int], copier: FileCopier, hashed: Hasher | None = None,
                places: dict[tuple[str, ...], StoredRows | None] | None = None) -> Callable[[int, int], bool] | None:
    """``copy(k0, k1)``: copy the selection's rows at local positions ``[k0, k1)`` file to file
    into ``dest`` with ``copier``, False when they must go through h5py; None when no row can be copied."""
    if rows.step != 1:
        return None
    memo = (str(dset.name), str(getattr(dset, "field", "")), np.dtype(out_dtype).str)  # a compound's field too
    if places is not None and memo in places:
        stored = places[memo]
    else:
        stored = stored_rows(dset, info, out_dtype)
        if places is not None:
            places[memo] = stored
    if stored is None:
        return None
    first = rows.start
    fd, offset = dest

    def copy(k0: int, k1: int) -> bool:
        try:
            return copy_rows(stored, first + k0, first + k1, fd, offset + k0 * stored.row_bytes, copier, hashed)
        except OSError as exc:
            raise read_error(exc, dset, info, first + k0, first + k1) from exc

    return copy


def read_rows(dset: h5py.Dataset, info: DatasetInfo, rows: np.ndarray, dtype: np.dtype,
              stored: StoredRows | None = None) -> np.ndarray:
    """Rows ``rows`` (any order, repeats allowed) as a fresh array of ``dtype``, uncached.

    Each distinct row is read once, in increasing order. With ``stored`` (rawcopy.stored_rows
    of ``dset`` in its source dtype) rows are read from the file directly, one ``preadv`` per
    run; otherwise (or for rows in unallocated chunks) through h5py: one read per run of rows
    in the same chunk when they are dense, else one read per row (h5py's scattered-row
    selections are far slower than either).

    Raised when HDF5 cannot read the rows (a damaged chunk, a failing filter) or the file
    ends early: DataError.
    """
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        return np.empty((0, *info.row_shape), dtype=dtype)
    unique, inverse = np.unique(rows, return_inverse=True)
    data = np.empty((len(unique), *info.row_shape), dtype=info.dtype)
    try:
        direct = stored is not None and read_stored_rows(stored, unique, data)
    except OSError as exc:
        raise read_error(exc, dset, info, int(unique[0]), int(unique[-1]) + 1) from exc
    if not direct:
        _read_sorted_rows(dset, info, unique, data)
    out = data[inverse.reshape(-1)]
    return out if out.dtype == dtype else out.astype(dtype)


def _read_sorted_rows(dset: h5py.Dataset, info: DatasetInfo, unique: np.ndarray, data: np.ndarray) -> None:
    """Sorted distinct rows ``unique`` into ``data`` through h5py, a chunk's run at a time."""
    chunk_of = unique // info.chunk_rows
    edges = [0, *(np.flatnonzero(np.diff(chunk_of)) + 1).tolist(), len(unique)]
    for s, e in zip(edges, edges[1:]):
        lo, hi = int(unique[s]), int(unique[e - 1]) + 1
        try:
            if e - s == hi - lo:
                dset.read_direct(data, np.s_[lo:hi], np.s_[s:e])
            elif hi - lo <= 4 * (e - s):
                block = np.empty((hi - lo, *info.row_shape), dtype=info.dtype)
                dset.read_direct(block, np.s_[lo:hi], np.s_[0 : hi - lo])
                data[s:e] = block[unique[s:e] - lo]
            else:
                for i in range(s, e):
                    r = int(unique[i])
                    dset.read_direct(data, np.s_[r : r + 1], np.s_[i : i + 1])
        except OSError as exc:
            raise read_error(exc, dset, info, lo, hi) from exc
