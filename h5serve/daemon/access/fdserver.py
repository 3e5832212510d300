"""Handing segment descriptors to the daemon's other users (the client end and the wire are in
segments/handout.py).

Segments are owner-only, so a ``--group`` member cannot open one by name: it asks here, on
``<runtime dir>/h5serve.fds`` (SOCK_SEQPACKET, the ZeroMQ socket's mode and group: a
non-member cannot reach it). The daemon reads the peer's uid from the kernel
(``SO_PEERCRED``) and hands out a fresh ``O_RDONLY | O_NOFOLLOW | O_NONBLOCK`` descriptor of
the published file (``SCM_RIGHTS``) only if that uid was granted the segment: an acquire from
it passed the access check and was answered ``ready`` for that name. What is opened is
checked by ``fstat`` first (``lifecycle.open_published``: a regular file of ours, mode 0400,
one link, the size and the inode and ctime recorded at publish). Everything else gets a
refusal saying why, logged with the peer's uid.

It runs in a thread of its own (one ``selectors`` loop, non-blocking sockets), never on the
control loop, and serves every uid fairly however one of them floods it. A client sends its
request right after it connects, so a request already there when the connection is accepted
is answered at once and holds nothing. A connection still silent waits in the WaitingRoom:
at most MAX_CONNECTIONS_PER_UID of one uid (its oldest is closed for a newer one) and
MAX_CONNECTIONS in all (then the oldest of the uid holding the most is closed), each closed
REQUEST_TIMEOUT_S after it came if it sent nothing. A member holding hundreds of idle
connections only ever displaces its own. The daemon's own user and root open segments by
name and never need to wait here: they get one uid's share like anyone. At most
ACCEPTS_PER_TICK connections are accepted between two looks at those waiting, and when
``accept`` fails (EMFILE, ENFILE, ENOBUFS, ENOMEM: out of descriptors or memory) the listener
rests ACCEPT_PAUSE_S while the waiting are still answered: a flood makes the thread neither
spin nor die. Connections closed unanswered and failed accepts are logged as a tally, at most
every REPORT_EVERY_S. The grants it reads are an immutable mapping the control loop replaces
(``SegmentStore.grants``), never one it mutates.
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Generic, TypeVar

from ...errors import SegmentError
from ...segments import PublishStamp, open_published
from ...segments.handout import MAX_NAME_BYTES, REPLY_NO, REPLY_OK, peer_uid
from ...wire.runtime import HANDOUT_SOCKET_NAME, RuntimeLocation
from ..store.entries import Entry

__all__ = ["Grant", "HandoutServer", "WaitingRoom", "MAX_CONNECTIONS", "MAX_CONNECTIONS_PER_UID",
           "REQUEST_TIMEOUT_S", "ACCEPTS_PER_TICK", "ACCEPT_PAUSE_S", "REPORT_EVERY_S", "grant", "grants_of"]

log = logging.getLogger("h5serve.daemon")

MAX_CONNECTIONS = 256  # connections waiting for their request, all uids together (one descriptor each)
MAX_CONNECTIONS_PER_UID = 16  # of one uid: a newer one closes its oldest
REQUEST_TIMEOUT_S = 0.5  # a connection that sent no request by then is closed (clients send at once)
ACCEPTS_PER_TICK = 64  # accepted between two looks at the waiting connections
ACCEPT_PAUSE_S = 0.2  # the listener rests this long after accept failed (out of descriptors, memory)
REPORT_EVERY_S = 10.0  # connections closed unanswered and failed accepts: one log line this often
_TICK_S = 0.25  # the loop's longest sleep: noticing stop()
_ACCEPT_SKIP = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EINTR})  # that peer is gone: accept the next

Conn = TypeVar("Conn", bound=Hashable)


@dataclass(frozen=True)
class Grant:
    """Who may have a ready segment's descriptor, and what the published file must be."""

    uids: frozenset[int]
    size: int
    stamp: PublishStamp


def grant(entry: Entry, uid: int, current: Mapping[str, Grant]) -> bool:
    """Grant ``entry`` to ``uid`` (the daemon's own user and root need no grant); True when
    ``current`` (the grants in force) must be rebuilt for it."""
    if uid in (os.geteuid(), 0):
        return False
    entry.granted.add(uid)
    granted = current.get(entry.file)
    return bool(entry.stamp.ino) and (granted is None or uid not in granted.uids or granted.stamp != entry.stamp)


def grants_of(entries: Iterable[Entry]) -> Mapping[str, Grant]:
    """The grants of the published segments among ``entries``, as one immutable mapping keyed
    by the file each was published under (what clients ask for)."""
    return MappingProxyType({e.file: Grant(frozenset(e.granted), e.meta.file_size, e.stamp)
                             for e in entries if e.state != "loading" and e.granted and e.stamp.ino})


class WaitingRoom(Generic[Conn]):
    """Connections that have not sent their request yet, by their peer's uid, in the order they
    came: at most ``per_uid`` of one uid and ``total`` in all, each until ``timeout`` seconds
    after it came (``now`` is ``time.monotonic()``, never going back).

    Room for a newcomer is made by closing the oldest connection of its own uid when that uid
    has ``per_uid``, else, when all ``total`` places are taken, the oldest of the uid holding
    the most (the newcomer's own when it holds as many): one uid's connections only ever
    displace its own, and each of ``n`` uids keeps ``min(per_uid, total // n)`` places.
    """

    def __init__(self, per_uid: int, total: int, timeout: float) -> None:
        """Raised when the limits make no sense (``0 < per_uid <= total``, ``timeout > 0``): ValueError."""
        if not 0 < per_uid <= total or timeout <= 0:
            raise ValueError(f"a waiting room for {per_uid} per uid, {total} in all, {timeout} s each")
        self.per_uid = per_uid
        self.total = total
        self.timeout = timeout
        self._by_uid: dict[int, dict[Conn, float]] = {}  # uid -> {connection: deadline}, oldest first
        self._uid_of: dict[Conn, int] = {}

    def __len__(self) -> int:
        return len(self._uid_of)

    def __contains__(self, conn: object) -> bool:
        return conn in self._uid_of

    def held_by(self, uid: int) -> int:
        """How many connections of ``uid`` wait."""
        return len(self._by_uid.get(uid, ()))

    def connections(self) -> list[Conn]:
        return list(self._uid_of)

    def crowding(self, uid: int) -> Conn | None:
        """The connection to close before one more of ``uid`` may wait; None when there is room."""
        mine = self._by_uid.get(uid)
        if mine is not None and len(mine) >= self.per_uid:
            return next(iter(mine))
        if len(self._uid_of) < self.total:
            return None
        fullest = max(self._by_uid, key=lambda u: (len(self._by_uid[u]), u == uid))
        return next(iter(self._by_uid[fullest]))

    def admit(self, conn: Conn, uid: int, now: float) -> None:
        """Let ``conn``, of ``uid``, wait until ``now + timeout``.

        Raised when there is no room for it (close ``crowding(uid)`` first), or it waits already:
        ValueError.
        """
        if conn in self._uid_of or self.crowding(uid) is not None:
            raise ValueError(f"no room for another connection of uid {uid}, or it waits already")
        self._by_uid.setdefault(uid, {})[conn] = now + self.timeout
        self._uid_of[conn] = uid

    def remove(self, conn: Conn) -> int | None:
        """Stop holding ``conn``; the uid it waited for, None if it was not waiting."""
        uid = self._uid_of.pop(conn, None)
        if uid is not None:
            mine = self._by_uid[uid]
            del mine[conn]
            if not mine:
                del self._by_uid[uid]
        return uid

    def expired(self, now: float) -> list[Conn]:
        """The connections whose time is up at ``now`` (still held: ``remove`` them)."""
        out: list[Conn] = []
        for mine in self._by_uid.values():
            for conn, deadline in mine.items():  # oldest first: deadlines ascending
                if deadline > now:
                    break
                out.append(conn)
        return out

    def next_deadline(self) -> float | None:
        """When the next connection's time is up; None when nothing waits."""
        return min((next(iter(mine.values())) for mine in self._by_uid.values()), default=None)


class HandoutServer:
    """The descriptor socket of one daemon, served from a thread; ``stop`` removes it."""

    def __init__(self, location: RuntimeLocation, dir_fd: int, shm_dir: Path, group: int | None,
                 grants: Callable[[], Mapping[str, Grant]]) -> None:
        self.location = location
        self._dir_fd = dir_fd
        self._grants = grants
        self._shm_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._selector = selectors.DefaultSelector()
        self._room: WaitingRoom[socket.socket] = WaitingRoom(MAX_CONNECTIONS_PER_UID, MAX_CONNECTIONS,
                                                             REQUEST_TIMEOUT_S)
        self._listen_again_at: float | None = None  # set while accept rests after a failure
        self._unanswered: dict[int, int] = {}  # uid -> connections closed unanswered, since the last report
        self._accept_failures: dict[str, int] = {}  # why -> how often, since the last report
        self._reported_at = float("-inf")
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._listener = self._listen(group)
        self._thread = threading.Thread(target=self._run, name="h5serve-handout", daemon=True)

    def _listen(self, group: int | None) -> socket.socket:
        """Bind ``h5serve.fds`` in the runtime dir (ours, checked, its lock held: a stale socket
        there is removed) with the ZeroMQ socket's access: 0600, or 0660 for ``group``."""
        try:
            os.unlink(HANDOUT_SOCKET_NAME, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        old_umask = os.umask(0o177)
        try:
            sock.bind(str(self.location.handout_path))
        except BaseException:
            sock.close()
            raise
        finally:
            os.umask(old_umask)
        if group is not None:
            os.chown(HANDOUT_SOCKET_NAME, -1, group, dir_fd=self._dir_fd, follow_symlinks=False)
            os.chmod(HANDOUT_SOCKET_NAME, 0o660, dir_fd=self._dir_fd)
        sock.listen(MAX_CONNECTIONS)
        return sock

    def start(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, close every connection and remove the socket's name."""
        self._stopping.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for conn in self._room.connections():
            self._room.remove(conn)
            self._close(conn)
        self._selector.close()
        self._listener.close()
        for fd in (self._wake_r, self._wake_w, self._shm_fd):
            os.close(fd)
        try:
            os.unlink(HANDOUT_SOCKET_NAME, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove %s: %s", self.location.handout_path, exc.strerror)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._tick()
            except Exception:  # never let the thread die: clients would fall back for good
                log.exception("descriptor hand-out failed; going on")
                time.sleep(_TICK_S)

    def _tick(self) -> None:
        now = time.monotonic()
        if self._listen_again_at is not None and now >= self._listen_again_at:
            self._selector.register(self._listener, selectors.EVENT_READ)
            self._listen_again_at = None
        for key, _ in self._selector.select(self._sleep(now)):
            if key.fileobj is self._listener:
                self._accept()
            elif key.fileobj == self._wake_r:
                return
            else:
                assert isinstance(key.fileobj, socket.socket)
                self._read(key.fileobj)
        now = time.monotonic()
        for conn in self._room.expired(now):
            self._close_unanswered(conn)
        self._report(now)

    def _sleep(self, now: float) -> float:
        """How long select may wait: until the next deadline, the listener's rest, or a tick."""
        wake = [t for t in (self._room.next_deadline(), self._listen_again_at) if t is not None]
        return max(0.0, min([now + _TICK_S, *wake]) - now)

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_TICK):
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _ACCEPT_SKIP:
                    continue
                # out of descriptors or memory (or worse): the backlog waits in the kernel while
                # the listener rests; those already accepted are answered meanwhile
                self._selector.unregister(self._listener)
                self._listen_again_at = time.monotonic() + ACCEPT_PAUSE_S
                why = exc.strerror or str(exc)
                self._accept_failures[why] = self._accept_failures.get(why, 0) + 1
                return
            self._welcome(conn)

    def _welcome(self, conn: socket.socket) -> None:
        """Answer a new connection's request if it is there already, else let it wait its turn."""
        try:
            conn.setblocking(False)
            uid = peer_uid(conn)
            request = conn.recv(MAX_NAME_BYTES + 1)
        except BlockingIOError:
            pass
        except OSError:  # gone already
            conn.close()
            return
        else:
            if request:
                self._answer(conn, uid, request)
            else:
                conn.close()
            return
        crowded = self._room.crowding(uid)
        if crowded is not None:
            self._close_unanswered(crowded)
        try:
            self._selector.register(conn, selectors.EVENT_READ)
        except OSError:  # epoll out of room: as if it had not been accepted
            conn.close()
            self._unanswered[uid] = self._unanswered.get(uid, 0) + 1
            return
        self._room.admit(conn, uid, time.monotonic())

    def _read(self, conn: socket.socket) -> None:
        if conn not in self._room:  # closed earlier in this tick to make room
            return
        try:
            request = conn.recv(MAX_NAME_BYTES + 1)
        except BlockingIOError:  # woken for nothing: it waits on
            return
        except OSError:
            request = b""
        uid = self._room.remove(conn)
        if request and uid is not None:
            self._answer(conn, uid, request)
        else:  # gone without asking
            self._close(conn)

    def _close_unanswered(self, conn: socket.socket) -> None:
        uid = self._room.remove(conn)
        if uid is not None:
            self._unanswered[uid] = self._unanswered.get(uid, 0) + 1
        self._close(conn)

    def _close(self, conn: socket.socket) -> None:
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _report(self, now: float) -> None:
        """Log what was closed unanswered and why accept failed, as a tally, at most every
        REPORT_EVERY_S: a flood never floods the log."""
        if not (self._unanswered or self._accept_failures) or now - self._reported_at < REPORT_EVERY_S:
            return
        self._reported_at = now
        if self._unanswered:
            by_uid = sorted(self._unanswered.items(), key=lambda item: -item[1])
            log.warning("closed %d connection(s) to %s that sent no segment name within %.1f s, or had %d more of "
                        "their uid waiting (by uid: %s)", sum(self._unanswered.values()), HANDOUT_SOCKET_NAME,
                        REQUEST_TIMEOUT_S, MAX_CONNECTIONS_PER_UID,
                        ", ".join(f"{uid}: {count}" for uid, count in by_uid[:8]))
            self._unanswered = {}
        if self._accept_failures:
            log.warning("could not accept connections to %s (%s); rested %.1f s each time, answering those "
                        "accepted", HANDOUT_SOCKET_NAME,
                        ", ".join(f"{why}: {count}x" for why, count in self._accept_failures.items()), ACCEPT_PAUSE_S)
            self._accept_failures = {}

    def _answer(self, conn: socket.socket, uid: int, request: bytes) -> None:
        try:
            fd, refusal = self._open_for(uid, request)
            try:
                if fd is not None:
                    socket.send_fds(conn, [REPLY_OK], [fd])
                else:
                    conn.send(REPLY_NO + refusal.encode())
            finally:
                if fd is not None:
                    os.close(fd)
        except OSError:  # gone, or not reading its reply: nothing to answer
            pass
        finally:
            self._close(conn)

    def _open_for(self, uid: int, request: bytes) -> tuple[int | None, str]:
        """A checked descriptor of the segment ``request`` names, if ``uid`` may have it; else
        (None, why not)."""
        try:
            name = request.decode("utf-8")
        except UnicodeDecodeError:
            name = ""
        grant = self._grants().get(name) if name and len(request) <= MAX_NAME_BYTES else None
        privileged = uid in (os.geteuid(), 0)
        if grant is None or not (privileged or uid in grant.uids):
            log.info("refused the descriptor of segment %r to uid %d: %s", name[:MAX_NAME_BYTES], uid,
                     "not granted to it" if grant is not None else "no such ready segment granted")
            return None, (f"uid {uid} was not granted it (ask for it with acquire first; a file you may not read "
                          "is never granted)")
        try:
            fd, _ = open_published(name, grant.size, grant.stamp, dir_fd=self._shm_fd)
        except SegmentError as exc:
            log.warning("refused the descriptor of segment %s to uid %d: %s", name, uid, exc)
            return None, f"it is no longer as published ({exc}); ask for it again"
        return fd, ""
