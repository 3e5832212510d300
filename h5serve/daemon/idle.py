"""``--idle-exit SECONDS``: when the daemon has gone unused long enough to stop on its own.

Activity is what shows that someone uses the daemon, or is about to:

- a request: ``acquire`` (a client opening a dataset, polling a load, a preload, stream mode's
  blocks) or ``ping`` (stream and automatic mode sizing their window, ``h5serve start`` finding
  the daemon already running, as a SLURM prolog reusing a kept daemon does). Not ``status``:
  that is how an admin, a monitoring script or a container's healthcheck looks at a daemon, and
  a probe every minute would keep it alive for ever. ``shutdown`` stops it anyway;
- a load running or waiting for a loader, or a request whose file is still being resolved (its
  load starts then);
- a lease held on one of its segments: a process that mapped one (and its forked DataLoader
  workers) holds a shared ``flock`` on it for as long as it does;
- a hold: an entry in ``--hold-dir`` (a SLURM prolog puts one there for each job of the
  daemon's user running on the node, in a directory of root's, and the epilog removes it), so a
  job that has not used its kept daemon yet does not lose it.

A connection alone is not activity: every client that needs the daemon sends requests or holds
a lease, and a ``status`` probe is a connection too.

The control loop calls ``touch`` for each request (one store of a float) and ``expired`` every
tick; the rest is looked at once every IDLE_CHECK_INTERVAL_S (the store's entries, and
/proc/locks read once, never a ``stat`` of every segment), and what was seen in use counts as in
use until a look finds it gone. So the daemon exits between SECONDS and SECONDS +
IDLE_CHECK_INTERVAL_S (plus a tick of the loop) after the last activity.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from ..segments import any_leased
from .config import IDLE_CHECK_INTERVAL_S
from .store.store import SegmentStore

__all__ = ["IdleWatch", "holds", "in_use", "leases_held"]


class IdleWatch:
    """How long the daemon has gone unused, for an exit after ``seconds`` (> 0)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self._clock = clock
        self.last_activity = clock()  # the start counts: a daemon nobody ever uses exits too
        self._next_look = 0.0
        self._due = False  # the last look found it unused for ``seconds``: only an activity since cancels that
        self._used = False  # the last look found a load or a lease

    def touch(self) -> None:
        """A request that counts as activity arrived now."""
        self.last_activity = max(self.last_activity, self._clock())

    def idle_for(self) -> float:
        """Seconds since the last activity seen (0 while something is in use)."""
        return max(0.0, self._clock() - self.last_activity)

    def status(self, hold_dir: Path | None) -> dict[str, float | int]:
        """``idle_exit`` in the daemon's status: after how long, unused for how long, holds."""
        return {"after_s": self.seconds, "idle_s": round(self.idle_for(), 3), "holds": holds(hold_dir)}

    def expired(self, used: Callable[[], bool]) -> bool:
        """Whether ``seconds`` have passed since the last activity. ``used()`` (loads, leases:
        what requests do not show) is asked once every IDLE_CHECK_INTERVAL_S and at the deadline; what it
        saw counts as in use until a look finds it gone, so the exit comes at least ``seconds``
        after a lease is released or a load ends, and at most IDLE_CHECK_INTERVAL_S later. Once
        expired, it stays so until the next activity (the caller may wait a tick for a request
        on its socket)."""
        now = self._clock()
        if self._due and now - self.last_activity >= self.seconds:
            return True
        self._due = False
        if now < self._next_look and now - self.last_activity < self.seconds:  # a look at the deadline too
            return False
        self._next_look = now + IDLE_CHECK_INTERVAL_S
        used_now = used()
        if used_now or self._used:  # in use now, or up to now: it ended since the last look
            self._used = used_now
            self.last_activity = max(self.last_activity, now)
            return False
        self._due = now - self.last_activity >= self.seconds
        return self._due


def leases_held(store: SegmentStore) -> bool:
    """Whether some process holds a lease on one of the store's published segments: their
    inodes as recorded at publish (an adopted segment not asked for since: one ``lstat``) and
    one read of /proc/locks."""
    published = [e for e in store.entries.values() if e.state != "loading"]
    if not published:
        return False
    dev = os.stat(store.shm_dir).st_dev
    files: set[tuple[int, int]] = set()
    for entry in published:
        ino = entry.stamp.ino
        if not ino:
            try:
                ino = os.lstat(store.shm_dir / entry.file).st_ino
            except OSError:
                continue  # gone: nobody can take a lease on it any more
        files.add((dev, ino))
    return any_leased(files)


def holds(hold_dir: Path | None) -> int:
    """Entries in ``hold_dir`` (none when it is unset, missing or unreadable: a hold is only
    what can be seen)."""
    if hold_dir is None:
        return 0
    try:
        with os.scandir(hold_dir) as entries:
            return sum(1 for _ in entries)
    except OSError:
        return 0


def in_use(store: SegmentStore, hold_dir: Path | None = None) -> bool:
    """Whether a load runs or waits, a lease is held on a segment, or a hold is in ``hold_dir``
    (the cheap looks first)."""
    return store.loads_pending() or holds(hold_dir) > 0 or leases_held(store) or store.arenas.leased()
