"""Waking a client the moment a segment is published, instead of at its next poll.

A client polls the daemon while a load runs, a tenth of the time waited so far between polls
(connection.py): cheap for the daemon, but a load that finishes just after a poll waited up to
that whole pause (~10-25 ms of a 0.2-0.3 s load). A segment is published by a rename into the
shm dir (segments/lifecycle.py), so the client watches the dir with inotify for that name while it
sleeps between polls, and asks again at once when it lands. The daemon stays the authority:
the name arriving only shortens the sleep; the client still attaches only once the daemon
says ``ready``.

Best effort: where inotify is missing or refused (no libc symbol, the per-user instance
limit), ``wait`` sleeps the whole pause, as before.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import struct
import threading
import time
from pathlib import Path

__all__ = ["PublishWatch"]

_IN_MOVED_TO = 0x00000080  # <sys/inotify.h>: a file was renamed into the watched directory
_IN_Q_OVERFLOW = 0x00004000  # events were lost: look at the directory itself
_IN_ONLYDIR = 0x01000000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)
_READ_BYTES = 64 * 1024


def _inotify_fd(directory: Path) -> int:
    """An inotify descriptor watching renames into ``directory``; -1 where none can be had."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        init, add = libc.inotify_init1, libc.inotify_add_watch
    except (OSError, AttributeError):
        return -1
    fd = init(_IN_NONBLOCK | _IN_CLOEXEC)
    if fd < 0:
        return -1
    if add(fd, os.fsencode(directory), _IN_MOVED_TO | _IN_ONLYDIR) < 0:
        os.close(fd)
        return -1
    return int(fd)


class PublishWatch:
    """Watches ``directory`` for ``name`` to be renamed into it. ``close()`` when done."""

    def __init__(self, directory: str | os.PathLike[str], name: str) -> None:
        self.directory = Path(directory)
        self.name = os.fsencode(name)
        self._fd = _inotify_fd(self.directory)
        # published before the watch was set up: seen now, or never
        self.arrived = os.path.lexists(self.directory / name)

    @property
    def watching(self) -> bool:
        """Whether inotify watches the directory (else ``wait`` sleeps its whole timeout)."""
        return self._fd >= 0

    def wait(self, timeout: float) -> bool:
        """Sleep until the name arrives or ``timeout`` seconds pass; True once it has arrived."""
        deadline = time.monotonic() + timeout
        while not self.arrived:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if self._fd < 0:
                time.sleep(remaining)
                break
            poller = select.poll()  # not select(): a training process may hold descriptors past 1024
            poller.register(self._fd, select.POLLIN)
            try:
                if not poller.poll(remaining * 1000):
                    break
            except InterruptedError:
                continue
            self._read_events()
        return self.arrived

    def _read_events(self) -> None:
        try:
            data = os.read(self._fd, _READ_BYTES)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EINTR):
                self._close_fd()  # a broken watch: plain sleeps from now on
            return
        offset = 0
        while offset + _EVENT.size <= len(data):
            _, mask, _, length = _EVENT.unpack_from(data, offset)
            start = offset + _EVENT.size
            if data[start:start + length].rstrip(b"\0") == self.name:
                self.arrived = True
            elif mask & _IN_Q_OVERFLOW:
                self.arrived = self.arrived or os.path.lexists(self.directory / os.fsdecode(self.name))
            offset = start + length

    def _close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        """Let the descriptor go without waiting: closing an inotify descriptor waits for an
        RCU grace period in the kernel (~10-20 ms measured), so a thread closes it."""
        if self._fd >= 0:
            threading.Thread(target=os.close, args=(self._fd,), name="h5serve-unwatch", daemon=True).start()
            self._fd = -1

    def __enter__(self) -> PublishWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
