"""``Records``: what the store knows (every segment by name, the failures pollers are told of,
the counters and error replies), shared by reference with its reaper (reaping.py); and
``LoadIndex``, the loads among them, kept as they are asked for and started.

The control loop looks at running loads every tick (their pipes, their progress, whether a
loader slot is free, whether anything is loading): it reads them from the index, in the
order they were asked for, never by a scan of every segment the store holds. The index is
told only of what enters it (``queue``, ``start``); what leaves it (a load published, failed
or stopped, an entry dropped from the store) is left out when it is read, by the entry's own
state, so no path that drops an entry has to remember it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from .entries import COUNTERS, Entries, Entry, LoadFailure

__all__ = ["LoadIndex", "Records"]


class LoadIndex:
    """The loads of ``entries``: waiting for a loader (``queued``) or running (``running``)."""

    def __init__(self, entries: Mapping[str, Entry]) -> None:
        self._entries = entries
        self._queued: dict[str, Entry] = {}
        self._running: dict[str, Entry] = {}

    def queue(self, entry: Entry) -> None:
        """``entry`` (state ``loading``, no loader yet) waits for a loader."""
        self._queued[entry.name] = entry

    def start(self, entry: Entry) -> None:
        """``entry``'s loader runs (``entry.process`` set)."""
        self._queued.pop(entry.name, None)
        self._running[entry.name] = entry

    def _current(self, entry: Entry) -> bool:
        return self._entries.get(entry.name) is entry and entry.state == "loading"

    def queued(self) -> list[Entry]:
        """Loads waiting for a loader, oldest first."""
        self._queued = {n: e for n, e in self._queued.items() if e.process is None and self._current(e)}
        return list(self._queued.values())

    def running(self) -> list[Entry]:
        """Loads whose loader runs, oldest first."""
        self._running = {n: e for n, e in self._running.items() if e.process is not None and self._current(e)}
        return list(self._running.values())

    def loading(self) -> int:
        """Loads running or waiting for a loader."""
        return len(self.running()) + len(self.queued())


@dataclass
class Records:
    """The store's records; never rebound (the reaper holds the same objects)."""

    entries: Entries = field(default_factory=Entries)
    failures: dict[str, LoadFailure] = field(default_factory=dict)
    counters: Counter[str] = field(default_factory=lambda: Counter(dict.fromkeys(COUNTERS, 0)))
    errors: Counter[str] = field(default_factory=Counter)  # error replies by code
    loads: LoadIndex = field(init=False)

    def __post_init__(self) -> None:
        self.loads = LoadIndex(self.entries)
