"""The store's records: a segment it knows (``Entry``), a load that failed (``LoadFailure``),
and the counters ``status`` shows."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerProcess
from pathlib import Path

from ...order.sharding import STREAM
from ...segments import UNKNOWN_STAMP, PublishStamp, SegmentMeta
from ...util.safeio import is_own_file

__all__ = ["COUNTERS", "Entries", "Entry", "LoadFailure", "load_log_level", "not_ours", "shown_state"]

# Shown in `status --json` from the start, so watchers never see a key appear.
# damaged: published segments found changed (missing, truncated, made writable, header rewritten)
# and loaded again; stalled: loads stopped by the watchdog after --stall-timeout without progress.
# remote_*: loads of s3:// objects (daemon/loading/remoteload.py), the bytes their GETs received and the
# milliseconds they took (status shows the rate)
COUNTERS = ("loads_requested", "loads", "load_errors", "hits", "evictions", "stale_evictions", "refusals", "adopted",
            "damaged", "stalled", "remote_loads", "remote_bytes", "remote_fetch_ms")


@dataclass(frozen=True)
class LoadFailure:
    """A failed load, remembered for FAILURE_MEMORY_S so pollers get its error, not a retry."""

    at: float  # time.monotonic() when it failed
    code: str  # as in h5serve.errors
    message: str


class Ledger:
    """The sum of ``Entry.charge`` over the entries of one ``Entries``: what the budget counts."""

    __slots__ = ("total",)

    def __init__(self) -> None:
        self.total = 0


CHARGED_FIELDS = frozenset({"state", "room", "meta"})  # what ``Entry.charge`` reads


@dataclass
class Entry:
    name: str  # the keyed segment name (naming.segment_name): the store's key for it
    meta: SegmentMeta
    state: str  # "loading" | "ready" | "stale" (source changed; evicted once unheld)
    # the file in the shm dir: ``name``, or a fresh name when a file not ours held that ("": ``name``)
    file: str = ""
    requester: int = -1  # uid whose request started the load (the per-uid queue bound counts it)
    waiting: set[int] = field(default_factory=set)  # uids that asked while it was queued (fair starts)
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    hits: int = 0
    tmp_name: str = ""
    process: ForkServerProcess | None = None  # a loader, started by loader_context()
    reply: Connection | None = None
    load_started: float = 0.0
    load_seconds: float = 0.0
    load_parts: int = 0  # processes the load was split across (0: not loaded by this daemon)
    load_read_seconds: float = 0.0  # of load_seconds, reading the rows into the segment
    load_copied_bytes: int = 0  # of the rows' bytes, copied file to file instead of through h5py (rawcopy)
    header: bytes = b""  # the header as published, compared byte for byte before each hit
    checksum: str = ""  # "crc32:..." of the rows, as the loader computed it ("" when not computed)
    activity: tuple[int, int] = (0, 0)  # (rows done, activity counter) last read from the temporary
    active_at: float = 0.0  # when ``activity`` last moved (monotonic)
    asked_as: tuple[str, int, int] = ("", 0, 0)  # (mode, world_size, rank) of the latest acquire ("": the meta's)
    modes: set[str] = field(default_factory=set)  # every mode it was asked for (one segment serves several)
    spans: tuple[tuple[int, int], ...] | None = None  # its load's parts, planned here (None: by the loader)
    stamp: PublishStamp = UNKNOWN_STAMP  # inode and ctime as published, checked before each hit and by clients
    granted: set[int] = field(default_factory=set)  # uids (not the daemon's, not root) answered for it: they
    # may have its descriptor (handout.py) and see it in status
    # a variable-length load in flight: the bytes its segment may grow to (its loader stops past them), set
    # when its loader starts (store._room_of); 0 otherwise
    room: int = 0
    # the store's running total of charges, while the entry is in an ``Entries`` (kept as the
    # fields ``charge`` reads change: CHARGED_FIELDS)
    ledger: Ledger | None = field(default=None, init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: object) -> None:
        ledger = self.__dict__.get("ledger")
        if ledger is None or name not in CHARGED_FIELDS:
            object.__setattr__(self, name, value)
            return
        before = self.charge
        object.__setattr__(self, name, value)
        ledger.total += self.charge - before

    def __post_init__(self) -> None:
        self.file = self.file or self.name

    @property
    def charge(self) -> int:
        """What it counts against the budget: its segment's pages in tmpfs (``allocated_size``:
        the real size once loaded; a variable-length load waiting for a loader, its estimate),
        or, while a variable-length load runs, the room its loader may fill. Every budget check
        of the store sums this and nothing else."""
        if self.state == "loading":
            return max(self.room, self.meta.allocated_size)
        return self.meta.allocated_size

    def label(self) -> tuple[str, int, int]:
        """(mode, world_size, rank) shown in status: the latest request's, else the loaded one's."""
        return self.asked_as if self.asked_as[0] else (self.meta.mode, self.meta.world_size, self.meta.rank)


def load_log_level(meta: SegmentMeta) -> int:
    """The level of a segment's loading, loaded and evicted lines: DEBUG for a stream block (a
    stream loads and evicts blocks tens of times a second: INFO lines would bury the log and
    cost the daemon's loop; ``status`` and the metrics count them), INFO for the rest."""
    return logging.DEBUG if meta.mode == STREAM else logging.INFO


def not_ours(st: os.stat_result) -> bool:
    """For remove_if: keep (leave alone) anything that is not a regular file of ours."""
    return not is_own_file(st)


def shown_state(entry: Entry, shm_dir: Path) -> str:
    """``entry.state`` as ``status`` shows it: ``damaged`` for a published segment whose file is
    no longer as published (one lstat: replaced, or its ctime moved); its next request loads
    it again."""
    if entry.state == "loading" or not entry.stamp.ino:
        return entry.state
    try:
        st = os.lstat(shm_dir / entry.file)
    except OSError:
        return "damaged"
    return entry.state if entry.stamp.matches(st) else "damaged"


class Entries(dict[str, Entry]):
    """The store's entries by name, with the sum of their charges kept as they come, go and
    change (``ledger.total``): the budget is checked on every load, and summing every segment
    each time made a stream's epoch cost grow with the square of its window's blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger()

    def _enter(self, entry: Entry) -> None:
        if entry.ledger is not None and entry.ledger is not self.ledger:
            raise ValueError(f"segment {entry.name} is in another store's records already")
        entry.ledger = self.ledger
        self.ledger.total += entry.charge

    def _leave(self, entry: Entry) -> None:
        self.ledger.total -= entry.charge
        entry.ledger = None

    def __setitem__(self, name: str, entry: Entry) -> None:
        old = self.get(name)
        if old is entry:
            return
        if old is not None:
            self._leave(old)
        self._enter(entry)
        super().__setitem__(name, entry)

    def __delitem__(self, name: str) -> None:
        self._leave(self[name])
        super().__delitem__(name)

    def pop(self, name: str, *default: Entry | None) -> Entry | None:  # type: ignore[override]
        if name in self:
            entry = self[name]
            del self[name]
            return entry
        if default:
            return default[0]
        raise KeyError(name)

    def clear(self) -> None:
        for entry in self.values():
            entry.ledger = None
        super().clear()
        self.ledger.total = 0

    def popitem(self) -> tuple[str, Entry]:
        raise TypeError("Entries: remove by name (del, pop)")

    def setdefault(self, *_: object) -> Entry:
        raise TypeError("Entries: set by name")

    def update(self, *others: object, **named: Entry) -> None:
        for other in others:
            items = other.items() if isinstance(other, dict) else other
            for name, entry in items:  # type: ignore[attr-defined]
                self[name] = entry
        for name, entry in named.items():
            self[name] = entry
