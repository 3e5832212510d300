"""The words of a stream block that found no room (client/streaming/daemon_blocks.py): in the daemon's
budget (BudgetExceeded), its shm filesystem (ShmFull) or its load queue (CapacityError), as a
pure function of what was asked and the numbers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import BudgetExceeded, CapacityError, ShmFull
from ...util.units import format_bytes
from ...wire.protocol import Acquire

__all__ = ["NoRoom", "no_room_message"]


def no_room_message(request: Acquire, block: int | None, many_files: bool, wait_s: float, capacity: int,
                    block_cost: int, budget: int, held: Sequence[int], exc: CapacityError) -> str:
    """Why ``block`` of ``request`` (None: a key held whole) is not served after ``wait_s``, what
    the window (``capacity`` blocks of ``block_cost``) and this process (``held``) take, what the
    daemon said (``exc``) and what to do."""
    held = sorted(held)
    shown = ", ".join(map(str, held[:16])) + (", ..." if len(held) > 16 else "")
    holds = f"{len(held)} ({shown})" if held else "none"
    window = format_bytes(capacity * block_cost)
    if request.rows is None:
        what_needs = f"{request.key!r}, held whole for this stream,"
    else:
        where = f"rows [{request.rows[0]}, {request.rows[1]}) of {request.key!r}" + (
            f" in {request.path}" if many_files else "")
        what_needs = f"stream block {block} ({where})"
    if isinstance(exc, BudgetExceeded):
        what = f"in the daemon's budget of {format_bytes(budget)}"
        others = "the rest is held by other ranks or jobs on the node (a rank stopped or far behind?)"
        fix = "Check the other ranks, or give the job a smaller window (window=) or the daemon a larger --max-memory"
    elif isinstance(exc, ShmFull):
        what = "in the daemon's shm filesystem (its free space, not the budget, ran out)"
        others = "other files fill the shm filesystem (other jobs, users, or files left there)"
        fix = ("Free space in the daemon's shm dir (`df` on it), or give the job a smaller window (window=) or the "
               "daemon a --max-memory its shm filesystem holds")
    else:
        what = "in the daemon's load queue (the loads one user may have waiting for a loader)"
        others = "this user's other ranks and jobs on the node keep it full"
        fix = "Run fewer jobs at once, use larger blocks (block_rows=), or start the daemon with more --loaders"
    return (f"{what_needs} found no room {what} for {wait_s:g}s, asked again with backoff: "
            f"the window is {capacity} blocks of {format_bytes(block_cost)} ({window}), this rank "
            f"holds {holds} and {others}. The daemon said: {exc}. {fix}; timeout= sets how long "
            "to wait")



@dataclass(frozen=True)
class NoRoom:
    """A stream's window as its refusal names it (``no_room_message``'s numbers but the block)."""

    many_files: bool
    wait_s: float
    capacity: int
    block_cost: int
    budget: int

    def error(self, request: Acquire, block: int | None, held: Sequence[int], exc: CapacityError) -> CapacityError:
        """``exc``'s class with the words of a block that found no room for ``wait_s``."""
        return type(exc)(no_room_message(request, block, self.many_files, self.wait_s, self.capacity,
                                         self.block_cost, self.budget, held, exc))
