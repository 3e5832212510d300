"""Stream blocks asked for ahead of need (``Acquire.prefetch``): which the budget may give up.

A block loaded for a prefetch is *unclaimed* until a request that needs it (no prefetch flag)
finds it; then it is *claimed* for good. Making room for a prefetch evicts only claimed (or
other) segments no client holds, never an unclaimed block: that is another rank's or job's
next block, loaded for them and not yet mapped, and evicting it for a block needed later
would only make them load it again (two jobs sharing a budget evicted each other's prefetched
blocks this way). A prefetch that finds no such room is refused (BudgetExceeded) and the
client asks again when it needs the block. A request that needs a block may evict anything
no client holds, least recently used first, exactly as before.
"""

from __future__ import annotations

from collections.abc import Iterable

from .entries import Entry

__all__ = ["Prefetched"]


class Prefetched:
    """The names of the segments loaded for a prefetch that no request has needed yet."""

    def __init__(self) -> None:
        self.unclaimed: set[str] = set()

    def asked(self, name: str, prefetch: bool, started: bool) -> None:
        """A request for segment ``name``: a prefetch (``prefetch``) that ``started`` its load
        leaves it unclaimed; any request without the flag claims it."""
        if not prefetch:
            self.unclaimed.discard(name)
        elif started:
            self.unclaimed.add(name)

    def eviction_order(self, entries: Iterable[Entry], prefetch: bool) -> list[Entry]:
        """Who may be evicted, in order, to make room for a request, least recently used first
        (``prefetch``: a prefetch, which evicts no unclaimed block)."""
        found = sorted(entries, key=lambda e: e.last_used)
        return [e for e in found if e.name not in self.unclaimed] if prefetch else found

    def forget(self, live: Iterable[str]) -> None:
        """Keep only the names still in ``live`` (segments evicted or failed are gone)."""
        self.unclaimed &= set(live)
