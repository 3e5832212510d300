"""Fetching a remote dataset's stored rows with ranged GETs, many at once, each pinned to the
object's version (docs/architecture.md, *Remote files*). The daemon's loader uses it to write a
shard of an ``s3://`` object straight into its segment, once per node.

- ``remote_extents``: where rows ``[a, b)`` of a dataset opened over a RemoteFile lie in the
  object, as byte ranges cut at chunk boundaries (neighbouring chunks merged up to
  ``RANGE_BYTES``), or None when HDF5 must decode them (filters, conversions, unwritten chunks,
  chunks that split rows): then the caller reads through h5py.
- ``fetch_rows``: the two at once, each range requested as soon as HDF5's chunk index names it
  (listing a large dataset's index takes a request per index node: the fetches start meanwhile).
- ``fetch_extents``: every range fetched by ``FETCH_CONCURRENCY`` requests in flight at most,
  each a ``GetObject`` with ``Range``, ``If-Match: <ETag>`` (and ``VersionId`` when the bucket
  gives one), so a rewritten object fails the request (412: SourceChanged) instead of
  mixing two versions; each retried by ``remote_call``'s one policy; each range handed to
  ``sink`` as it arrives (in no particular order), in the thread that fetched it.

Only ``s3://``: fsspec's ``cat_ranges`` sends no If-Match, so the requests are made here
through s3fs's client (``_call_s3``), on s3fs's own event loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from ..errors import ConfigError, ObjectStoreError
from ..order.sharding import RowRange
from ..util.units import row_nbytes
from .rawcopy import MAX_MAPPED_CHUNKS, raw_layout
from .remote import RemoteIdentity, filesystem_of, parse_url, remote_call, s3_get_range, shown_url
from .source import DatasetInfo

__all__ = ["Extent", "FetchStats", "RANGE_BYTES", "FETCH_CONCURRENCY", "remote_extents", "fetch_extents", "fetch_rows"]

RANGE_BYTES = 8 << 20  # neighbouring chunks merged into one request up to this (a chunk larger is one request)
FETCH_CONCURRENCY = 16  # requests in flight per load: enough to fill a 10 Gb/s link at S3's ~50 ms first byte


@dataclass(frozen=True)
class Extent:
    """``size`` bytes of the object from ``start``, which go to byte ``dest`` of the shard's rows."""

    start: int
    size: int
    dest: int


@dataclass(frozen=True)
class FetchStats:
    """What a fetch moved: bytes received, requests made (retries included), seconds."""

    bytes: int
    requests: int
    seconds: float


def _walk(dset: h5py.Dataset, info: DatasetInfo, dtype: np.dtype, rows: RowRange,
          emit: Callable[[Extent], None]) -> bool:
    """Hand ``emit`` the byte ranges of the object holding ``rows`` (step 1) of ``dset`` as
    ``dtype`` while HDF5 walks its chunk index (so fetching starts before the index is read to
    its end): chunk-aligned, neighbours in the object merged up to RANGE_BYTES; a contiguous
    dataset in RANGE_BYTES pieces. False when the rows must be read through h5py: before any
    range (a stride, filters, a conversion, chunks that split rows), or after (a chunk of them
    never written: HDF5 serves the fill value)."""
    layout = raw_layout(dset, info, dtype) if rows.step == 1 and rows.stop > rows.start else None
    if layout is None:
        return False
    row_bytes = row_nbytes(info.row_shape, dtype)
    if layout == h5py.h5d.CONTIGUOUS:
        offset = dset.id.get_offset()
        if offset is None:
            return False
        total = (rows.stop - rows.start) * row_bytes
        for k in range(0, total, RANGE_BYTES):
            emit(Extent(offset + rows.start * row_bytes + k, min(RANGE_BYTES, total - k), k))
        return True
    if layout != h5py.h5d.CHUNKED or tuple(dset.chunks[1:]) != info.row_shape or not hasattr(dset.id, "chunk_iter"):
        return False
    chunk_rows = int(dset.chunks[0])
    c0, c1 = rows.start // chunk_rows, -(-rows.stop // chunk_rows)
    if c1 - c0 > MAX_MAPPED_CHUNKS:
        return False
    chunk_bytes = chunk_rows * row_bytes
    seen = np.zeros(c1 - c0, dtype=bool)
    run: list[Extent] = []  # the range being merged, emitted once the next chunk does not follow it

    def visit(chunk: h5py.h5d.StoreInfo) -> None:
        c = chunk.chunk_offset[0] // chunk_rows
        if not c0 <= c < c1 or chunk.size != chunk_bytes or chunk.byte_offset is None:
            return
        seen[c - c0] = True
        a, b = max(rows.start, c * chunk_rows), min(rows.stop, (c + 1) * chunk_rows)
        piece = Extent(chunk.byte_offset + (a - c * chunk_rows) * row_bytes, (b - a) * row_bytes,
                       (a - rows.start) * row_bytes)
        last = run[0] if run else None
        if (last is not None and last.start + last.size == piece.start and last.dest + last.size == piece.dest
                and last.size + piece.size <= RANGE_BYTES):
            run[0] = Extent(last.start, last.size + piece.size, last.dest)
            return
        if last is not None:
            emit(last)
        run[:] = [piece]

    dset.id.chunk_iter(visit)
    if run:
        emit(run[0])
    return bool(seen.all())


def remote_extents(dset: h5py.Dataset, info: DatasetInfo, dtype: np.dtype, rows: RowRange) -> list[Extent] | None:
    """The byte ranges of the object holding ``rows`` (consecutive rows: step 1) of ``dset`` as
    ``dtype``, in row order, or None when they must be read through h5py (``_walk``)."""
    out: list[Extent] = []
    return sorted(out, key=lambda e: e.dest) if _walk(dset, info, dtype, rows, out.append) else None


async def _get(fs: Any, bucket: str, key: str, extent: Extent, pin: RemoteIdentity) -> bytes:
    """One ranged GET, pinned to ``pin``'s ETag (and version id)."""
    version = pin.version_id if pin.version_id != "null" else ""
    return await s3_get_range(fs, bucket, key, extent.start, extent.start + extent.size, pin.etag, version)


class _Fetcher:
    """Ranged GETs of one object, ``concurrency`` at a time, each handed to ``sink``; after the
    first failure the ranges not yet started are dropped."""

    def __init__(self, pin: RemoteIdentity, sink: Callable[[Extent, bytes], None], concurrency: int) -> None:
        scheme, path = parse_url(pin.url)
        if scheme != "s3":
            raise ConfigError(f"the daemon fetches s3:// objects only, not {scheme}://")
        self.pin, self.sink = pin, sink
        self.fs = filesystem_of(scheme)
        self.bucket, self.key = path.split("/", 1)
        self.pool = ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="h5serve-fetch")
        self.futures: list[Future[None]] = []
        self.failed = threading.Event()
        self.lock = threading.Lock()
        self.bytes = self.requests = 0
        self.started = time.monotonic()

    def submit(self, extent: Extent) -> None:
        if not self.failed.is_set():
            self.futures.append(self.pool.submit(self._one, extent))

    def _request(self, extent: Extent) -> bytes:
        from fsspec.asyn import sync

        with self.lock:
            self.requests += 1
        return bytes(sync(self.fs.loop, _get, self.fs, self.bucket, self.key, extent, self.pin))

    def _one(self, extent: Extent) -> None:
        if self.failed.is_set():
            return
        try:
            data = remote_call(self.pin.url, "fetching", lambda: self._request(extent))
            with self.lock:
                self.bytes += len(data)
            if len(data) != extent.size:
                raise ObjectStoreError(f"fetching {shown_url(self.pin.url)} bytes {extent.start}+{extent.size} "
                                       f"returned {len(data)} bytes: the object is shorter than described; request "
                                       "it again", url=shown_url(self.pin.url), status=None)
            self.sink(extent, data)
        except BaseException:
            self.failed.set()
            raise

    def finish(self) -> FetchStats:
        """Wait for every range. Raised as the first that failed."""
        try:
            wait(self.futures, return_when=FIRST_EXCEPTION)
            for future in self.futures:
                if future.done() and future.exception() is not None:
                    raise future.exception()  # type: ignore[misc]
            for future in self.futures:
                future.result()
        finally:
            self.failed.set()  # whatever is still queued returns at once
            self.pool.shutdown(wait=True)
        return FetchStats(self.bytes, self.requests, time.monotonic() - self.started)


def fetch_extents(pin: RemoteIdentity, extents: list[Extent], sink: Callable[[Extent, bytes], None],
                  concurrency: int = FETCH_CONCURRENCY) -> FetchStats:
    """Fetch every extent of the object ``pin`` names (at most ``concurrency`` at once) and hand
    each to ``sink`` as it arrives; stops at the first failure.

    Raised when a range comes back short: ObjectStoreError; when the object is no longer
    ``pin``: SourceChanged; as ``remote_call`` otherwise, or as ``sink`` raises."""
    fetcher = _Fetcher(pin, sink, min(concurrency, max(len(extents), 1)))
    for extent in extents:
        fetcher.submit(extent)
    return fetcher.finish()


def fetch_rows(dset: h5py.Dataset, info: DatasetInfo, dtype: np.dtype, rows: RowRange, pin: RemoteIdentity,
               sink: Callable[[Extent, bytes], None], concurrency: int = FETCH_CONCURRENCY) -> FetchStats | None:
    """``rows`` of ``dset`` (opened over the object ``pin`` names) fetched as ``remote_extents``
    would list them, each range requested as soon as HDF5's chunk index names it, and handed to
    ``sink``. None when they must be read through h5py instead (some ranges may have been
    fetched by then: the caller's h5py read writes every row again).

    Raised as ``fetch_extents``."""
    fetcher = _Fetcher(pin, sink, concurrency)
    try:
        fetched = _walk(dset, info, dtype, rows, fetcher.submit)
    except BaseException:
        fetcher.failed.set()
        fetcher.pool.shutdown(wait=True)
        raise
    stats = fetcher.finish()
    return stats if fetched else None
