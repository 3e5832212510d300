"""Who is asking, and may they read the file themselves? (the confused-deputy check)

A daemon running as root or as a service account (``--group``) can read files its clients
cannot. It must never load or hand out rows of a file the requesting process could not read
itself. The requester is known from the kernel, not from anything it sends: libzmq records
``SO_PEERCRED`` of every ipc connection and exposes it as the ``Peer-Address`` property of
each message (``...:uid:gid:pid``).

The check runs in a resolver thread, never on the control loop:

- A root daemon asks the kernel: a forked child takes the peer's uid, gid and supplementary
  groups (read from ``/proc/<pid>/status`` of the peer) and opens the file ``O_NONBLOCK``;
  the file it opened must be the one the daemon opened (same device and inode). This honours
  ACLs, LSMs and everything else the kernel checks.
- A daemon of another user cannot take the peer's identity, so it checks mode bits along the
  file's real path (search on every directory, read on the file). POSIX ACLs it cannot
  evaluate for another user, so a file or directory carrying one is refused (the client then
  reads lazily, with its own rights).
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass

from ...errors import AccessDenied
from ...hdf5.identity import FileIdentity
from ...util.lru import LRU

__all__ = ["Peer", "check_peer_can_read", "requester"]

_CHECK_TIMEOUT_S = 10.0  # a forked check stuck on a hung file system is killed after this
_CACHE_TTL_S = 60.0
_CACHE_MAX = 4096
_ACL_XATTR = "system.posix_acl_access"


@dataclass(frozen=True)
class Peer:
    """The process at the other end of a connection, as the kernel reported it."""

    uid: int
    gid: int
    pid: int

    @classmethod
    def from_address(cls, address: str | None) -> Peer | None:
        """From libzmq's ``Peer-Address`` of an ipc connection (``...:uid:gid:pid``); None when
        the transport did not report credentials."""
        if not address:
            return None
        parts = address.rsplit(":", 3)
        if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
            return None
        return cls(int(parts[1]), int(parts[2]), int(parts[3]))

    def groups(self) -> tuple[int, ...] | None:
        """The peer process's supplementary groups, from /proc; None when the process is gone
        or is no longer the peer (its real uid differs)."""
        uid, groups = None, None
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        uid = int(line.split()[1])
                    elif line.startswith("Groups:"):
                        groups = tuple(int(g) for g in line.split()[1:])
        except (OSError, ValueError):
            return None
        return groups if uid == self.uid and groups is not None else None


def requester(peer: Peer | None, group: int | None) -> Peer:
    """Who a request comes from, for the checks: ``peer`` as the kernel reported it. When the
    transport reported nobody (no ``SO_PEERCRED``), the request is treated as the daemon's own
    user only where no one else can reach the socket (no ``--group``, not root); elsewhere it
    is refused, never served unchecked.

    Raised when the sender is unknown on a daemon others can reach: AccessDenied.
    """
    if peer is not None:
        return peer
    if group is not None or os.geteuid() == 0:
        raise AccessDenied(
            "the daemon cannot tell who sent this request (the transport reported no credentials), and other "
            "users can reach its socket, so it serves nothing unchecked; connect over the daemon's ipc socket")
    return Peer(os.geteuid(), os.getegid(), os.getpid())


# (uid, gid, groups, file identity: ctime included, so a chmod since is seen at once) -> until when
# that user may read that file, unasked
_readable: LRU[tuple[int, int, tuple[int, ...], FileIdentity], float] = LRU(_CACHE_MAX)


def check_peer_can_read(peer: Peer, ident: FileIdentity) -> None:
    """Raised when ``peer`` could not open ``ident`` (a file the daemon opened) for reading
    itself: AccessDenied. The daemon's own user and root are never refused."""
    if peer.uid in (os.geteuid(), 0):
        return
    groups = peer.groups()
    if groups is None:
        raise AccessDenied(f"the requesting process (pid {peer.pid}) is gone; ask again")
    key = (peer.uid, peer.gid, groups, ident)
    now = time.monotonic()
    if (_readable.get(key) or 0.0) > now:
        return
    if os.geteuid() == 0:
        why = _kernel_refuses(peer, groups, ident)
    else:
        why = _modes_refuse(peer.uid, {peer.gid, *groups}, ident.path)
    if why:
        raise AccessDenied(
            f"uid {peer.uid} may not read {ident.path} itself ({why}); the daemon serves only files the "
            "requesting user can read: fix the file's permissions, or read it as a user who may"
        )
    _readable.put(key, now + _CACHE_TTL_S)


def _kernel_refuses(peer: Peer, groups: tuple[int, ...], ident: FileIdentity) -> str:
    """Why the kernel would not let the peer open the file ("" when it would)."""
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then _exit
        code = 1
        try:
            # it runs as the peer: it keeps none of the daemon's descriptors (log, sockets, key),
            # and the uid change leaves it undumpable; its one answer is its exit code
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))
            os.setgroups(list(groups))
            os.setresgid(peer.gid, peer.gid, peer.gid)
            os.setresuid(peer.uid, peer.uid, peer.uid)
            fd = os.open(ident.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            st = os.fstat(fd)
            code = 0 if (st.st_dev, st.st_ino) == (ident.dev, ident.ino) else 3
        except PermissionError:
            code = 2
        except BaseException:  # noqa: BLE001 - any failure is a refusal
            code = 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + _CHECK_TIMEOUT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return "checking took too long"
        time.sleep(0.001)
    code = os.waitstatus_to_exitcode(status)
    return {0: "", 2: "permission denied", 3: "the path leads the user to another file"}.get(
        code, "the user cannot open it")


def _allows(st: os.stat_result, uid: int, gids: set[int], bit: int) -> bool:
    if st.st_uid == uid:
        return bool(st.st_mode >> 6 & bit)
    if st.st_gid in gids:
        return bool(st.st_mode >> 3 & bit)
    return bool(st.st_mode & bit)


def _has_acl(path: str) -> bool:
    try:
        return _ACL_XATTR in os.listxattr(path, follow_symlinks=False)
    except OSError:
        return False


def _modes_refuse(uid: int, gids: set[int], real: str) -> str:
    """Why mode bits deny ``uid`` reading ``real`` (a path without symlinks), "" if they allow it."""
    parts = real.split("/")
    for i in range(1, len(parts)):
        directory = "/".join(parts[:i]) or "/"
        try:
            st = os.stat(directory)
        except OSError as exc:
            return f"{directory}: {exc.strerror}"
        if _has_acl(directory):
            return f"{directory} has POSIX ACLs, which only a root daemon can check for another user"
        if stat.S_ISDIR(st.st_mode) and not _allows(st, uid, gids, 1):
            return f"no search permission on {directory}"
    try:
        st = os.stat(real)
    except OSError as exc:
        return exc.strerror or "cannot stat it"
    if _has_acl(real):
        return "the file has POSIX ACLs, which only a root daemon can check for another user"
    return "" if _allows(st, uid, gids, 4) else "no read permission"
