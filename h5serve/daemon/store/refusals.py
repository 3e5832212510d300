"""The words of the store's refusals: pure functions from the numbers to the error a client
gets (and falls back on, or raises with ``fallback="error"``), so each says what to do."""

from __future__ import annotations

from ...errors import BudgetExceeded
from ...hdf5.vlen import ESTIMATE_ROWS
from ...segments import SegmentMeta
from ...util.units import format_bytes
from ..config import FAILURE_MEMORY_S

__all__ = ["over_budget", "over_room", "stalled_load"]


def over_budget(meta: SegmentMeta, needed: int, used: int, budget: int, rule: str) -> BudgetExceeded:
    """A segment of ``needed`` bytes does not fit ``budget`` (set by ``rule``) with ``used``
    bytes held by segments clients still hold: more than the whole budget, or what is held."""
    what = f"{meta.source_path}[{meta.key}] rank {meta.rank} needs {format_bytes(needed)}"
    if needed > budget:  # nothing another job could free would make it fit
        return BudgetExceeded(
            f"{what}, more than the daemon's whole budget of {format_bytes(budget)} ({rule}); restart the daemon "
            f"with --max-memory of at least {format_bytes(needed)}, or use a mode that holds fewer rows per node")
    return BudgetExceeded(
        f"{what}; the daemon's budget is {format_bytes(budget)} ({rule}) and {format_bytes(used)} of it is held by "
        f"segments jobs are using ({format_bytes(budget - used)} free); finish those jobs, or restart the daemon "
        "with a larger --max-memory")


def over_room(meta: SegmentMeta, needed: int, room: int, budget: int, rule: str) -> BudgetExceeded:
    """A variable-length load stopped when its segment would have taken ``needed`` bytes (at
    least: rows were still to come), more than the ``room`` the budget (``budget``, set by
    ``rule``) gave it when it started: longer rows than the first ones said."""
    what = (f"{meta.source_path}[{meta.key}] {meta.shard_label()} needs at least {format_bytes(needed)} of shared "
            f"memory (variable-length rows, longer than its first {ESTIMATE_ROWS:,} rows said), more than the "
            f"{format_bytes(room)} the daemon's budget of {format_bytes(budget)} ({rule}) had room for when its load "
            "started; the load was stopped and its segment removed")
    if needed > budget:
        return BudgetExceeded(f"{what}. Restart the daemon with --max-memory of more than {format_bytes(needed)}, "
                              "or use a mode that holds fewer rows per node")
    return BudgetExceeded(f"{what}. Ask again once other loads are done or jobs release their segments, or "
                          "restart the daemon with a larger --max-memory")


def stalled_load(meta: SegmentMeta, rows_done: int, stall_timeout: float) -> str:
    """The failure of a load the daemon stopped after ``stall_timeout`` seconds without progress."""
    return (
        f"the daemon's load of {meta.source_path}[{meta.key}] {meta.shard_label()} made no progress for "
        f"{stall_timeout:g}s ({rows_done} of {meta.rows} rows; a stopped loader or a hung file system), so the "
        "daemon stopped it. Check that the file reads (e.g. `cat FILE > /dev/null`); the daemon loads it again "
        f"when asked {FAILURE_MEMORY_S:g}s from now (raise --stall-timeout if loads are legitimately that slow)")
