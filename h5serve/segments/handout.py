"""Segments for the daemon's other users: asking the daemon for a segment's descriptor.

Segments are owner-only (0400). A client of the daemon's own uid, or root, opens them by name
(``attach_segment``: the fast path). Any other client (a ``--group`` member of a
service-account or root daemon) asks the daemon over a second unix socket in the runtime dir
(``h5serve.fds``, SOCK_SEQPACKET, as reachable as the ZeroMQ socket): it sends the segment's
name; the daemon checks the peer's uid (``SO_PEERCRED``) against the uids it granted that
segment (an acquire from that uid passed the access check for it) and answers with a
read-only descriptor of the published file (``SCM_RIGHTS``), or a refusal. The descriptor is
then checked as an opened one is (``attach_descriptor``) before it is mapped.

Wire (one datagram each way): request ``name`` (UTF-8, at most MAX_NAME_BYTES); reply
``OK`` with one descriptor, or ``NO`` followed by the reason (UTF-8).
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from pathlib import Path

from ..errors import AccessDenied, SegmentError
from ..wire.runtime import HANDOUT_SOCKET_NAME
from .attach import UNKNOWN_STAMP, AttachedSegment, PublishStamp, attach_descriptor, attach_segment

__all__ = ["MAX_NAME_BYTES", "MAX_REPLY_BYTES", "REPLY_OK", "REPLY_NO", "HANDOUT_TIMEOUT_S", "peer_uid",
           "request_descriptor", "open_segment", "opens_by_name"]

MAX_NAME_BYTES = 255
MAX_REPLY_BYTES = 1024
REPLY_OK = b"OK"
REPLY_NO = b"NO"
HANDOUT_TIMEOUT_S = 5.0  # the whole exchange; the daemon answers from a thread of its own at once
_UCRED = struct.Struct("3i")  # pid, uid, gid
_TIMEVAL = struct.Struct("@ll")  # struct timeval: seconds, microseconds


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected unix socket (``SO_PEERCRED``)."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))[1]


def _set_deadline(sock: socket.socket, seconds: float) -> None:
    """Bound each blocking call on ``sock`` (connect and send: SO_SNDTIMEO, receive:
    SO_RCVTIMEO) to ``seconds``; past it the call fails with EAGAIN."""
    sock.settimeout(None)  # blocking whatever socket.setdefaulttimeout says
    whole = int(seconds)
    micros = max(int((seconds - whole) * 1_000_000), 0 if whole > 0 else 1)  # all zero would mean no deadline
    timeval = _TIMEVAL.pack(whole, micros)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)


def opens_by_name(owner: int) -> bool:
    """Whether this process opens the daemon's segments itself (it is the daemon's user, or
    root) rather than asking for their descriptors."""
    return os.getuid() in (owner, 0)


def request_descriptor(socket_path: str | os.PathLike[str], name: str, owner: int,
                       timeout: float = HANDOUT_TIMEOUT_S) -> int:
    """A descriptor of the published segment ``name`` from the daemon listening at
    ``socket_path``, which must run as ``owner`` (checked: ``SO_PEERCRED``).

    Raised when the daemon refuses (this uid was not granted that segment): AccessDenied.
    Raised when it cannot be asked, or answers something else: SegmentError.
    """
    raw = name.encode()
    if not raw or len(raw) > MAX_NAME_BYTES:
        raise SegmentError(f"{name!r} is not a segment name")
    where = f"the daemon's descriptor socket {socket_path}"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
            # blocking, with the kernel's deadlines, not settimeout: that makes the socket
            # non-blocking, and a non-blocking connect fails at once (EAGAIN) while the listener's
            # backlog is full, as a flood keeps it; a blocking one waits its turn in the kernel
            _set_deadline(sock, timeout)
            sock.connect(os.fspath(socket_path))
            if peer_uid(sock) != owner:
                raise SegmentError(f"{where} is served by uid {peer_uid(sock)}, not the daemon's uid {owner}")
            sock.sendall(raw)
            message, fds, flags, _ = socket.recv_fds(sock, MAX_REPLY_BYTES, 1, socket.MSG_CMSG_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.EMFILE or exc.errno == errno.ENFILE:
            raise SegmentError(f"no descriptor left to receive segment {name} from {where}") from exc
        why = f"no answer within {timeout:g} s" if exc.errno == errno.EAGAIN else exc.strerror or str(exc)
        raise SegmentError(f"cannot ask {where} for segment {name}: {why}") from exc
    if message == REPLY_OK and len(fds) == 1 and not flags & socket.MSG_CTRUNC:
        return fds[0]
    for fd in fds:
        os.close(fd)
    if message.startswith(REPLY_NO):
        reason = message[len(REPLY_NO):].decode("utf-8", "replace")
        raise AccessDenied(f"the daemon refused segment {name}: {reason}; reading this shard lazily, with your "
                           "own rights")
    raise SegmentError(f"{where} answered {message[:40]!r} for segment {name}, with {len(fds)} descriptor(s)")


def open_segment(runtime_dir: str | os.PathLike[str], shm_dir: str | os.PathLike[str], name: str, owner: int,
                 stamp: PublishStamp = UNKNOWN_STAMP) -> AttachedSegment:
    """Map the daemon's segment ``name``: opened by name when this process may (the daemon's
    user, root), else from the descriptor the daemon hands out (a daemon that listens on no
    descriptor socket, an older one: by name). ``owner`` is the daemon's uid, as the runtime
    dir proves it; ``stamp`` the file's identity from the acquire reply.

    Raised when the daemon refuses it: AccessDenied. Raised when it cannot be mapped (missing,
    evicted, changed, not the daemon's): SegmentError.
    """
    if opens_by_name(owner):
        return attach_segment(shm_dir, name, owner, stamp)
    socket_path = Path(runtime_dir) / HANDOUT_SOCKET_NAME
    if not os.path.exists(socket_path):
        return attach_segment(shm_dir, name, owner, stamp)
    return attach_descriptor(request_descriptor(socket_path, name, owner), shm_dir, name, owner, stamp)

