"""The stale sweep: which published segments' source files changed on disk.

Every ``SWEEP_INTERVAL_S`` the store hands the identities of its published segments to a
resolver thread, which stats each file once (a hung network file system must not stall the
control loop); on a later tick the store evicts the segments whose files changed (or vanished)
once no client holds them: new requests already map to new names, so they can only waste memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from ...hdf5.identity import identities_unchanged
from ..config import SWEEP_INTERVAL_S
from .entries import Entry

__all__ = ["StaleSweep", "changed_sources"]

log = logging.getLogger("h5serve.daemon")


def changed_sources(sources: dict[str, list[tuple]]) -> set[str]:
    """The names one of whose files (the source, linked files, every file of a multi-file
    dataset, virtual sources) no longer has its recorded identity (blocking; each file stat-ed once)."""
    unique = {ident for identities in sources.values() for ident in identities}
    changed = {ident for ident in unique if not identities_unchanged([ident])}
    return {name for name, identities in sources.items() if changed.intersection(identities)}


class StaleSweep:
    """One sweep at a time, started every SWEEP_INTERVAL_S, its result picked up on a later tick."""

    def __init__(self) -> None:
        self._last = time.monotonic()
        self._running: Future[set[str]] | None = None

    def poll(self, entries: Iterable[Entry], submit: Callable[..., Future[Any]]) -> set[str]:
        """The names of ``entries`` whose sources changed, when a sweep has just finished (else
        none); starts the next sweep through ``submit`` (a resolver thread) when one is due.
        A sweep that failed is logged and tried again at the next interval: it never raises."""
        if self._running is not None:
            if not self._running.done():
                return set()
            running, self._running = self._running, None
            try:
                return running.result()
            except Exception as exc:  # noqa: BLE001 - the sweep is housekeeping: it never stops the loop
                log.warning("the stale sweep failed (%s: %s); trying again in %gs", type(exc).__name__, exc,
                            SWEEP_INTERVAL_S)
                return set()
        now = time.monotonic()
        if now - self._last < SWEEP_INTERVAL_S:
            return set()
        self._last = now
        sources = {e.name: e.meta.identities() for e in entries if e.state != "loading"}
        if sources:
            self._running = submit(changed_sources, sources)
        return set()
