"""Reading a shard's rows out of HDF5: chunk-aligned blocks, straight into their destination.

Shared by the daemon's loaders, the lazy client backend and the in-memory compat backend, so
all of them read the same rows the same way and cast with the same numpy rule (never HDF5's
own conversion, which can differ from numpy's for out-of-range values).

Why blocks and not fancy indexing: every h5py call costs tens of microseconds, and a
selection of scattered rows (``d[[3, 900, 17000]]``) costs far more than reading the whole
chunks that hold them. Interleaved shards read contiguous blocks and stride them in memory
(h5py is slow at ``d[r::W]``).
"""

from __future__ import annotations

from typing import Callable, Iterator

import h5py
import numpy as np

from .errors import DataError
from .sharding import Selection
from .source import DatasetInfo

__all__ = ["BLOCK_BYTES", "row_bytes", "shard_span", "split_span", "read_block_into", "read_shard_into", "read_rows"]

BLOCK_BYTES = 32 * 1024 * 1024  # rows per read are chunk-aligned and about this large


def row_bytes(info: DatasetInfo, dtype: np.dtype | None = None) -> int:
    """Bytes of one row in ``dtype`` (default: the source dtype)."""
    return int(np.prod(info.row_shape, dtype=np.int64)) * (dtype or info.dtype).itemsize


def shard_span(info: DatasetInfo, selection: Selection) -> tuple[int, int]:
    """The global rows ``[first, last)`` that hold the shard (``(0, 0)`` when it is empty)."""
    count = selection.count(info.rows)
    first = selection.first(info.rows)
    return (first, first + (count - 1) * selection.step + 1) if count else (0, 0)


def split_span(first: int, last: int, info: DatasetInfo, parts: int) -> list[tuple[int, int]]:
    """``[first, last)`` cut at chunk boundaries into at most ``parts`` ranges of about equal
    size, so each range can be read by its own process without two decompressing one chunk."""
    if last <= first:
        return []
    c0, c1 = first // info.chunk_rows, -(-last // info.chunk_rows)
    cuts = np.linspace(c0, c1, min(max(parts, 1), c1 - c0) + 1).round().astype(np.int64) * info.chunk_rows
    edges = [first, *(int(c) for c in cuts[1:-1]), last]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def _blocks(start: int, end: int, info: DatasetInfo) -> Iterator[tuple[int, int]]:
    step = max(BLOCK_BYTES // max(row_bytes(info), 1) // info.chunk_rows, 1) * info.chunk_rows
    a = start
    while a < end:
        b = min((a // info.chunk_rows + 1) * info.chunk_rows + step - info.chunk_rows, end)
        yield a, b
        a = b


def read_error(exc: OSError, dset: h5py.Dataset, info: DatasetInfo, lo: int, hi: int) -> DataError:
    """The error for rows ``lo..hi-1`` that HDF5 failed to read (``exc`` says why)."""
    return DataError(
        f"cannot read rows {lo}..{hi - 1} of dataset {info.key!r} in {dset.file.filename}: {exc}; the file "
        "may be damaged or truncated (check it with `h5dump -H` / `h5ls -rv`, or rewrite it)"
    )


def _local_range(a: int, b: int, first: int, step: int, count: int) -> tuple[int, int]:
    """Local positions ``[k0, k1)`` of the shard rows ``first + k*step`` that lie in ``[a, b)``."""
    k0 = max(-(-(a - first) // step), 0)
    k1 = min(max(-(-(b - first) // step), 0), count)
    return k0, max(k1, k0)


def read_block_into(
    dset: h5py.Dataset,
    info: DatasetInfo,
    selection: Selection,
    out: np.ndarray,
    a: int,
    b: int,
    buffer: np.ndarray | None = None,
) -> tuple[int, int, np.ndarray | None]:
    """Read the shard's rows among global rows ``[a, b)`` into their local positions in ``out``
    (the whole shard, in ``out.dtype``). Returns ``(k0, k1, buffer)``: the local positions
    written, and a scratch buffer to pass back in next time.

    Rows go straight into ``out`` when the shard is contiguous and no cast is needed; otherwise
    the block is read once into ``buffer`` and strided or cast from there.

    Raised when HDF5 cannot read the rows (a damaged chunk, a failing filter): DataError.
    """
    count = len(out)
    if count == 0:
        return 0, 0, buffer
    first, step = selection.first(info.rows), selection.step
    k0, k1 = _local_range(a, b, first, step, count)
    if k1 <= k0:
        return k0, k0, buffer
    lo, hi = first + k0 * step, first + (k1 - 1) * step + 1  # the rows actually needed
    try:
        if step == 1 and out.dtype == info.dtype:
            dset.read_direct(out, np.s_[lo:hi], np.s_[k0:k1])
        else:
            if buffer is None or buffer.shape[0] < hi - lo:
                buffer = np.empty((hi - lo, *info.row_shape), dtype=info.dtype)
            block = buffer[: hi - lo]
            dset.read_direct(block, np.s_[lo:hi], np.s_[0 : hi - lo])
            np.copyto(out[k0:k1], block[::step], casting="unsafe")
    except OSError as exc:
        raise read_error(exc, dset, info, lo, hi) from exc
    return k0, k1, buffer


def read_shard_into(
    dset: h5py.Dataset,
    info: DatasetInfo,
    selection: Selection,
    out: np.ndarray,
    progress: Callable[[int], None] | None = None,
    span: tuple[int, int] | None = None,
) -> None:
    """Fill ``out`` (the whole shard) with the shard's rows, cast to ``out.dtype``, in
    chunk-aligned blocks of about BLOCK_BYTES. ``span``: only the global rows ``[a, b)`` (one
    part of a parallel load, from split_span); ``progress(n)``: ``n`` rows of this call done.

    Raised when HDF5 cannot read the rows (a damaged chunk, a failing filter): DataError.
    """
    first, last = span if span is not None else shard_span(info, selection)
    done = 0
    buffer: np.ndarray | None = None
    for a, b in _blocks(first, last, info):
        k0, k1, buffer = read_block_into(dset, info, selection, out, a, b, buffer)
        done += k1 - k0
        if progress is not None and k1 > k0:
            progress(done)


def read_rows(dset: h5py.Dataset, info: DatasetInfo, rows: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Rows ``rows`` (any order, repeats allowed) as a fresh array of ``dtype``, uncached.

    Each distinct row is read once, in increasing order: one read per run of rows in the same
    chunk when they are dense, else one read per row (h5py's scattered-row selections are far
    slower than either).

    Raised when HDF5 cannot read the rows (a damaged chunk, a failing filter): DataError.
    """
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        return np.empty((0, *info.row_shape), dtype=dtype)
    unique, inverse = np.unique(rows, return_inverse=True)
    data = np.empty((len(unique), *info.row_shape), dtype=info.dtype)
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
    out = data[inverse.reshape(-1)]
    return out if out.dtype == dtype else out.astype(dtype)
