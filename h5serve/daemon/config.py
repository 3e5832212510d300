"""The daemon's settings: one frozen object, named defaults."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..wire.runtime import RuntimeLocation

__all__ = ["DaemonConfig", "DEFAULT_MEMORY_FRACTION", "DEFAULT_STALL_TIMEOUT_S", "default_loaders",
           "default_load_processes", "FAILURE_MEMORY_S", "MAX_AWAITING_RESOLUTION", "MAX_REMEMBERED_METAS",
           "MAX_QUEUED_LOADS_PER_UID", "STALL_CHECK_INTERVAL_S",
           "SWEEP_INTERVAL_S", "IDLE_CHECK_INTERVAL_S", "ARENA_GRACE_S", "ARENA_SWEEP_S"]

DEFAULT_MEMORY_FRACTION = 0.8  # of the shm filesystem's free space when the daemon starts
SWEEP_INTERVAL_S = 2.0  # how often ready segments are checked against their source files
FAILURE_MEMORY_S = 10.0  # how long a failed load's error is reported to pollers before a retry
# a stream arena nobody has open, leases or loads is removed once it
# was not asked for in ARENA_GRACE_S (an answer's client opens it within that), looked for every ARENA_SWEEP_S
ARENA_GRACE_S = 5.0
ARENA_SWEEP_S = 0.5
# A load whose rows (or checksum) have not moved for this long is killed and fails: long enough
# for the slowest single step of a healthy load (one compressed block, posix_fallocate of a
# huge segment), short enough that a hung file system does not hold a loader slot for long.
DEFAULT_STALL_TIMEOUT_S = 120.0
STALL_CHECK_INTERVAL_S = 0.5  # how often running loads are checked for progress
# --idle-exit: how often the control loop looks at what requests do not show (loads running or
# queued, leases held on segments: one read of /proc/locks); so the daemon exits at most this
# much later than --idle-exit after the last activity
IDLE_CHECK_INTERVAL_S = 1.0
# Loads one uid may have waiting for a loader at once (running ones aside): a DDP job asks for
# ranks x keys of them at most (8 x 32 here), one user queuing thousands holds memory and the
# budget, and queued loads start round-robin by uid anyway (store._next_queued).
MAX_QUEUED_LOADS_PER_UID = 256
# requests answered before their file was resolved whose loads start once it is (store.start_resolved);
# past it the oldest is forgotten (its load starts when its client asks again)
MAX_AWAITING_RESOLUTION = 1024
# requests whose segment and name the store remembers (store._meta_of), all forgotten at once past it
MAX_REMEMBERED_METAS = 4096


def default_loaders() -> int:
    """Concurrent loader processes: one per core, at most 4 (h5py serialises within a process)."""
    return max(1, min(4, os.cpu_count() or 1))


def default_load_processes() -> int:
    """Processes one load is split across: the cores this process may run on, at most 8.

    Within one load, each part is a process of its own (h5py's global lock rules out threads);
    beyond 8, decompression rarely scales on one file and the page cache or disk is the limit.
    """
    try:
        cores = len(os.sched_getaffinity(0))  # a cpuset (SLURM, containers) may allow fewer than cpu_count
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


@dataclass(frozen=True)
class DaemonConfig:
    location: RuntimeLocation
    shm_dir: Path
    max_memory: int | None = None  # None: DEFAULT_MEMORY_FRACTION of free shm space at start
    loaders: int = 0  # 0: default_loaders(); loads that run at once
    load_processes: int = 0  # 0: default_load_processes(); processes one load is split across
    group: int | None = None  # gid that may connect and map segments (modes 0750/0660/0640)
    allow_roots: tuple[Path, ...] = ()  # when set, only files under these (after symlinks) are served
    # s3:// prefixes a shared daemon (--group, root) fetches (access/urls.py); when set, a personal daemon too
    allow_urls: tuple[str, ...] = ()
    metrics_port: int | None = None  # serve Prometheus metrics over HTTP (0: any free port)
    metrics_addr: str = "127.0.0.1"
    metrics_textfile: Path | None = None  # write h5serve.prom there for node_exporter
    # label segment metrics with file paths and keys (whoever reaches the endpoint sees them);
    # False: an opaque id per segment
    metrics_paths: bool = False
    stall_timeout: float = DEFAULT_STALL_TIMEOUT_S  # a load without progress this long is killed and fails
    checksum: bool = True  # loaders store a crc32 of the rows in the header (status --verify checks it)
    drop_page_cache: bool = True  # loaders drop the source file's cached pages of the rows they read
    # exit (as `h5serve stop` does) after this many seconds with no request but status, no lease held
    # on a segment and no load running or queued (idle.py); 0: never
    idle_exit: float = 0.0
    # with idle_exit: in use while this directory has an entry (a SLURM prolog's hold for each
    # running job of the daemon's user: idle.holds); root's, so the user cannot forge a hold
    hold_dir: Path | None = None
    # offer stream arenas (unless H5SERVE_ARENA=0 at start); a shared daemon (--group) never does:
    # docs/security.md, *Stream arenas*
    arenas: bool = True

    def __post_init__(self) -> None:
        for name in ("loaders", "load_processes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be at least 1 (or 0 for the default), got {getattr(self, name)}")
        if not self.stall_timeout > 0:  # also refuses NaN
            raise ConfigError(f"stall_timeout must be a number of seconds > 0, got {self.stall_timeout}")
        if not 0 <= self.idle_exit < math.inf:  # also refuses NaN
            raise ConfigError(f"idle_exit must be a number of seconds >= 0 (0: never), got {self.idle_exit}")
