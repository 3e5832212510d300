"""Shared-memory segments: naming, header, create, publish, attach, lease, evict.

A segment is one file in the shm dir (``/dev/shm`` by default)::

    offset 0     magic "H5SRVSEG", format version, complete flag, rows done, rows total,
                 length of the msgpack metadata (SegmentMeta), checksum kind and value,
                 activity counter; at offset 64 the metadata itself
    offset 4096  the rows, C-contiguous, native byte order (page-aligned); variable-length
                 rows (h5serve/hdf5/vlen.py): rows + 1 int64 offsets, then the values

A temporary is mode 0600 (0640 with a group); ``publish`` makes it read-only (0400 / 0440)
with ``fchmod`` before the rename, so no process (root aside) can open a published segment
for writing. The content checksum (crc32c or crc32 of the rows, h5serve/crc.py; when the loader computed one) lets
``verify_content`` tell whether anything wrote into a segment after it was published.

Lifecycle: ``create_segment`` makes ``<name>.tmp-<pid>-<rand>`` and reserves every byte
with ``posix_fallocate`` (a full tmpfs is a clear ShmFull now, never a SIGBUS later);
the loader fills it and ``publish`` sets the complete flag and renames it to ``<name>``,
atomically. Clients only ever open final names, so they never see a partial segment.

Leases: every attached client holds ``flock(LOCK_SH)`` on its open fd (inherited by forked
DataLoader workers, re-taken by spawned ones). ``try_evict`` unlinks only after
``flock(LOCK_EX | LOCK_NB)`` succeeds. The kernel drops the locks of dead processes, so a
crashed client never pins a segment. What nothing can clean up: a SIGKILLed daemon leaves its
temporaries and segments behind; the next daemon on the same runtime dir removes or adopts them.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import hashlib
import logging
import mmap
import os
import secrets
import stat
import struct
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from .crc import KINDS, LOAD_CRC, CrcKind
from .errors import ConfigError, SegmentError, ShmFull
from .hdf5.vlen import values_offset, vlen_nbytes
from .safeio import NOFOLLOW_FLAGS, describe_owner, flocks, open_regular
from .sharding import RowRange, Selection

__all__ = [
    "HEADER_SIZE",
    "SegmentMeta",
    "SegmentWriter",
    "AttachedSegment",
    "segment_prefix",
    "segment_name",
    "SECRET_BYTES",
    "is_own_file",
    "describe_file",
    "temporary_name",
    "temporary_owner_pid",
    "create_segment",
    "attach_segment",
    "read_progress",
    "read_meta",
    "read_activity",
    "check_published",
    "verify_content",
    "data_checksum",
    "try_evict",
    "count_leases",
    "format_bytes",
]

MAGIC = b"H5SRVSEG"
FORMAT_VERSION = 2  # 2: read-only once published, checksum and activity counter in the header
HEADER_SIZE = 4096
LEASE_WAIT_S = 5.0  # how long attaching waits for a segment someone holds exclusively
# magic, version, complete, rows_done, rows_total, meta_len, checksum kind, checksum, activity
_FIXED = struct.Struct("<8sIIQQII16sQ")
_COMPLETE_OFFSET = 12
_PROGRESS = struct.Struct("<QQ")
_PROGRESS_OFFSET = 16
_CHECKSUM = struct.Struct("<I16s")
_CHECKSUM_OFFSET = 36
_ACTIVITY = struct.Struct("<Q")
_ACTIVITY_OFFSET = 56
_META_OFFSET = 64
CHECKSUM_NONE = 0
_CHECKSUM_NAMES = {CHECKSUM_NONE: "none", 1: "crc32", 2: "crc32c"}  # h5serve/crc.py: the kinds' codes
_CHECKSUM_BLOCK = 32 * 1024 * 1024  # bytes per hash call: threads hash blocks, CrcKind.combine joins them
_PUBLISHED_MODE_MASK = 0o440  # a temporary's 0600 / 0640 becomes 0400 / 0440
_TMP_MARK = ".tmp-"
_STR_FIELDS = frozenset({"source_path", "key", "mode", "dtype", "source_dtype", "vlen"})
_LIST_FIELDS = frozenset({"row_shape", "linked", "files", "depends"})
MAX_HEADER_BYTES = 4 * 1024 * 1024  # a multi-file segment's header (its file list) is at most this
_VLEN_KINDS = frozenset({"", "seq", "utf-8", "ascii"})  # h5serve/hdf5/vlen.py: fixed, numeric, strings
_META_LENGTH_OFFSET = 32  # the u32 metadata length in the fixed header
SECRET_BYTES = 32  # the daemon's naming key (blake2b takes up to 64)
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100

log = logging.getLogger("h5serve.segments")


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

    @property
    def source(self) -> tuple[str, int, int, int, int]:
        return (self.source_path, self.source_dev, self.source_ino, self.source_size, self.source_mtime_ns)

    def identities(self) -> list[tuple]:
        """Every file whose identity the rows depend on, as (path, dev, ino, size, mtime_ns)."""
        out = [self.source, *((self.linked,) if self.linked else ())]
        out += [tuple(f[:5]) for f in self.files[1:]]
        return out + [tuple(d) for d in self.depends]

    @property
    def file_rows(self) -> tuple[int, ...]:
        """Rows of each file of a multi-file dataset, in order (empty for one file)."""
        return tuple(int(f[5]) for f in self.files)

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @functools.cached_property
    def header_size(self) -> int:
        """Bytes before the rows: one page, or whole pages enough for a long file list."""
        if not self.files and not self.depends:
            return HEADER_SIZE
        need = _META_OFFSET + len(msgpack.packb(self.to_wire()))
        return -(-need // HEADER_SIZE) * HEADER_SIZE

    @property
    def nbytes(self) -> int:
        if self.vlen:
            return vlen_nbytes(self.rows, self.values, self.np_dtype.itemsize)
        return self.rows * int(np.prod(self.row_shape, dtype=np.int64)) * self.np_dtype.itemsize

    @property
    def file_size(self) -> int:
        return self.header_size + self.nbytes

    @property
    def row_range(self) -> RowRange:
        """The global rows this segment holds, in its order.

        Raised when mode, world size and rank do not describe a selection: SegmentError.
        """
        try:
            return Selection(self.mode, self.world_size, self.rank, self.span).rows(self.total_rows)
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
        return base

    def to_wire(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["row_shape"] = list(self.row_shape)
        out["linked"] = list(self.linked)
        for name in ("files", "depends"):  # only when used: a one-file header reads as before
            if out[name]:
                out[name] = [list(entry) for entry in out[name]]
            else:
                del out[name]
        if not self.vlen:  # fixed rows: the header an h5serve without variable-length rows reads too
            del out["vlen"], out["values"]
        return out

    @classmethod
    def from_wire(cls, data: object) -> SegmentMeta:
        names = {f.name for f in fields(cls)}
        if isinstance(data, dict):  # written before node mode (span 1), or without these fields
            data = {"span": 1, "files": [], "depends": [], "vlen": "", "values": 0, **data}
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
        if data["files"] and (len(data["files"]) < 2 or sum(f[5] for f in data["files"]) != data["total_rows"]
                              or tuple(data["files"][0][:5]) != (data["source_path"], data["source_dev"],
                                                                  data["source_ino"], data["source_size"],
                                                                  data["source_mtime_ns"])):
            raise SegmentError("segment metadata files do not describe the dataset's rows")
        try:
            meta = cls(**{**data, "row_shape": tuple(data["row_shape"]), "linked": tuple(linked),
                          "files": tuple(tuple(f) for f in data["files"]),
                          "depends": tuple(tuple(d) for d in data["depends"])})
            meta.np_dtype  # noqa: B018 - validates the dtype string
            meta.row_range  # noqa: B018 - validates mode, world size and rank
        except (TypeError, ValueError) as exc:
            raise SegmentError(f"segment metadata is invalid: {exc}") from exc
        return meta


def _is_identity(entry: object, size: int) -> bool:
    """Whether ``entry`` is ``[path, dev, ino, size, mtime_ns(, rows)]``: a str and ints >= 0."""
    return (isinstance(entry, (list, tuple)) and len(entry) == size and type(entry[0]) is str
            and all(type(n) is int and n >= 0 for n in entry[1:]))


def segment_prefix(namespace: str) -> str:
    """Every segment of one daemon (uid + runtime-dir namespace) starts with this: public,
    so that the SLURM epilog can find what a killed daemon left behind."""
    return f"h5serve-{os.getuid()}-{namespace}-"


def segment_name(namespace: str, meta: SegmentMeta, secret: bytes) -> str:
    """The published name of the segment holding ``meta``. The part after the prefix is keyed
    by the daemon's ``secret``, so nobody can compute a name from ``stat()`` of the data file
    and plant a file there before the daemon publishes it."""
    if not 16 <= len(secret) <= 64:
        raise ValueError(f"a segment naming secret has 16..64 bytes, got {len(secret)}")
    digest = hashlib.blake2b(msgpack.packb(list(meta.identity())), digest_size=12, key=secret).hexdigest()
    return segment_prefix(namespace) + digest


def is_own_file(st: os.stat_result, owner: int | None = None) -> bool:
    """True when ``st`` (an lstat or fstat) is a regular file of ``owner`` (default: our euid):
    the only kind of file under a segment prefix that the daemon reads, evicts or removes."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == (os.geteuid() if owner is None else owner)


def describe_file(st: os.stat_result) -> str:
    """``a FIFO of uid 1001 (mallory)``: what sits at a path, for log and error messages."""
    kinds = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a file"))
    kind = next((text for test, text in kinds if test(st.st_mode)), "a device")
    return f"{kind} of {describe_owner(st.st_uid)}"


def temporary_name(name: str) -> str:
    return f"{name}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(3)}"


def temporary_owner_pid(filename: str) -> int | None:
    """The pid that created a temporary segment file, or None if it is not a temporary."""
    if _TMP_MARK not in filename:
        return None
    try:
        return int(filename.rsplit(_TMP_MARK, 1)[1].split("-", 1)[0])
    except ValueError:
        return None


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _data_view(buffer: mmap.mmap, meta: SegmentMeta) -> np.ndarray:
    """The rows (fixed rows), or the ``rows + 1`` offsets (variable-length rows)."""
    if meta.vlen:
        return np.frombuffer(buffer, dtype=np.int64, count=meta.rows + 1, offset=meta.header_size)
    count = meta.rows * int(np.prod(meta.row_shape, dtype=np.int64))
    flat = np.frombuffer(buffer, dtype=meta.np_dtype, count=count, offset=meta.header_size)
    return flat.reshape((meta.rows, *meta.row_shape))


def _values_view(buffer: mmap.mmap, meta: SegmentMeta) -> np.ndarray | None:
    """The values of variable-length rows (None for fixed rows)."""
    if not meta.vlen:
        return None
    return np.frombuffer(buffer, dtype=meta.np_dtype, count=meta.values,
                         offset=meta.header_size + values_offset(meta.rows))


# ----- checksums of large buffers, in parallel (h5serve/crc.py: the kinds) -------------------
def data_checksum(buffer: Any, offset: int, length: int, threads: int = 1,
                  progress: Callable[[int], None] | None = None, kind: CrcKind = LOAD_CRC) -> int:
    """``kind``'s crc of ``buffer[offset:offset + length]``, hashed in blocks by up to
    ``threads`` threads (both kinds release the GIL); ``progress(bytes)`` after each block."""
    starts = list(range(offset, offset + length, _CHECKSUM_BLOCK))
    with memoryview(buffer) as view:  # released on return, so the caller can close its mapping

        def one(start: int) -> int:
            end = min(start + _CHECKSUM_BLOCK, offset + length)
            with view[start:end] as block:
                crc = kind.update(block, 0)
            if progress is not None:
                progress(end - start)
            return crc

        if threads > 1 and len(starts) > 1:
            with ThreadPoolExecutor(min(threads, len(starts)), thread_name_prefix="h5serve-crc") as pool:
                crcs = list(pool.map(one, starts))
        else:
            crcs = [one(start) for start in starts]
    total = 0
    for start, crc in zip(starts, crcs):
        total = kind.combine(total, crc, min(_CHECKSUM_BLOCK, offset + length - start))
    return total


def _checksum_text(code: int, value: bytes) -> str:
    """``crc32:1a2b3c4d`` or ``crc32c:...`` (the form ``status`` shows), or "" when there is none."""
    name = _CHECKSUM_NAMES.get(code)
    if code == CHECKSUM_NONE or name is None:
        return ""
    return f"{name}:{struct.unpack_from('<I', value)[0]:08x}"


class SegmentWriter:
    """A temporary segment being filled by a loader. ``data`` is writable."""

    def __init__(self, path: Path, fd: int, meta: SegmentMeta) -> None:
        self.path = path
        self.meta = meta
        self._fd = fd
        self._map = mmap.mmap(fd, meta.file_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.data = _data_view(self._map, meta)
        self._activity = 0

    def data_target(self) -> tuple[int, int]:
        """``(fd, offset)``: the segment file's descriptor and the byte offset of ``data[0]`` in
        it, for writing rows with ``pwrite`` instead of through the mapping."""
        return self._fd, self.meta.header_size

    def set_progress(self, rows_done: int) -> None:
        self._map[_PROGRESS_OFFSET:_PROGRESS_OFFSET + _PROGRESS.size] = _PROGRESS.pack(rows_done, self.meta.rows)
        self.mark_activity()

    def mark_activity(self) -> None:
        """Say "still working" where the daemon's stall watchdog looks (``read_activity``):
        a counter in the header that only moves when the load does."""
        self._activity += 1
        self._map[_ACTIVITY_OFFSET:_ACTIVITY_OFFSET + _ACTIVITY.size] = _ACTIVITY.pack(self._activity)

    def compute_checksum(self, threads: int = 1) -> str:
        """The crc of the rows as written (``LOAD_CRC``), stored in the header. Call once every
        row is in place: ``verify_content`` compares the rows against it later."""
        return self.store_checksum(data_checksum(self._map, self.meta.header_size, self.meta.nbytes, threads,
                                                 lambda _: self.mark_activity()))

    def reserve(self, offset: int, length: int) -> None:
        """Reserve ``length`` more bytes of the data area from ``offset`` (``posix_fallocate``,
        growing the file) before they are written: variable-length values, whose size is
        known a block at a time. Never written through the mapping (it covers the size at
        creation only).

        Raised when the shm filesystem has no room: ShmFull.
        """
        _fallocate(self._fd, self.meta.header_size + offset, length, self.meta, self.path.parent)

    def set_values(self, values: int) -> None:
        """Record the number of variable-length values written (the header's metadata, and so
        the segment's size), once they all are."""
        meta = replace(self.meta, values=values)
        blob = _meta_blob(meta)
        os.pwrite(self._fd, blob, _META_OFFSET)
        self._map[_META_LENGTH_OFFSET:_META_LENGTH_OFFSET + 4] = struct.pack("<I", len(blob))
        self.meta = meta

    def store_checksum(self, crc: int, kind: CrcKind = LOAD_CRC) -> str:
        """Store ``crc`` (``kind``'s crc of the rows as written) in the header; ``crc32c:...``."""
        value = struct.pack("<I", crc).ljust(16, b"\0")
        self._map[_CHECKSUM_OFFSET:_CHECKSUM_OFFSET + _CHECKSUM.size] = _CHECKSUM.pack(kind.code, value)
        return _checksum_text(kind.code, value)

    def publish(self, final_name: str) -> Path:
        """Mark complete, make read-only and rename to ``final_name`` in the same directory (atomic).

        The mode changes on the descriptor before the rename, so the final name never exists
        writable: nobody (root aside) can open it for writing, or truncate it, afterwards.
        """
        self.set_progress(self.meta.rows)
        self._map[_COMPLETE_OFFSET:_COMPLETE_OFFSET + 4] = struct.pack("<I", 1)
        os.fchmod(self._fd, stat.S_IMODE(os.fstat(self._fd).st_mode) & _PUBLISHED_MODE_MASK)
        final = self.path.with_name(final_name)
        self.close()
        try:
            _rename_noreplace(self.path, final)
        except OSError as exc:
            raise SegmentError(_publish_failure(final, exc)) from exc
        return final

    def abort(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.close()

    def close(self) -> None:
        self.data = None  # type: ignore[assignment]
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive (e.g. in a traceback): it unmaps when freed
                pass
            self._map = None  # type: ignore[assignment]
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _rename_noreplace(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target`` unless another user's file (or a symlink, FIFO...) is
    there: a root daemon must not replace what someone else put at a published name, and an
    unprivileged one gets EPERM for it in a sticky dir anyway. A leftover of our own at the
    name is replaced.

    Raised when something not ours is at ``target``: FileExistsError; other failures: OSError.
    """
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc >= 2.28
    err = errno.ENOSYS
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
    if err not in (errno.EEXIST, errno.ENOSYS, errno.EINVAL):
        raise OSError(err, os.strerror(err), str(target))
    try:  # taken, or renameat2 unsupported here: replace only a file of our own
        st = os.lstat(target)
    except FileNotFoundError:
        st = None
    if st is not None and not is_own_file(st):
        raise FileExistsError(errno.EEXIST, f"{describe_file(st)} is in the way", str(target))
    os.rename(source, target)


def _publish_failure(final: Path, exc: OSError) -> str:
    why = exc.strerror or str(exc)
    try:
        st = os.lstat(final)
    except OSError:
        st = None
    if st is not None and not is_own_file(st):
        why = f"{describe_file(st)} is in the way"
    return (f"cannot publish segment {final}: {why}; clients read this shard lazily. Remove that file "
            "(its owner or root can), or restart the daemon with another --shm-dir")


def _fallocate(fd: int, offset: int, length: int, meta: SegmentMeta, shm_dir: Path) -> None:
    """``posix_fallocate``, a full tmpfs or a file size limit as ShmFull."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        size = offset + length
        if exc.errno == errno.EFBIG:
            raise ShmFull(
                f"{meta.key!r} rank {meta.rank} needs a {format_bytes(size)} segment, over this "
                "process's file size limit; raise it (ulimit -f) for the daemon"
            ) from exc
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ShmFull(
                f"not enough room in {shm_dir} for {meta.key!r} rank {meta.rank}: needs "
                f"{format_bytes(size)}, {format_bytes(_free_bytes(Path(shm_dir)))} free; "
                "free space (h5serve stop, or remove other files there), or enlarge the mount"
            ) from exc
        raise


def _meta_blob(meta: SegmentMeta) -> bytes:
    """The header's msgpack metadata. Raised when it does not fit the header: SegmentError."""
    blob = msgpack.packb(meta.to_wire())
    limit = meta.header_size if meta.files or meta.depends else HEADER_SIZE
    if _META_OFFSET + len(blob) > min(limit, MAX_HEADER_BYTES):
        raise SegmentError(f"segment metadata too large ({len(blob)} bytes): shorten the path or key")
    return blob


def create_segment(shm_dir: Path, tmp_name: str, meta: SegmentMeta, group: int | None = None) -> SegmentWriter:
    """Create ``shm_dir/tmp_name`` with every byte reserved, header written, incomplete.
    Mode 0600, or 0640 owned by ``group`` (a gid) when given.

    Raised when the shm filesystem has no room for it: ShmFull (says needed and free bytes).
    """
    path = Path(shm_dir) / tmp_name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | NOFOLLOW_FLAGS, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # "being written": a restarted daemon removes it only once unlocked
        if group is not None:
            os.fchown(fd, -1, group)
            os.fchmod(fd, 0o640)
        _fallocate(fd, 0, meta.file_size, meta, Path(shm_dir))
        blob = _meta_blob(meta)
        header = _FIXED.pack(MAGIC, FORMAT_VERSION, 0, 0, meta.rows, len(blob), CHECKSUM_NONE, b"", 0)
        os.pwrite(fd, header.ljust(_META_OFFSET, b"\0") + blob, 0)
        return SegmentWriter(path, fd, meta)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise


def _read_header(fd: int) -> bytes:
    """The header of the segment open at ``fd``: its first page, and the pages after it when
    its metadata says they belong to it (a multi-file segment's file list)."""
    raw = os.pread(fd, HEADER_SIZE, 0)
    if len(raw) == HEADER_SIZE:
        meta_len = _FIXED.unpack_from(raw, 0)[5]
        if HEADER_SIZE < _META_OFFSET + meta_len <= MAX_HEADER_BYTES:
            size = -(-(_META_OFFSET + meta_len) // HEADER_SIZE) * HEADER_SIZE
            raw += os.pread(fd, size - HEADER_SIZE, HEADER_SIZE)
    return raw


def _parse_header(raw: bytes, where: str) -> tuple[SegmentMeta, bool]:
    if len(raw) < HEADER_SIZE:
        raise SegmentError(f"{where} is truncated ({len(raw)} bytes): not an h5serve segment")
    magic, version, complete, _done, _total, meta_len, _kind, _sum, _activity = _FIXED.unpack_from(raw, 0)
    if magic != MAGIC:
        raise SegmentError(f"{where} is not an h5serve segment (bad magic)")
    if version != FORMAT_VERSION:
        raise SegmentError(
            f"{where} has segment format {version}, this h5serve reads {FORMAT_VERSION}: it was written by another "
            "h5serve version; run one version for the daemon and the jobs, and restart the daemon "
            "(h5serve stop; h5serve start) so it loads the data again"
        )
    if _META_OFFSET + meta_len > min(len(raw), MAX_HEADER_BYTES):
        raise SegmentError(f"{where} has a corrupt header (metadata length {meta_len})")
    extended = _META_OFFSET + meta_len > HEADER_SIZE
    try:
        data = msgpack.unpackb(raw[_META_OFFSET:_META_OFFSET + meta_len], raw=False, strict_map_key=True)
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
        raw = _read_header(fd)
    except OSError as exc:
        raise SegmentError(f"cannot read segment {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)
    return _parse_header(raw, str(path))


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
    raw = _read_fixed(path, _PROGRESS_OFFSET, _PROGRESS.size)
    return _PROGRESS.unpack(raw) if len(raw) == _PROGRESS.size else (0, 0)


def read_activity(path: Path) -> tuple[int, int]:
    """(rows done, activity counter) of a segment being loaded: either moves while its loader
    makes progress (the activity counter also moves while it computes the checksum); (0, 0)
    if it cannot be read yet."""
    raw = _read_fixed(path, _PROGRESS_OFFSET, _ACTIVITY_OFFSET + _ACTIVITY.size - _PROGRESS_OFFSET)
    if len(raw) != _ACTIVITY_OFFSET + _ACTIVITY.size - _PROGRESS_OFFSET:
        return 0, 0
    return _PROGRESS.unpack_from(raw)[0], _ACTIVITY.unpack_from(raw, _ACTIVITY_OFFSET - _PROGRESS_OFFSET)[0]


def published_mode(group: int | None) -> int:
    """The mode of a published segment: 0400, or 0440 when shared with a group."""
    return 0o440 if group is not None else 0o400


def check_published(path: Path, meta: SegmentMeta, mode: int, header: bytes | None = None) -> bytes:
    """Cheap check of a published segment before it is handed out again: a regular file of
    ours (no symlink, no FIFO: never blocks), one link, mode ``mode``, exactly
    ``meta.file_size`` bytes, and a complete header describing ``meta`` (byte for byte
    ``header`` when given: the one seen when it was published). Returns its header.

    Raised when any of that does not hold (missing, truncated, made writable, header
    rewritten): SegmentError, saying what.
    """
    fd, st = open_regular(path, SegmentError, owners=(os.geteuid(),))
    try:
        if st.st_nlink != 1:
            raise SegmentError(f"segment {path} has {st.st_nlink} links, not 1")
        if stat.S_IMODE(st.st_mode) != mode:
            raise SegmentError(f"segment {path} has mode {stat.S_IMODE(st.st_mode):o}, not {mode:o}: "
                               "something made it writable")
        if st.st_size != meta.file_size:
            raise SegmentError(
                f"segment {path} is {st.st_size} bytes, not {meta.file_size}: it was truncated or extended")
        raw = _read_header(fd)
    finally:
        os.close(fd)
    if header is not None:
        if raw != header:
            raise SegmentError(f"segment {path} has a header that changed since it was published")
        return raw
    found, complete = _parse_header(raw, f"segment {path}")
    if found != meta or not complete:
        raise SegmentError(f"segment {path} has a header that does not describe the load it should hold")
    return raw


def header_checksum(header: bytes) -> str:
    """The checksum a segment header records (``crc32:...``), or "" when it has none."""
    kind, value = _CHECKSUM.unpack_from(header, _CHECKSUM_OFFSET)
    return _checksum_text(kind, value)


def verify_content(path: Path, expected: str = "", threads: int = 1) -> str:
    """Re-read a published segment's rows and compare them with the checksum its header
    records (and with ``expected``, the daemon's record, when given). Returns "" when they
    match, else what does not.

    Raised when it cannot be opened or is not a valid complete segment: SegmentError.
    """
    fd, st = open_regular(path, SegmentError)
    try:
        header = _read_header(fd)
        meta, complete = _parse_header(header, f"segment {path}")
        if not complete or st.st_size != meta.file_size:
            return f"it is {st.st_size} bytes for {meta.file_size} expected, or incomplete (truncated or rewritten)"
        recorded = header_checksum(header)
        if expected and recorded != expected:
            return f"its header records checksum {recorded or 'none'}, the daemon recorded {expected}"
        if not recorded:
            return ""  # loaded without a checksum: nothing to compare with
        code = _CHECKSUM.unpack_from(header, _CHECKSUM_OFFSET)[0]
        kind = KINDS.get(code)
        if kind is None:
            return (f"its header records a {recorded.split(':')[0]} checksum, which this h5serve cannot compute "
                    f"(python -m pip install crc32c)")
        with mmap.mmap(fd, meta.file_size, mmap.MAP_SHARED, mmap.PROT_READ) as buffer:
            crc = data_checksum(buffer, meta.header_size, meta.nbytes, threads, kind=kind)
    finally:
        os.close(fd)
    actual = kind.text(crc)
    if actual == recorded:
        return ""
    return f"its rows have checksum {actual}, not the {recorded} recorded when it was loaded"


class AttachedSegment:
    """A published segment mapped read-only, with a shared lease held on its fd.

    ``data`` is a read-only ndarray over the mapping: copy rows out of it (the client's gather
    does, through a tensor view it never hands out); never give users a view of it.
    """

    def __init__(self, name: str, path: Path, fd: int, meta: SegmentMeta, buffer: mmap.mmap, owner: int) -> None:
        self.name = name
        self.path = path
        self.owner = owner
        self.meta = meta
        self._fd = fd
        self._map = buffer
        self.data = _data_view(buffer, meta)
        self.data.flags.writeable = False
        self.values = _values_view(buffer, meta)  # variable-length rows: their values (data: offsets)
        if self.values is not None:
            self.values.flags.writeable = False

    def close(self) -> None:
        """Drop this object's references. Python's mmap holds its own dup of the fd, so the
        lease lasts exactly as long as the mapping: until the last array viewing it is gone."""
        self.data = None  # type: ignore[assignment]
        self.values = None
        self._map = None  # type: ignore[assignment]
        if self._fd >= 0:
            os.close(self._fd)  # releases the flock once no forked child shares the fd
            self._fd = -1


def _take_lease(fd: int, path: Path) -> None:
    """``flock(LOCK_SH)``, waiting at most LEASE_WAIT_S: eviction holds LOCK_EX for an
    instant, but any process that can open the file could hold it forever.

    Raised when it stays locked: SegmentError.
    """
    deadline = time.monotonic() + LEASE_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise SegmentError(
                    f"segment {path} stayed locked by another process for {LEASE_WAIT_S:g}s; request it again"
                ) from None
            time.sleep(0.005)


def attach_segment(shm_dir: str | os.PathLike[str], name: str, owner: int | None = None) -> AttachedSegment:
    """Open, lease and map a published segment read-only; validates owner, header and size.
    ``owner`` is the daemon's uid (default: ours): a file of anyone else is never mapped.

    Raised when it is missing, evicted, truncated, incomplete or not ours: SegmentError.
    """
    path = Path(shm_dir) / name
    if _TMP_MARK in name or "/" in name:
        raise SegmentError(f"{name!r} is not a published segment name")
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW_FLAGS)  # a FIFO planted at the name must not hang us
    except OSError as exc:
        why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise SegmentError(f"segment {path} cannot be opened: {why} (evicted or not loaded)") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SegmentError(f"{path} is {describe_file(st)}, not a segment: refusing to map it")
        expected_owner = os.getuid() if owner is None else owner
        if st.st_uid != expected_owner:  # before the lease: another user's file could be locked forever
            raise SegmentError(
                f"segment {path} belongs to uid {st.st_uid}, not to the daemon's uid {expected_owner}: "
                "refusing to map it"
            )
        _take_lease(fd, path)
        if os.fstat(fd).st_nlink == 0:
            raise SegmentError(f"segment {path} was evicted while attaching; request it again")
        meta, complete = _parse_header(_read_header(fd), str(path))
        if not complete:
            raise SegmentError(f"segment {path} is not complete: refusing to map a partial load")
        if st.st_size != meta.file_size:
            raise SegmentError(
                f"segment {path} is {st.st_size} bytes but its header describes {meta.file_size}: refusing to map it"
            )
        if st.st_mode & 0o222:
            raise SegmentError(f"segment {path} is writable (mode {st.st_mode & 0o777:o}): refusing to map it")
        buffer = mmap.mmap(fd, meta.file_size, mmap.MAP_SHARED, mmap.PROT_READ)
        return AttachedSegment(name, path, fd, meta, buffer, st.st_uid)
    except BaseException:
        os.close(fd)
        raise


def count_leases(paths: list[Path]) -> dict[Path, int]:
    """Shared leases held on each segment, from /proc/locks: one per attaching process
    (forked DataLoader workers share their parent's lease; spawned ones take their own)."""
    wanted: dict[tuple[int, int], Path] = {}
    for path in paths:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        wanted[(st.st_dev, st.st_ino)] = path
    counts = dict.fromkeys(paths, 0)
    for lock in flocks():  # none where /proc/locks cannot be read: status reports no holders
        held = wanted.get((lock.dev, lock.ino))
        if held is not None and not lock.exclusive:
            counts[held] += 1
    return counts


def try_evict(path: Path, owner: int | None = None) -> bool:
    """Unlink a segment of ``owner`` (default: our euid) if no process holds a lease on it.

    True when no segment of ours is left at ``path``: evicted, already gone, or what is there
    is not ours (another user's file, a symlink, a FIFO: left alone and logged). False when a
    lease holds it, or it cannot be removed now (logged).
    """
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW_FLAGS)
    except FileNotFoundError:
        return True
    except OSError as exc:  # a symlink (ELOOP), a socket (ENXIO), unreadable...
        return _not_ours(path, owner, exc.strerror or str(exc))
    try:
        st = os.fstat(fd)
        if not is_own_file(st, owner):
            return _not_ours(path, owner)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return _unlink_same(path, st)
    finally:
        os.close(fd)


def _not_ours(path: Path, owner: int | None, why: str = "") -> bool:
    """True (nothing of ours there) unless ``path`` is in fact our regular file (then False:
    it could not be opened, so it stays)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError as exc:
        log.warning("cannot look at %s: %s; leaving it", path, exc.strerror)
        return False
    if is_own_file(st, owner):
        log.warning("cannot open segment %s to evict it: %s", path, why)
        return False
    log.warning("%s is %s, not a segment of this daemon: leaving it alone", path, describe_file(st))
    return True


def _unlink_same(path: Path, opened: os.stat_result) -> bool:
    """Unlink ``path`` if it still names the file ``opened`` describes. Never raises."""
    try:
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino):
            return True  # renamed away or replaced meanwhile: our file is no longer there
        os.unlink(path)
    except FileNotFoundError:
        return True
    except OSError as exc:
        log.warning("cannot remove segment %s: %s", path, exc.strerror)
        return False
    return True
