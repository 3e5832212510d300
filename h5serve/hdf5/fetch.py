"""Fetching a remote dataset's stored rows with ranged GETs, many at once, each pinned to the
object's version (docs/architecture.md, *Remote files*). The daemon's loader uses it to write a
shard of an ``s3://`` object straight into its segment, once per node.

- ``remote_extents``: where rows ``[a, b)`` of a dataset opened over a RemoteFile lie in the
  object, as byte ranges cut at chunk boundaries (neighbouring chunks merged up to
  ``RANGE_BYTES``), or None when HDF5 must decode them (filters, conversions, unwritten chunks,
  chunks that split rows): then the caller reads through h5py.
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
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from ..errors import ConfigError, ObjectStoreError
from ..order.sharding import RowRange
from ..util.units import row_nbytes
from .rawcopy import MAX_MAPPED_CHUNKS
from .remote import RemoteIdentity, filesystem_of, parse_url, remote_call, shown_url
from .source import DatasetInfo

__all__ = ["Extent", "FetchStats", "RANGE_BYTES", "FETCH_CONCURRENCY", "remote_extents", "fetch_extents"]

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


def _same_bytes_as_numpy(dset: h5py.Dataset, dtype: np.dtype) -> bool:
    if dset.dtype.kind not in "iufc" or dset.dtype.newbyteorder("=") != dtype or not dtype.isnative:
        return False
    try:
        return dset.id.get_type() == h5py.h5t.py_create(dtype)
    except (TypeError, ValueError):
        return False


def _chunk_offsets(dset: h5py.Dataset, info: DatasetInfo, row_bytes: int) -> tuple[int, np.ndarray] | None:
    """``(rows per chunk, each chunk's offset in the object)`` (-1: never written), or None when
    the layout holds no whole rows at known offsets."""
    dcpl = dset.id.get_create_plist()
    if dcpl.get_nfilters() or dcpl.get_external_count():
        return None
    layout = dcpl.get_layout()
    if layout == h5py.h5d.CONTIGUOUS:
        offset = dset.id.get_offset()
        return None if offset is None else (max(info.rows, 1), np.array([offset], dtype=np.int64))
    if layout != h5py.h5d.CHUNKED or tuple(dset.chunks[1:]) != info.row_shape or not hasattr(dset.id, "chunk_iter"):
        return None
    chunk_rows = int(dset.chunks[0])
    if -(-info.rows // chunk_rows) > MAX_MAPPED_CHUNKS:
        return None
    offsets = np.full(-(-info.rows // chunk_rows), -1, dtype=np.int64)
    chunk_bytes = chunk_rows * row_bytes

    def visit(chunk: h5py.h5d.StoreInfo) -> None:
        if chunk.size == chunk_bytes:
            offsets[chunk.chunk_offset[0] // chunk_rows] = chunk.byte_offset

    dset.id.chunk_iter(visit)
    return chunk_rows, offsets


def remote_extents(dset: h5py.Dataset, info: DatasetInfo, dtype: np.dtype, rows: RowRange) -> list[Extent] | None:
    """The byte ranges of the object holding ``rows`` (consecutive rows: step 1) of ``dset`` as
    ``dtype``, in row order, or None when they must be read through h5py (a stride, filters, a
    conversion, a chunk never written, a layout without whole rows)."""
    if rows.step != 1 or rows.stop <= rows.start or info.rows == 0 or not _same_bytes_as_numpy(dset, dtype):
        return None
    row_bytes = row_nbytes(info.row_shape, dtype)
    found = _chunk_offsets(dset, info, row_bytes)
    if found is None:
        return None
    chunk_rows, offsets = found
    c0, c1 = rows.start // chunk_rows, -(-rows.stop // chunk_rows)
    if (offsets[c0:c1] < 0).any():
        return None
    out: list[Extent] = []
    dest = 0
    for c in range(c0, c1):
        a, b = max(rows.start, c * chunk_rows), min(rows.stop, (c + 1) * chunk_rows)
        start, size = int(offsets[c]) + (a - c * chunk_rows) * row_bytes, (b - a) * row_bytes
        last = out[-1] if out else None
        if last is not None and last.start + last.size == start and last.size + size <= RANGE_BYTES:
            out[-1] = Extent(last.start, last.size + size, last.dest)
        else:
            out.append(Extent(start, size, dest))
        dest += size
    return out


async def _get(fs: Any, bucket: str, key: str, extent: Extent, pin: RemoteIdentity) -> bytes:
    """One ranged GET, pinned to ``pin``'s ETag (and version id)."""
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key,
                              "Range": f"bytes={extent.start}-{extent.start + extent.size - 1}"}
    if pin.etag:
        kwargs["IfMatch"] = pin.etag
    if pin.version_id and pin.version_id != "null":
        kwargs["VersionId"] = pin.version_id
    response = await fs._call_s3("get_object", **kwargs)
    body = response["Body"]
    try:
        return bytes(await body.read())
    finally:
        body.close()


def fetch_extents(pin: RemoteIdentity, extents: list[Extent], sink: Callable[[Extent, bytes], None],
                  concurrency: int = FETCH_CONCURRENCY) -> FetchStats:
    """Fetch every extent of the object ``pin`` names (at most ``concurrency`` at once) and hand
    each to ``sink`` as it arrives; stops at the first failure (what is in flight is abandoned).

    Raised when a range comes back short: ObjectStoreError; when the object is no longer
    ``pin``: SourceChanged; as ``remote_call`` otherwise, or as ``sink`` raises."""
    scheme, path = parse_url(pin.url)
    if scheme != "s3":
        raise ConfigError(f"the daemon fetches s3:// objects only, not {scheme}://")
    from fsspec.asyn import sync

    fs = filesystem_of(scheme)
    bucket, key = path.split("/", 1)
    lock = threading.Lock()
    tally = {"bytes": 0, "requests": 0}
    started = time.monotonic()

    def one(extent: Extent) -> None:
        def request() -> bytes:
            with lock:
                tally["requests"] += 1
            return sync(fs.loop, _get, fs, bucket, key, extent, pin)

        data = remote_call(pin.url, "fetching", request)
        with lock:
            tally["bytes"] += len(data)
        if len(data) != extent.size:
            raise ObjectStoreError(f"fetching {shown_url(pin.url)} bytes {extent.start}+{extent.size} returned "
                                   f"{len(data)} bytes: the object is shorter than described; request it again",
                                   url=shown_url(pin.url), status=None)
        sink(extent, data)

    with ThreadPoolExecutor(max(1, min(concurrency, len(extents))), thread_name_prefix="h5serve-fetch") as pool:
        futures = [pool.submit(one, e) for e in extents]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for future in pending:
            future.cancel()
        for future in futures:
            if future.done() and not future.cancelled() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
    return FetchStats(tally["bytes"], tally["requests"], time.monotonic() - started)
