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
control loop: at most MAX_CONNECTIONS peers at once (more are closed as they arrive), each
dropped CONNECTION_TIMEOUT_S after it connected. The grants it reads are an immutable mapping
the control loop replaces (``SegmentStore.grants``), never one it mutates.
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from ..errors import SegmentError
from ..segments import PublishStamp, open_published
from ..segments.handout import MAX_NAME_BYTES, REPLY_NO, REPLY_OK, peer_uid
from ..wire.runtime import HANDOUT_SOCKET_NAME, RuntimeLocation
from .entries import Entry

__all__ = ["Grant", "HandoutServer", "MAX_CONNECTIONS", "CONNECTION_TIMEOUT_S", "grant", "grants_of"]

log = logging.getLogger("h5serve.daemon")

MAX_CONNECTIONS = 64
CONNECTION_TIMEOUT_S = 1.0
_TICK_S = 0.25  # the loop's longest sleep: expiring connections, noticing stop()


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


class HandoutServer:
    """The descriptor socket of one daemon, served from a thread; ``stop`` removes it."""

    def __init__(self, location: RuntimeLocation, dir_fd: int, shm_dir: Path, group: int | None,
                 grants: Callable[[], Mapping[str, Grant]]) -> None:
        self.location = location
        self._dir_fd = dir_fd
        self._grants = grants
        self._shm_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._selector = selectors.DefaultSelector()
        self._deadlines: dict[socket.socket, float] = {}
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
        for conn in list(self._deadlines):
            self._drop(conn)
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
        for key, _ in self._selector.select(_TICK_S):
            if key.fileobj is self._listener:
                self._accept()
            elif key.fileobj == self._wake_r:
                return
            else:
                assert isinstance(key.fileobj, socket.socket)
                self._answer(key.fileobj)
        now = time.monotonic()
        for conn, deadline in list(self._deadlines.items()):
            if now >= deadline:
                self._drop(conn)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # out of descriptors: the backlog waits; try again next tick
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("cannot accept a descriptor request: %s", exc.strerror)
                    time.sleep(0.05)
                    return
                raise
            if len(self._deadlines) >= MAX_CONNECTIONS:
                conn.close()
                continue
            conn.setblocking(False)
            self._deadlines[conn] = time.monotonic() + CONNECTION_TIMEOUT_S
            self._selector.register(conn, selectors.EVENT_READ)

    def _drop(self, conn: socket.socket) -> None:
        self._deadlines.pop(conn, None)
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _answer(self, conn: socket.socket) -> None:
        try:
            request = conn.recv(MAX_NAME_BYTES + 1)
            uid = peer_uid(conn)
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
            self._drop(conn)

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
