"""The life of a segment file: create, fill, publish, check, evict. The format (header,
``SegmentMeta``) is in format.py, names in naming.py, mapping one (attach, leases) in attach.py.

Segments are owner-only in every deployment: a temporary is mode 0600; ``publish`` makes it
0400 with ``fchmod`` before the rename, so no process (root aside) can open a published
segment for writing, and no other user can open it at all. A client of another uid (a
``--group`` member) maps only the segments the daemon grants it, from a descriptor it hands
out (daemon/access/fdserver.py).

Lifecycle: ``create_segment`` makes ``<prefix>tmp-<pid>-<rand>`` (naming.py: it does not
say which segment it becomes) and reserves every byte with ``posix_fallocate`` (a full tmpfs
is a clear ShmFull now, never a SIGBUS later); the loader fills it and ``publish`` sets the
complete flag and renames it to ``<name>``, atomically (or to a fresh name when a file that is
not ours took ``<name>``). Clients only ever open final names, so they never see a partial
segment. The daemon then records the file's inode and ctime (``check_published``'s
``PublishStamp``) and checks them at every hit: the owner's chmod-write-chmod back, or an
unlink and re-create, changes one of them.

Eviction: ``try_evict`` unlinks only after ``flock(LOCK_EX | LOCK_NB)`` succeeds, so a segment
a live client holds a lease on stays. What nothing can clean up: a SIGKILLed daemon leaves its
temporaries and segments behind; the next daemon on the same runtime dir removes or adopts them.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import stat
import struct
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path

from ..errors import SegmentError, ShmFull
from ..util.crc import LOAD_CRC, CrcKind
from ..util.logtext import printable
from ..util.safeio import NOFOLLOW_FLAGS, describe_file, flocks, is_own_file, open_regular
from ..util.units import format_bytes
from .attach import UNKNOWN_STAMP, PublishStamp
from .checksum import checksum_text, data_checksum
from .format import (
    ACTIVITY,
    ACTIVITY_OFFSET,
    CHECKSUM,
    CHECKSUM_NONE,
    CHECKSUM_OFFSET,
    COMPLETE_OFFSET,
    FIXED,
    FORMAT_VERSION,
    MAGIC,
    META_LENGTH_OFFSET,
    META_OFFSET,
    PROGRESS,
    PROGRESS_OFFSET,
    SegmentMeta,
    data_view,
    meta_blob,
    parse_header,
    read_header,
)
from .naming import fresh_name

__all__ = [
    "PUBLISHED_MODE",
    "SegmentWriter",
    "create_segment",
    "check_published",
    "open_published",
    "count_leases",
    "any_leased",
    "try_evict",
    "reserve_range",
]

PUBLISHED_MODE = 0o400  # every published segment, in every deployment: its owner may read it, nobody else
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100

log = logging.getLogger("h5serve.segments")


def _free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class SegmentWriter:
    """A temporary segment being filled by a loader. ``data`` is writable."""

    def __init__(self, path: Path, fd: int, meta: SegmentMeta) -> None:
        self.path = path
        self.meta = meta
        self._fd = fd
        self._map = mmap.mmap(fd, meta.file_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.data = data_view(self._map, meta)
        self._activity = 0

    def data_target(self) -> tuple[int, int]:
        """``(fd, offset)``: the segment file's descriptor and the byte offset of ``data[0]`` in
        it, for writing rows with ``pwrite`` instead of through the mapping."""
        return self._fd, self.meta.header_size

    def set_progress(self, rows_done: int) -> None:
        self._map[PROGRESS_OFFSET:PROGRESS_OFFSET + PROGRESS.size] = PROGRESS.pack(rows_done, self.meta.rows)
        self.mark_activity()

    def mark_activity(self) -> None:
        """Say "still working" where the daemon's stall watchdog looks (``read_activity``):
        a counter in the header that only moves when the load does."""
        self._activity += 1
        self._map[ACTIVITY_OFFSET:ACTIVITY_OFFSET + ACTIVITY.size] = ACTIVITY.pack(self._activity)

    def compute_checksum(self, threads: int = 1) -> str:
        """The crc of the rows as written (``LOAD_CRC``), stored in the header. Call once every
        row is in place: ``verify_content`` compares the rows against it later."""
        return self.store_checksum(data_checksum(self._map, self.meta.header_size, self.meta.nbytes, threads,
                                                 lambda _: self.mark_activity()))

    def reserve_all(self) -> None:
        """Reserve every byte of the segment as created (``posix_fallocate``), for a segment
        created with ``reserve=False``; before any row is written.

        Raised when the shm filesystem has no room: ShmFull.
        """
        _fallocate(self._fd, 0, self.meta.file_size, self.meta, self.path.parent)

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
        blob = meta_blob(meta)
        os.pwrite(self._fd, blob, META_OFFSET)
        self._map[META_LENGTH_OFFSET:META_LENGTH_OFFSET + 4] = struct.pack("<I", len(blob))
        self.meta = meta

    def store_checksum(self, crc: int, kind: CrcKind = LOAD_CRC) -> str:
        """Store ``crc`` (``kind``'s crc of the rows as written) in the header; ``crc32c:...``."""
        value = struct.pack("<I", crc).ljust(16, b"\0")
        self._map[CHECKSUM_OFFSET:CHECKSUM_OFFSET + CHECKSUM.size] = CHECKSUM.pack(kind.code, value)
        return checksum_text(kind.code, value)

    def publish(self, final_name: str) -> Path:
        """Mark complete, make read-only and rename to ``final_name`` in the same directory
        (atomic); to a ``fresh_name`` of it when a file that is not ours is there. Returns the
        path it was published as.

        The mode changes on the descriptor before the rename, so the final name never exists
        writable: nobody (root aside) can open it for writing, or truncate it, afterwards.
        """
        self.set_progress(self.meta.rows)
        self._map[COMPLETE_OFFSET:COMPLETE_OFFSET + 4] = struct.pack("<I", 1)
        os.fchmod(self._fd, PUBLISHED_MODE)
        final = self.path.with_name(final_name)
        self.close()
        try:
            _rename_noreplace(self.path, final)
        except FileExistsError:  # someone else's file took the name (seen before, planted since)
            taken, final = final, self.path.with_name(fresh_name(final_name))
            try:
                _rename_noreplace(self.path, final)
            except OSError as exc:
                raise SegmentError(_publish_failure(final, exc)) from exc
            log.warning("%s is taken by a file that is not ours: published as %s instead",
                        printable(taken), printable(final.name))
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


def _fallocate(fd: int, offset: int, length: int, meta: SegmentMeta, shm_dir: Path, size_only: bool = False) -> None:
    """``posix_fallocate`` (``size_only``: ``ftruncate`` to that size), a full tmpfs or a file
    size limit as ShmFull."""
    try:
        if size_only:
            os.ftruncate(fd, offset + length)
        else:
            os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        size = offset + length
        if exc.errno == errno.EFBIG:
            raise ShmFull(
                f"{meta.key!r} rank {meta.rank} needs a {format_bytes(size)} segment, over this "
                "process's file size limit; raise it (ulimit -f) for the daemon"
            ) from exc
        _raise_if_full(exc, meta, shm_dir, size)
        raise


def reserve_range(fd: int, offset: int, length: int, meta: SegmentMeta, shm_dir: Path) -> None:
    """Reserve ``length`` bytes of ``fd`` from ``offset`` (``posix_fallocate``) before they are
    written through a mapping (a stream arena's slot): a full tmpfs is a ShmFull here, never a
    SIGBUS or an ENOSPC from the copy later.

    Raised when the shm filesystem has no room: ShmFull (says needed and free bytes)."""
    _fallocate(fd, offset, length, meta, shm_dir)


def _raise_if_full(exc: OSError, meta: SegmentMeta, shm_dir: Path, size: int) -> None:
    """Raised when ``exc`` says the shm filesystem is full: ShmFull naming needed and free bytes."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        raise ShmFull(
            f"not enough room in {shm_dir} for {meta.key!r} rank {meta.rank}: needs "
            f"{format_bytes(size)}, {format_bytes(_free_bytes(Path(shm_dir)))} free; "
            "free space (h5serve stop, or remove other files there), or enlarge the mount"
        ) from exc


def create_segment(shm_dir: Path, tmp_name: str, meta: SegmentMeta, reserve: bool = True) -> SegmentWriter:
    """Create ``shm_dir/tmp_name`` with every byte reserved, header written, incomplete; mode
    0600 (nobody else may open it while it is written: a descriptor opened then would read the
    rows once published). ``reserve=False``: the caller reserves (``SegmentWriter.reserve_all``)
    before it writes any row.

    Raised when the shm filesystem has no room for it: ShmFull (says needed and free bytes).
    """
    path = Path(shm_dir) / tmp_name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | NOFOLLOW_FLAGS, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # "being written": a restarted daemon removes it only once unlocked
        # reserve=False: its size (the mapping needs it), nothing allocated yet
        _fallocate(fd, 0, meta.file_size, meta, Path(shm_dir), size_only=not reserve)
        blob = meta_blob(meta)
        header = FIXED.pack(MAGIC, FORMAT_VERSION, 0, 0, meta.rows, len(blob), CHECKSUM_NONE, b"", 0)
        try:  # reserve=False: the header's page is allocated here, and a full tmpfs refuses it
            os.pwrite(fd, header.ljust(META_OFFSET, b"\0") + blob, 0)
        except OSError as exc:
            _raise_if_full(exc, meta, Path(shm_dir), meta.file_size)
            raise
        return SegmentWriter(path, fd, meta)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise


def open_published(path: Path | str, size: int, stamp: PublishStamp = UNKNOWN_STAMP,
                   dir_fd: int | None = None) -> tuple[int, os.stat_result]:
    """Open a published segment read-only (``O_NOFOLLOW | O_NONBLOCK``: never a symlink, never
    blocks on a FIFO) and check what was opened: a regular file of ours, one link, mode
    PUBLISHED_MODE, exactly ``size`` bytes, and ``stamp`` (when known). ``(fd, fstat)``.

    Raised when any of that does not hold (missing, truncated, made writable, replaced):
    SegmentError, saying what.
    """
    fd, st = open_regular(path, SegmentError, owners=(os.geteuid(),), dir_fd=dir_fd)
    try:
        if st.st_nlink != 1:
            raise SegmentError(f"segment {path} has {st.st_nlink} links, not 1")
        if stat.S_IMODE(st.st_mode) != PUBLISHED_MODE:
            raise SegmentError(f"segment {path} has mode {stat.S_IMODE(st.st_mode):o}, not {PUBLISHED_MODE:o}: "
                               "something made it writable")
        if st.st_size != size:
            raise SegmentError(f"segment {path} is {st.st_size} bytes, not {size}: it was truncated or extended")
        if not stamp.matches(st):
            what = "inode" if st.st_ino != stamp.ino else "ctime"
            raise SegmentError(f"segment {path} changed since it was published (its {what} differs: replaced, "
                               "or made writable and back)")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def check_published(path: Path, meta: SegmentMeta, header: bytes | None = None,
                    stamp: PublishStamp = UNKNOWN_STAMP) -> tuple[bytes, PublishStamp]:
    """Cheap check of a published segment before it is handed out again (``open_published``:
    fstat only), and of its header: complete and describing ``meta`` (byte for byte ``header``
    when given: the one seen when it was published). Returns its header and stamp.

    Raised when any of that does not hold (missing, truncated, made writable, replaced, header
    rewritten): SegmentError, saying what.
    """
    fd, st = open_published(path, meta.file_size, stamp)
    try:
        raw = read_header(fd)
    finally:
        os.close(fd)
    if header is not None:
        if raw != header:
            raise SegmentError(f"segment {path} has a header that changed since it was published")
        return raw, PublishStamp.of(st)
    found, complete = parse_header(raw, f"segment {path}")
    if found != meta or not complete:
        raise SegmentError(f"segment {path} has a header that does not describe the load it should hold")
    return raw, PublishStamp.of(st)


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


def any_leased(files: Collection[tuple[int, int]]) -> bool:
    """Whether some process holds a shared lease on one of ``files`` (``(st_dev, st_ino)`` of
    each): one read of /proc/locks, no ``stat`` of any segment. False where /proc/locks
    cannot be read."""
    if not files:
        return False
    return any(not lock.exclusive and (lock.dev, lock.ino) in files for lock in flocks())


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
