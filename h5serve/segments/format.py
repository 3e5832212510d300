"""The on-disk format of a shared-memory segment: its header and metadata (``SegmentMeta``),
and reading them back (meta, progress, activity, the rows). Its name and ownership are in
naming.py, its content checksum in checksum.py, the file's lifecycle (create, publish,
attach, lease, evict) in lifecycle.py.

A segment is one file in the shm dir (``/dev/shm`` by default)::

    offset 0     magic "H5SRVSEG", format version, complete flag, rows done, rows total,
                 length of the msgpack metadata (SegmentMeta), checksum kind and value,
                 activity counter; at offset 64 the metadata itself
    offset 4096  the rows, C-contiguous, native byte order (page-aligned); variable-length
                 rows (h5serve/hdf5/vlen.py): rows + 1 int64 offsets, then the values

The header layout names (``FIXED``, the ``*_OFFSET``s) are public for lifecycle.py, which
writes the header, and checksum.py; nothing outside this package should need them.
"""

from __future__ import annotations

import errno
import functools
import mmap
import os
import struct
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from ..errors import ConfigError, SegmentError
from ..order.sharding import STREAM, RowRange, Selection
from ..util.safeio import NOFOLLOW_FLAGS, describe_file, is_own_file
from ..util.units import SEGMENT_HEADER_BYTES, allocated_bytes, row_nbytes

__all__ = [
    "MAGIC",
    "VALUES_ALIGN",
    "values_offset",
    "vlen_nbytes",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAX_HEADER_BYTES",
    "CHECKSUM_NONE",
    "SegmentMeta",
    "read_meta",
    "read_progress",
    "read_activity",
    "ACTIVITY",
    "ACTIVITY_OFFSET",
    "CHECKSUM",
    "CHECKSUM_OFFSET",
    "COMPLETE_OFFSET",
    "FIXED",
    "META_LENGTH_OFFSET",
    "META_OFFSET",
    "PROGRESS",
    "PROGRESS_OFFSET",
    "data_view",
    "meta_blob",
    "parse_header",
    "read_header",
    "values_view",
]

MAGIC = b"H5SRVSEG"
FORMAT_VERSION = 2  # 2: read-only once published, checksum and activity counter in the header
HEADER_SIZE = SEGMENT_HEADER_BYTES  # one page (util/units.py, where stream_plan.py counts it)
# magic, version, complete, rows_done, rows_total, meta_len, checksum kind, checksum, activity
FIXED = struct.Struct("<8sIIQQII16sQ")
COMPLETE_OFFSET = 12
PROGRESS = struct.Struct("<QQ")
PROGRESS_OFFSET = 16
CHECKSUM = struct.Struct("<I16s")
CHECKSUM_OFFSET = 36
ACTIVITY = struct.Struct("<Q")
ACTIVITY_OFFSET = 56
META_OFFSET = 64
CHECKSUM_NONE = 0
_STR_FIELDS = frozenset({"source_path", "key", "mode", "dtype", "source_dtype", "vlen"})
_LIST_FIELDS = frozenset({"row_shape", "linked", "files", "depends", "remote"})
MAX_HEADER_BYTES = 4 * 1024 * 1024  # a multi-file segment's header (its file list) is at most this
_VLEN_KINDS = frozenset({"", "seq", "utf-8", "ascii"})  # h5serve/hdf5/vlen.py: fixed, numeric, strings
META_LENGTH_OFFSET = 32  # the u32 metadata length in the fixed header
VALUES_ALIGN = 64  # vlen values start this aligned after the offsets (a cache line: any base dtype is aligned)


def values_offset(rows: int) -> int:
    """Bytes from the start of a segment's data area to its values: ``rows + 1`` int64
    offsets, padded to VALUES_ALIGN."""
    return -(-(rows + 1) * 8 // VALUES_ALIGN) * VALUES_ALIGN


def vlen_nbytes(rows: int, values: int, itemsize: int) -> int:
    """The data area of a vlen segment: offsets, padding, values."""
    return values_offset(rows) + values * itemsize


@dataclass(frozen=True)
class SegmentMeta:
    """What a segment holds: which rows of which file's dataset, in which dtype and shape.

    The source identity (path, dev, inode, size, mtime) is part of the segment name, so an
    edited file never maps to a segment of its old contents. ``mode``, ``world_size`` and
    ``rank`` are the selection the segment was loaded for; the name is keyed by the rows that
    selection holds (``row_range``), so every selection of the same rows (global mode, any mode
    with world size 1) maps to the same segment.
    """

    source_path: str
    source_dev: int
    source_ino: int
    source_size: int
    source_mtime_ns: int
    key: str
    mode: str
    world_size: int
    rank: int
    total_rows: int  # rows in the whole dataset, before sharding
    rows: int  # rows in this shard
    row_shape: tuple[int, ...]
    dtype: str  # stored dtype (numpy str, native byte order)
    source_dtype: str
    linked: tuple = ()  # (path, dev, ino, size, mtime_ns) of an externally linked file holding the data
    span: int = 1  # mode="node": ranks rank .. rank + span - 1 (their contiguous shards)
    # Many files as one dataset (files.py): every file, in row order, as (path, dev, ino, size,
    # mtime_ns, rows); empty for one file. The source_* fields are then the first file's.
    files: tuple = ()
    # Other files the rows come from (virtual dataset sources, multi-file external links), as
    # (path, dev, ino, size, mtime_ns): any of them changed means other rows.
    depends: tuple = ()
    # variable-length rows (h5serve/hdf5/vlen.py): "" fixed rows; else the data area is ``rows + 1``
    # int64 offsets, then ``values`` values of ``dtype`` (strings: their bytes, uint8)
    vlen: str = ""
    values: int = 0
    start: int = 0  # mode="stream": the block's first global row (it holds rows start .. start + rows - 1)
    # an object of a store (``source_path`` its s3:// URL, dev, ino and mtime 0, ``source_size`` its size):
    # (ETag, version id) as the daemon opened it, part of the name, so a rewritten object is a new segment; many
    # objects (``files``): two entries per object, in the files' order
    remote: tuple = ()

    @property
    def source(self) -> tuple[str, int, int, int, int]:
        return (self.source_path, self.source_dev, self.source_ino, self.source_size, self.source_mtime_ns)

    def identities(self) -> list[tuple]:
        """Every file whose identity the rows depend on, as (path, dev, ino, size, mtime_ns)."""
        return list(self._identities)

    @functools.cached_property
    def _identities(self) -> tuple[tuple, ...]:
        # built once per meta: the stale sweep asks every segment's every few seconds (a window of
        # 100,000s of small stream blocks is as many segments)
        out = [self.source, *((self.linked,) if self.linked else ())]
        out += [tuple(f[:5]) for f in self.files[1:]]
        return tuple(out + [tuple(d) for d in self.depends])

    def shard_label(self) -> str:
        """Which ranks' rows these are, in ``h5serve status``'s words, for log lines: ``all ranks
        (global)`` for the whole file, ``ranks 2-3/4 (node)`` for a node's block, ``rank 1/4
        (contiguous)`` for one rank's shard."""
        if self.row_range.covers(self.total_rows):
            return "all ranks (global)"
        if self.span > 1:
            return f"ranks {self.rank}-{self.rank + self.span - 1}/{self.world_size} ({self.mode})"
        return f"rank {self.rank}/{self.world_size} ({self.mode})"

    @property
    def file_rows(self) -> tuple[int, ...]:
        """Rows of each file of a multi-file dataset, in order (empty for one file)."""
        return tuple(int(f[5]) for f in self.files)

    @functools.cached_property  # a frozen dataclass: every figure below is asked per request and per loop tick
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @functools.cached_property
    def header_size(self) -> int:
        """Bytes before the rows: one page, or whole pages enough for a long file list."""
        if not self.files and not self.depends:
            return HEADER_SIZE
        need = META_OFFSET + len(msgpack.packb(self.to_wire()))
        return -(-need // HEADER_SIZE) * HEADER_SIZE

    @functools.cached_property
    def nbytes(self) -> int:
        if self.vlen:
            return vlen_nbytes(self.rows, self.values, self.np_dtype.itemsize)
        return self.rows * row_nbytes(self.row_shape, self.np_dtype)

    @functools.cached_property
    def file_size(self) -> int:
        return self.header_size + self.nbytes

    @functools.cached_property
    def allocated_size(self) -> int:
        """The memory the segment takes in tmpfs: ``file_size`` in whole pages (a one-row block
        of 4,097 bytes takes 8 KiB). What the daemon's budget counts for it, never ``file_size``."""
        return allocated_bytes(self.file_size)

    @property
    def row_range(self) -> RowRange:
        """The global rows this segment holds, in its order.

        Raised when mode, world size and rank do not describe a selection: SegmentError.
        """
        block = (self.start, self.start + self.rows) if self.mode == STREAM else None
        try:
            return Selection(self.mode, self.world_size, self.rank, self.span, block).rows(self.total_rows)
        except ConfigError as exc:
            raise SegmentError(f"segment metadata has a bad selection: {exc}") from exc

    def identity(self) -> tuple[Any, ...]:
        rows = self.row_range
        base = (*self.source, self.key, "rows", rows.start, rows.stop, rows.step, self.dtype, *self.linked)
        if self.files:
            base += ("files", *(v for f in self.files for v in f))
        if self.depends:
            base += ("depends", *(v for d in self.depends for v in d))
        if self.vlen:  # not ``values``: known only once loaded
            base += ("vlen", self.vlen)
        if self.remote:
            base += ("remote", *self.remote)
        return base

    def to_wire(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["row_shape"] = list(self.row_shape)
        out["linked"] = list(self.linked)
        for name in ("files", "depends", "remote"):  # only when used: a one-file header reads as before
            if out[name]:
                out[name] = list(out[name]) if name == "remote" else [list(entry) for entry in out[name]]
            else:
                del out[name]
        if not self.vlen:  # fixed rows: the header an h5serve without variable-length rows reads too
            del out["vlen"], out["values"]
        if self.mode != STREAM:  # the header an h5serve without stream blocks reads too
            del out["start"]
        return out

    @classmethod
    def from_wire(cls, data: object) -> SegmentMeta:
        names = {f.name for f in fields(cls)}
        if isinstance(data, dict):  # written before node mode (span 1), or without these fields
            data = {"span": 1, "files": [], "depends": [], "vlen": "", "values": 0, "start": 0, "remote": [], **data}
        if not isinstance(data, dict) or set(data) != names:
            raise SegmentError("segment metadata has missing or unknown fields")
        for name, value in data.items():
            expected = str if name in _STR_FIELDS else (list if name in _LIST_FIELDS else int)
            if type(value) is not expected or (isinstance(value, int) and value < 0):
                raise SegmentError(f"segment metadata field {name!r} has a bad value {value!r:.80}")
        if not all(type(n) is int and n >= 0 for n in data["row_shape"]):
            raise SegmentError(f"segment metadata row_shape {data['row_shape']!r:.80} is invalid")
        if data["vlen"] not in _VLEN_KINDS or (data["vlen"] and data["row_shape"]):
            raise SegmentError(f"segment metadata vlen {data['vlen']!r:.80} is invalid")
        linked = data["linked"]
        if linked and not _is_identity(linked, 5):
            raise SegmentError(f"segment metadata linked {linked!r:.80} is invalid")
        for name, size in (("files", 6), ("depends", 5)):
            if not all(_is_identity(entry, size) for entry in data[name]):
                raise SegmentError(f"segment metadata {name} {data[name]!r:.80} is invalid")
        remote = data["remote"]
        if remote and (len(remote) != 2 * max(len(data["files"]), 1)
                       or not all(isinstance(v, str) and len(v) <= 1024 for v in remote)):
            raise SegmentError(f"segment metadata remote {remote!r:.80} is invalid")
        if data["files"] and (len(data["files"]) < 2 or sum(f[5] for f in data["files"]) != data["total_rows"]
                              or tuple(data["files"][0][:5]) != (data["source_path"], data["source_dev"],
                                                                  data["source_ino"], data["source_size"],
                                                                  data["source_mtime_ns"])):
            raise SegmentError("segment metadata files do not describe the dataset's rows")
        try:
            meta = cls(**{**data, "row_shape": tuple(data["row_shape"]), "linked": tuple(linked),
                          "files": tuple(tuple(f) for f in data["files"]),
                          "depends": tuple(tuple(d) for d in data["depends"]), "remote": tuple(remote)})
            meta.np_dtype  # noqa: B018 - validates the dtype string
            meta.row_range  # noqa: B018 - validates mode, world size and rank
        except (TypeError, ValueError) as exc:
            raise SegmentError(f"segment metadata is invalid: {exc}") from exc
        return meta


def _is_identity(entry: object, size: int) -> bool:
    """Whether ``entry`` is ``[path, dev, ino, size, mtime_ns(, rows)]``: a str and ints >= 0."""
    return (isinstance(entry, (list, tuple)) and len(entry) == size and type(entry[0]) is str
            and all(type(n) is int and n >= 0 for n in entry[1:]))


def data_view(buffer: mmap.mmap, meta: SegmentMeta) -> np.ndarray:
    """The rows (fixed rows), or the ``rows + 1`` offsets (variable-length rows)."""
    if meta.vlen:
        return np.frombuffer(buffer, dtype=np.int64, count=meta.rows + 1, offset=meta.header_size)
    count = meta.rows * int(np.prod(meta.row_shape, dtype=np.int64))
    flat = np.frombuffer(buffer, dtype=meta.np_dtype, count=count, offset=meta.header_size)
    return flat.reshape((meta.rows, *meta.row_shape))


def values_view(buffer: mmap.mmap, meta: SegmentMeta) -> np.ndarray | None:
    """The values of variable-length rows (None for fixed rows)."""
    if not meta.vlen:
        return None
    return np.frombuffer(buffer, dtype=meta.np_dtype, count=meta.values,
                         offset=meta.header_size + values_offset(meta.rows))


def meta_blob(meta: SegmentMeta) -> bytes:
    """The header's msgpack metadata. Raised when it does not fit the header: SegmentError."""
    blob = msgpack.packb(meta.to_wire())
    limit = meta.header_size if meta.files or meta.depends else HEADER_SIZE
    if META_OFFSET + len(blob) > min(limit, MAX_HEADER_BYTES):
        raise SegmentError(f"segment metadata too large ({len(blob)} bytes): shorten the path or key")
    return blob


def read_header(fd: int) -> bytes:
    """The header of the segment open at ``fd``: its first page, and the pages after it when
    its metadata says they belong to it (a multi-file segment's file list)."""
    raw = os.pread(fd, HEADER_SIZE, 0)
    if len(raw) == HEADER_SIZE:
        meta_len = FIXED.unpack_from(raw, 0)[5]
        if HEADER_SIZE < META_OFFSET + meta_len <= MAX_HEADER_BYTES:
            size = -(-(META_OFFSET + meta_len) // HEADER_SIZE) * HEADER_SIZE
            raw += os.pread(fd, size - HEADER_SIZE, HEADER_SIZE)
    return raw


def parse_header(raw: bytes, where: str) -> tuple[SegmentMeta, bool]:
    if len(raw) < HEADER_SIZE:
        raise SegmentError(f"{where} is truncated ({len(raw)} bytes): not an h5serve segment")
    magic, version, complete, _done, _total, meta_len, _kind, _sum, _activity = FIXED.unpack_from(raw, 0)
    if magic != MAGIC:
        raise SegmentError(f"{where} is not an h5serve segment (bad magic)")
    if version != FORMAT_VERSION:
        raise SegmentError(
            f"{where} has segment format {version}, this h5serve reads {FORMAT_VERSION}: it was written by another "
            "h5serve version; run one version for the daemon and the jobs, and restart the daemon "
            "(h5serve stop; h5serve start) so it loads the data again"
        )
    if META_OFFSET + meta_len > min(len(raw), MAX_HEADER_BYTES):
        raise SegmentError(f"{where} has a corrupt header (metadata length {meta_len})")
    extended = META_OFFSET + meta_len > HEADER_SIZE
    try:
        data = msgpack.unpackb(raw[META_OFFSET:META_OFFSET + meta_len], raw=False, strict_map_key=True)
    except Exception as exc:
        length = f" (metadata length {meta_len})" if extended else ""
        raise SegmentError(f"{where} has a corrupt header{length}: {exc}") from exc
    meta = SegmentMeta.from_wire(data)
    if extended and meta.header_size != len(raw):  # only a file list may take more than the first page
        raise SegmentError(f"{where} has a corrupt header (metadata length {meta_len})")
    return meta, complete == 1


def _open_own(path: Path, owner: int | None = None) -> int:
    """A read-only descriptor of ``path`` if it is a regular file of ``owner`` (default: our
    euid): no symlink followed, no FIFO blocked on, the type and owner read from the file opened.

    Raised when it cannot be opened or is anything else: SegmentError.
    """
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW_FLAGS)
    except OSError as exc:
        why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise SegmentError(f"cannot read segment {path}: {why}") from exc
    try:
        st = os.fstat(fd)
        if not is_own_file(st, owner):
            raise SegmentError(f"{path} is {describe_file(st)}, not a segment of this daemon: leaving it alone")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_meta(path: Path, owner: int | None = None) -> tuple[SegmentMeta, bool]:
    """Header of a segment file on disk: (meta, complete). Only a regular file of ``owner``
    (default: our euid) is read.

    Raised when it is someone else's, not a regular file, or invalid: SegmentError.
    """
    fd = _open_own(path, owner)
    try:
        raw = read_header(fd)
    except OSError as exc:
        raise SegmentError(f"cannot read segment {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)
    return parse_header(raw, str(path))


def _read_fixed(path: Path, offset: int, size: int) -> bytes:
    """``size`` bytes at ``offset`` of a regular file of ours, opened without following a
    symlink or blocking on a FIFO (the daemon's loop calls this: it must never block); b""
    if unreadable or anything else."""
    try:
        fd = _open_own(path)
    except SegmentError:
        return b""
    try:
        return os.pread(fd, size, offset)
    except OSError:
        return b""
    finally:
        os.close(fd)


def read_progress(path: Path) -> tuple[int, int]:
    """(rows done, rows total) of a segment being loaded; (0, 0) if it cannot be read yet."""
    raw = _read_fixed(path, PROGRESS_OFFSET, PROGRESS.size)
    return PROGRESS.unpack(raw) if len(raw) == PROGRESS.size else (0, 0)


def read_activity(path: Path) -> tuple[int, int]:
    """(rows done, activity counter) of a segment being loaded: either moves while its loader
    makes progress (the activity counter also moves while it computes the checksum); (0, 0)
    if it cannot be read yet."""
    raw = _read_fixed(path, PROGRESS_OFFSET, ACTIVITY_OFFSET + ACTIVITY.size - PROGRESS_OFFSET)
    if len(raw) != ACTIVITY_OFFSET + ACTIVITY.size - PROGRESS_OFFSET:
        return 0, 0
    return PROGRESS.unpack_from(raw)[0], ACTIVITY.unpack_from(raw, ACTIVITY_OFFSET - PROGRESS_OFFSET)[0]


