"""Stopping a load: SIGKILL to a loader and the part processes it forked (loader.py), found
through /proc and signalled through pidfds, never blocking."""

from __future__ import annotations

import os
import signal

__all__ = ["kill_load"]


def _parent_of(pid: int) -> int:
    """The parent pid of ``pid`` from /proc (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _children_of(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (a loader's part processes), from /proc."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:  # parts are forked by the main thread
            return [int(c) for c in f.read().split()]
    except (OSError, ValueError):
        pass
    found = []
    for entry in os.listdir("/proc"):  # no CONFIG_PROC_CHILDREN: look at every process's parent
        if entry.isdigit() and _parent_of(int(entry)) == pid:
            found.append(int(entry))
    return found


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid``, -1 when this kernel has none (signal by pid then), None when it is gone."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except (OSError, AttributeError):  # no pidfd_open (Linux < 5.3)
        return -1


def _send_kill(pid: int, pidfd: int) -> bool:
    try:
        if pidfd >= 0:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def kill_load(pid: int) -> int:
    """SIGKILL a loader (``pid``, alive) and the part processes it forked. Never blocks: /proc
    reads and signals only (a process stuck in an uninterruptible read dies when the read
    returns). Returns how many processes were signalled.

    Each child is signalled through a pidfd opened before checking that it is still the
    loader's child, so a pid reused meanwhile is never signalled (where pidfds exist).
    """
    loader = _pidfd(pid)
    if loader is None:
        return 0
    targets = [(pid, loader)]
    for child in _children_of(pid):
        fd = _pidfd(child)
        if fd is None:
            continue
        if _parent_of(child) == pid:
            targets.append((child, fd))
        elif fd >= 0:
            os.close(fd)
    return sum(_send_kill(target, fd) for target, fd in targets)
