"""Loads waiting for a loader: how many one user may queue, which starts next, and whether a
waiting load reads the same rows as one about to start.

Queued loads start round-robin by the uid that asked (the next uid after the one served last,
among those waiting; that uid's oldest load), not in the order they were asked: one user
queuing hundreds of loads delays another's by at most one load per loader slot. Each uid may
have MAX_QUEUED_LOADS_PER_UID loads waiting; past that its requests are refused, not queued.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from ...errors import CapacityError
from ...segments import SegmentMeta
from ..config import MAX_QUEUED_LOADS_PER_UID
from .entries import Entry

__all__ = ["check_queue_of", "next_queued", "read_again_soon"]


def _queued(entries: Iterable[Entry]) -> list[Entry]:
    return [e for e in entries if e.state == "loading" and e.process is None]


def check_queue_of(entries: Iterable[Entry], uid: int, meta: SegmentMeta, counters: Counter[str],
                   also: int = 0) -> None:
    """Raised when ``uid`` already has MAX_QUEUED_LOADS_PER_UID loads waiting for a loader (the
    load of ``meta`` would be one more; ``also``: its loads queued elsewhere, stream arena slots):
    CapacityError, counted as a refusal."""
    queued = also + sum(1 for e in _queued(entries) if e.requester == uid)
    if queued >= MAX_QUEUED_LOADS_PER_UID:
        counters["refusals"] += 1
        raise CapacityError(
            f"uid {uid} already has {queued} loads waiting for a loader, the most one user may queue "
            f"(MAX_QUEUED_LOADS_PER_UID = {MAX_QUEUED_LOADS_PER_UID}); {meta.source_path}[{meta.key}] rank "
            f"{meta.rank} is not queued. Ask again once some of them are loaded (h5serve status shows them)")


def next_queued(entries: Iterable[Entry], last_uid: int) -> tuple[Entry | None, int]:
    """``(the queued load to start next, the uid it starts for)``: round robin by uid after
    ``last_uid`` (the one served last), that uid's oldest; ``(None, last_uid)`` when none waits."""
    queued = _queued(entries)
    if not queued:
        return None, last_uid
    uids = sorted({uid for e in queued for uid in e.waiting})
    uid = next((u for u in uids if u > last_uid), uids[0])
    return next(e for e in queued if uid in e.waiting), uid


def read_again_soon(entries: Iterable[Entry], entry: Entry) -> bool:
    """Whether a load still waiting for a loader reads some of the same rows of the same
    dataset as ``entry``'s (interleaved shards: every rank's load reads every row). Then
    ``entry``'s loader keeps the source's pages cached for it; the last such load drops them."""
    meta = entry.meta
    first, last = meta.row_range.span
    for other in _queued(entries):
        if other is entry:
            continue
        o = other.meta
        if (o.source, o.key, o.linked, o.files) == (meta.source, meta.key, meta.linked, meta.files):
            a, b = o.row_range.span
            if a < last and first < b:
                return True
    return False
