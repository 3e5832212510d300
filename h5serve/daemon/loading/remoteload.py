"""A load of an ``s3://`` object (docs/architecture.md, *Remote files*): the daemon fetches it
once per node, with its own user's credentials (the standard chain: environment, ``~/.aws``,
the instance role), never the client's.

The loader opens the object pinned to the identity the daemon resolved (``SegmentMeta.remote``:
its ETag and version id; a different object is SourceChanged before a byte is read), reads
HDF5's metadata once through a small block cache (``METADATA_BLOCK_BYTES``), asks HDF5 where the
shard's rows are stored (``hdf5/fetch.py`` ``fetch_rows``: chunk-aligned ranges, each requested
as soon as HDF5's chunk index names it) with ``FETCH_CONCURRENCY`` ranged GETs in flight, each pinned by ``If-Match``,
``pwrite``-ing each range into the segment at its rows' offset as it arrives (no temporary
file, no second copy of the shard). Rows HDF5 must decode (filters, conversions, strides of
interleaved shards, unwritten chunks) are read through h5py over the same pinned file object
instead, opened again with 2 MiB blocks (``BLOCK_BYTES``: each request pinned by s3fs's If-Match too).

A failure of any request, or an object changed meanwhile (412), aborts the load: the
temporary is removed and nothing is published. External links, external storage and virtual
datasets are refused: HDF5 would open the files they name on this node's file system, as the
daemon's user.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import h5py
import numpy as np

from ...errors import AccessDenied, SourceChanged, UnsupportedDataset
from ...hdf5.compound import FieldRows, rows_dataset
from ...hdf5.fetch import Extent, fetch_rows
from ...hdf5.files import pieces
from ...hdf5.reads import ShardWrite, read_shard_into
from ...hdf5.remote import RemoteIdentity, open_remote, shown_url
from ...hdf5.source import DatasetInfo, inspect_dataset
from ...order.sharding import RowRange
from ...segments import SegmentMeta, SegmentWriter, create_segment
from ...util.crc import LOAD_CRC
from ...util.units import row_nbytes
from .._process import LOADER_NAME, set_process_name
from .loadcrc import RunningCrc
from .loadresult import LoadOk, LoadStats
from .openfile import OpenFile
from .parts import DaemonGone, report_failure

__all__ = ["run_remote_load", "remote_pin"]


def remote_pin(meta: SegmentMeta) -> RemoteIdentity:
    """The object identity a remote segment's load must read (what the daemon resolved)."""
    etag, version = meta.remote if meta.remote else ("", "")
    return RemoteIdentity(meta.source_path, meta.source_size, str(etag), str(version))


def _rows(f: h5py.File, url: str, key: str) -> h5py.Dataset | FieldRows:
    """The dataset holding the rows, in the object itself: never through an external link, never
    virtual, never external storage (each would have HDF5 open a local file by name)."""
    where = f"{shown_url(url)}[{key}]"
    try:
        dset = rows_dataset(f, key)
    except (KeyError, ValueError) as exc:
        raise SourceChanged(f"{where} is no longer there; request it again") from exc
    base = dset.dset if isinstance(dset, FieldRows) else dset
    if base.file.id.fileno != f.id.fileno or base.is_virtual or base.id.get_create_plist().get_external_count():
        raise AccessDenied(f"{where} is an external link, a virtual dataset or external storage: the daemon reads "
                           "only rows stored in the object itself (HDF5 would open local files it names); read it "
                           "lazily (fallback='lazy')")
    return dset


class _Sink:
    """Each fetched range pwritten at its rows' offset in the segment, its crc kept for the join
    in row order, the header's progress moved (rows whose bytes are all in)."""

    def __init__(self, writer: SegmentWriter, row_bytes: int, daemon_gone: Callable[[], bool]) -> None:
        self.fd, self.base = writer.data_target()
        self.writer, self.row_bytes, self.daemon_gone = writer, row_bytes, daemon_gone
        self.crcs: dict[int, tuple[int, int]] = {}  # dest -> (crc, size)
        self._lock = threading.Lock()
        self._done = 0

    def __call__(self, extent: Extent, data: bytes) -> None:
        if self.daemon_gone():
            raise DaemonGone()
        view = memoryview(data)
        at = self.base + extent.dest
        while view:
            view = view[os.pwrite(self.fd, view, at):]
            at = self.base + extent.dest + (len(data) - len(view))
        crc = LOAD_CRC.update(memoryview(data), 0)
        with self._lock:
            self.crcs[extent.dest] = (crc, extent.size)
            self._done += extent.size
            self.writer.set_progress(self._done // self.row_bytes)

    def joined_crc(self) -> int:
        total = 0
        for dest in sorted(self.crcs):
            crc, size = self.crcs[dest]
            total = LOAD_CRC.combine(total, crc, size)
        return total


def _check_ends(dset: h5py.Dataset, where: str, start: int, data: np.ndarray) -> None:
    """The first and last rows fetched (``data``: rows ``start ..`` of ``dset``) equal h5py's
    reads of them (any library that reports offsets otherwise, or a layout misread, fails the
    load instead of serving wrong bytes)."""
    for k in {0, len(data) - 1}:
        row = start + k
        want = np.empty((1, *data.shape[1:]), dtype=data.dtype)
        dset.read_direct(want, np.s_[row:row + 1])
        if want[0].tobytes() != data[k].tobytes():
            raise SourceChanged(f"{where} row {row} as fetched differs from HDF5's read of it; request it again "
                                "(reported as a bug if it persists)")


def _read_through_h5py(pin: RemoteIdentity, key: str, rows: RowRange, out: np.ndarray, target: tuple[int, int],
                       crc: RunningCrc | None, progress: Callable[[int], None]) -> tuple[int, float]:
    """``rows`` of ``key`` HDF5 must decode, read by h5py into ``out`` (``target``: its
    descriptor and offset) over the object opened again with the lazy reader's 2 MiB blocks
    (the metadata blocks would make a request per 16 KiB of rows): ``(bytes its block cache
    fetched, seconds)``."""
    t0 = time.monotonic()
    bulk = open_remote(pin.url, pin)
    try:
        with h5py.File(bulk, "r") as f:
            read_shard_into(_rows(f, pin.url, key), inspect_dataset(f, key), rows, out, progress,
                            how=ShardWrite(target, None if crc is None else crc.update))
        return bulk.fetched_bytes, time.monotonic() - t0
    finally:
        bulk.close()


def _watched(writer: SegmentWriter, daemon_gone: Callable[[], bool], before: int = 0) -> Callable[[int], None]:
    """A read's progress (its rows done) on the segment's header, from ``before``; DaemonGone once the daemon is."""

    def progress(done: int) -> None:
        if daemon_gone():
            raise DaemonGone()
        writer.set_progress(before + done)

    return progress


def _load_files(meta: SegmentMeta, writer: SegmentWriter, checksum: bool,
                daemon_gone: Callable[[], bool]) -> tuple[int, int, float]:
    """Many s3:// objects' rows (``meta.files``, their ETags in ``meta.remote``) into ``writer``,
    object by object, each opened pinned over the metadata block cache, its piece of the rows
    fetched by ranged GETs at its place in the segment (or read through h5py when HDF5 must
    decode it): ``(crc or -1, bytes fetched, seconds fetching)``. The crc is of the segment's
    rows once all are in."""
    row_bytes = row_nbytes(meta.row_shape, meta.np_dtype)
    sink = _Sink(writer, row_bytes, daemon_gone)
    fetched, seconds = 0, 0.0
    fd, base = writer.data_target()
    for piece in pieces(meta.row_range, meta.file_rows):
        entry = meta.files[piece.index]
        pin = RemoteIdentity(entry[0], entry[3], str(meta.remote[2 * piece.index]),
                             str(meta.remote[2 * piece.index + 1]))
        where = f"{shown_url(pin.url)}[{meta.key}]"
        files = OpenFile()
        try:
            fileobj, f = files.remote_object(pin)
            dset = _rows(f, pin.url, meta.key)
            info = inspect_dataset(f, meta.key)
            if info.rows != entry[5] or info.row_shape != meta.row_shape or info.vlen:
                raise SourceChanged(f"{where} is not the dataset resolved (now {info.rows} rows of shape "
                                    f"{info.row_shape}); request it again")
            out = writer.data[piece.k0:piece.k1]
            dest = piece.k0 * row_bytes

            def placed(extent: Extent, data: bytes, dest: int = dest) -> None:
                sink(Extent(extent.start, extent.size, extent.dest + dest), data)

            stats = None
            if isinstance(dset, h5py.Dataset):
                stats = fetch_rows(dset, info, meta.np_dtype, piece.local, pin, placed)
            if stats is not None:
                _check_ends(dset, where, piece.local.start, out)
                fetched, seconds = fetched + stats.bytes, seconds + stats.seconds
            else:
                got, took = _read_through_h5py(pin, meta.key, piece.local, out, (fd, base + dest), None,
                                               _watched(writer, daemon_gone, piece.k0))
                fetched, seconds = fetched + got, seconds + took
            fetched += fileobj.fetched_bytes
        finally:
            files.close()
    writer.set_progress(meta.rows)
    rows = np.ascontiguousarray(writer.data).reshape(-1).view(np.uint8)
    return (LOAD_CRC.update(rows.data, 0) if checksum else -1), fetched, seconds


def _load(meta: SegmentMeta, writer: SegmentWriter, f: h5py.File, checksum: bool,
          daemon_gone: Callable[[], bool], checked: set[str]) -> tuple[int, int, float]:
    """The rows into ``writer`` (``f``: the object opened over the metadata block cache):
    ``(crc or -1, bytes fetched for the rows, seconds fetching)``. ``checked``: the datasets
    of ``f`` whose fetched rows were already compared with h5py's (a kept loader's: once each)."""
    dset = _rows(f, meta.source_path, meta.key)
    info: DatasetInfo = inspect_dataset(f, meta.key)
    if info.rows != meta.total_rows or info.row_shape != meta.row_shape or info.vlen:
        raise SourceChanged(f"{shown_url(meta.source_path)}[{meta.key}] is not the dataset resolved (now "
                            f"{info.rows} rows of shape {info.row_shape}); request it again")
    if isinstance(dset, h5py.Dataset) and meta.rows:
        sink = _Sink(writer, row_nbytes(meta.row_shape, meta.np_dtype), daemon_gone)
        stats = fetch_rows(dset, info, meta.np_dtype, meta.row_range, remote_pin(meta), sink)
        if stats is not None:
            if meta.key not in checked:
                _check_ends(dset, f"{shown_url(meta.source_path)}[{meta.key}]", meta.row_range.start, writer.data)
                checked.add(meta.key)
            writer.set_progress(meta.rows)
            return (sink.joined_crc() if checksum else -1), stats.bytes, stats.seconds
    crc = RunningCrc() if checksum else None
    got, took = _read_through_h5py(remote_pin(meta), meta.key, meta.row_range, writer.data, writer.data_target(), crc,
                                   _watched(writer, daemon_gone))
    return (-1 if crc is None else crc.value), got, took


def run_remote_load(shm_dir: Path, tmp_name: str, final_name: str, meta: SegmentMeta, checksum: bool,
                    reply: Connection, daemon_gone: Callable[[], bool], kept: OpenFile | None = None) -> bool:
    """Load ``meta`` (an s3:// object's rows) into ``tmp_name`` in ``shm_dir``, publish it
    as ``final_name`` and report on ``reply`` (LoadOk, or LoadError and nothing published).
    ``kept``: a loader kept for stream blocks (streamloader.py) reads through the object it
    keeps open (openfile.py), and keeps ``reply`` open. Returns whether it succeeded."""
    set_process_name(LOADER_NAME)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    writer: SegmentWriter | None = None
    owned: OpenFile | None = None
    try:
        if meta.vlen:
            raise UnsupportedDataset(f"{shown_url(meta.source_path)}: the daemon fetches objects of fixed-size "
                                     "rows; variable-length rows are read by each process")
        t0 = time.monotonic()
        writer = create_segment(shm_dir, tmp_name, meta)
        started = time.monotonic()
        if meta.files:  # many objects as one dataset
            crc, fetched, fetch_s = _load_files(meta, writer, checksum, daemon_gone)
        else:
            files = kept if kept is not None else (owned := OpenFile())
            fileobj, f = files.remote(meta, remote_pin(meta))
            before = fileobj.fetched_bytes
            crc, ranged, fetch_s = _load(meta, writer, f, checksum, daemon_gone, files.checked)
            fetched = ranged + fileobj.fetched_bytes - before
        read_done = time.monotonic()
        stored = writer.store_checksum(crc) if checksum else ""
        stats = LoadStats(parts=1, create_s=started - t0, copied_bytes=0, read_s=read_done - started,
                          part_s=(read_done - started,), checksum=stored, checksum_s=0.0, page_cache_drop_bytes=0,
                          values=0, fetched_bytes=fetched, fetch_s=fetch_s)
        if daemon_gone():
            raise DaemonGone()
        published = writer.publish(final_name)
        writer = None
        reply.send(LoadOk(stats, published.name))
        return True
    except BaseException as exc:  # noqa: BLE001 - reported: the daemon turns it into an error reply
        if writer is not None:
            writer.abort()
        if kept is not None:
            kept.close()  # a failed load ends a kept loader (streamloader.py): nothing of the object is kept
        report_failure(reply, exc)
        return False
    finally:
        if owned is not None:
            owned.close()
        if kept is None:
            reply.close()
