"""Mapping a published segment read-only: opened by name (a client of the daemon's own uid,
or root) or from a descriptor the daemon handed out (handout.py: any other client), checked
the same way either way before a byte is mapped.

Leases: an attached client takes ``flock(LOCK_SH)`` on its descriptor (inherited by forked
DataLoader workers, re-taken by spawned ones); ``lifecycle.try_evict`` unlinks only after
``flock(LOCK_EX | LOCK_NB)`` succeeds. Any process holding a descriptor of the file can also
flock it, exclusively and forever: so a lease is tried for LEASE_WAIT_S only (eviction holds
its exclusive lock for an instant), and a segment someone holds exclusively is mapped without
a lease (logged once). Its rows stay valid: an eviction only unlinks the name, the pages go
with the last mapping.

Tamper evidence: the daemon records the published file's inode and ctime (``PublishStamp``)
and hands them out with every ``ready`` reply; a file whose ``fstat`` differs (made writable
and back: a new ctime; unlinked and re-created: a new inode) is refused.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import SegmentError
from ..util.safeio import NOFOLLOW_FLAGS, describe_file
from .format import SegmentMeta, data_view, parse_header, read_header, values_view
from .naming import TMP_MARK

__all__ = ["LEASE_WAIT_S", "PublishStamp", "UNKNOWN_STAMP", "AttachedSegment", "attach_segment", "attach_descriptor",
           "check_segment_name"]

LEASE_WAIT_S = 0.05  # how long attaching tries for its shared lease before mapping without one
_LEASE_RETRY_S = 0.002

log = logging.getLogger("h5serve.segments")
_unleased_logged = False  # the first attach without a lease is a warning, later ones debug


@dataclass(frozen=True)
class PublishStamp:
    """A published segment's identity as the daemon recorded it right after publishing:
    ``(st_ino, st_ctime_ns)``. Zero: not known (a daemon that does not send it)."""

    ino: int = 0
    ctime_ns: int = 0

    @classmethod
    def of(cls, st: os.stat_result) -> PublishStamp:
        return cls(st.st_ino, st.st_ctime_ns)

    def matches(self, st: os.stat_result) -> bool:
        return not self.ino or (st.st_ino, st.st_ctime_ns) == (self.ino, self.ctime_ns)


UNKNOWN_STAMP = PublishStamp()


class AttachedSegment:
    """A published segment mapped read-only, with a shared lease held on its fd (``leased``
    False: someone held it exclusively; mapped without one).

    ``data`` is a read-only ndarray over the mapping: copy rows out of it (the client's gather
    does, through a tensor view it never hands out); never give users a view of it.
    """

    def __init__(self, name: str, path: Path, fd: int, meta: SegmentMeta, buffer: mmap.mmap, owner: int,
                 stamp: PublishStamp, leased: bool = True) -> None:
        self.name = name
        self.path = path
        self.owner = owner
        self.meta = meta
        self.stamp = stamp  # the file's inode and ctime when it was mapped
        self.leased = leased
        self._fd = fd
        self._map = buffer
        self.data = data_view(buffer, meta)
        self.data.flags.writeable = False
        self.values = values_view(buffer, meta)  # variable-length rows: their values (data: offsets)
        if self.values is not None:
            self.values.flags.writeable = False

    def fileno(self) -> int:
        """The segment's descriptor (the one its lease is held on), to map its rows elsewhere
        (segments/stitch.py); -1 once closed."""
        return self._fd

    def unmap(self) -> None:
        """Drop this object's own mapping (``data`` and ``values`` go with it), keeping the
        descriptor and its lease: its rows are mapped elsewhere (a stitch's slot)."""
        self.data = None  # type: ignore[assignment]
        self.values = None
        self._map = None  # type: ignore[assignment]

    def close(self) -> None:
        """Drop this object's references. Python's mmap holds its own dup of the fd, so the
        lease lasts exactly as long as the mapping: until the last array viewing it is gone."""
        self.data = None  # type: ignore[assignment]
        self.values = None
        self._map = None  # type: ignore[assignment]
        if self._fd >= 0:
            os.close(self._fd)  # releases the flock once no forked child shares the fd
            self._fd = -1

    def __del__(self) -> None:
        # freed unclosed (a dataset nobody closed, collected): its descriptor, and with it the
        # lease, goes too, or the daemon could not evict the segment until this process exits.
        # Never blocks; in a forked child this closes the child's copy only (the parent's lease stays)
        fd, self._fd = getattr(self, "_fd", -1), -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


def check_segment_name(name: str) -> None:
    """Raised when ``name`` cannot be a published segment's (a temporary, a path): SegmentError."""
    if not name or TMP_MARK in name or "/" in name or "\0" in name or name in (".", ".."):
        raise SegmentError(f"{name!r} is not a published segment name")


def _take_lease(fd: int, path: Path) -> bool:
    """``flock(LOCK_SH)``, tried for LEASE_WAIT_S: True when held. Eviction holds LOCK_EX for
    an instant; anything longer is another process holding it on purpose (any holder of a
    descriptor can), and a victim's attach must not wait for it."""
    global _unleased_logged
    deadline = time.monotonic() + LEASE_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                break
            time.sleep(_LEASE_RETRY_S)
    emit = log.debug if _unleased_logged else log.warning
    _unleased_logged = True
    emit("segment %s is locked exclusively by another process: mapped without a lease (the daemon may evict it "
         "meanwhile; the rows stay valid for this process)", path)
    return False


def attach_segment(shm_dir: str | os.PathLike[str], name: str, owner: int | None = None,
                   stamp: PublishStamp = UNKNOWN_STAMP) -> AttachedSegment:
    """Open (by name), lease and map a published segment read-only; validates owner, header,
    size and ``stamp``. ``owner`` is the daemon's uid (default: ours): a file of anyone else is
    never mapped.

    Raised when it is missing, evicted, truncated, incomplete, changed or not ours: SegmentError.
    """
    path = Path(shm_dir) / name
    check_segment_name(name)
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW_FLAGS)  # a FIFO planted at the name must not hang us
    except OSError as exc:
        why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise SegmentError(f"segment {path} cannot be opened: {why} (evicted or not loaded)") from exc
    return _attach_open(fd, path, owner, stamp)


def attach_descriptor(fd: int, shm_dir: str | os.PathLike[str], name: str, owner: int,
                      stamp: PublishStamp = UNKNOWN_STAMP) -> AttachedSegment:
    """Lease and map the segment ``name`` from ``fd``, a descriptor the daemon handed out;
    checked exactly as ``attach_segment`` checks a file it opened, and open read-only. Takes
    ``fd`` over (closed on failure).

    Raised as ``attach_segment``: SegmentError.
    """
    path = Path(shm_dir) / name
    try:
        check_segment_name(name)
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY:
            raise SegmentError(f"the descriptor handed out for segment {path} is not read-only: refusing to map it")
    except BaseException:
        os.close(fd)
        raise
    return _attach_open(fd, path, owner, stamp)


def _attach_open(fd: int, path: Path, owner: int | None, stamp: PublishStamp) -> AttachedSegment:
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
        leased = _take_lease(fd, path)
        st = os.fstat(fd)
        if st.st_nlink == 0:
            raise SegmentError(f"segment {path} was evicted while attaching; request it again")
        if not stamp.matches(st):
            raise SegmentError(f"segment {path} changed since the daemon published it (inode or ctime differ: "
                               "made writable, or replaced); request it again")
        meta, complete = parse_header(read_header(fd), str(path))
        if not complete:
            raise SegmentError(f"segment {path} is not complete: refusing to map a partial load")
        if st.st_size != meta.file_size:
            raise SegmentError(
                f"segment {path} is {st.st_size} bytes but its header describes {meta.file_size}: refusing to map it"
            )
        if st.st_mode & 0o222:
            raise SegmentError(f"segment {path} is writable (mode {st.st_mode & 0o777:o}): refusing to map it")
        buffer = mmap.mmap(fd, meta.file_size, mmap.MAP_SHARED, mmap.PROT_READ)
        return AttachedSegment(path.name, path, fd, meta, buffer, st.st_uid, PublishStamp.of(st), leased)
    except BaseException:
        os.close(fd)
        raise
