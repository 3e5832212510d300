"""Automatic stream mode: a ``mode="global"`` or ``mode="node"`` dataset whose rows do not fit
the daemon's budget or /dev/shm is served in stream mode (client/streaming/backend.py) instead of read
lazily row by row.

The decision, ``decide``, is made in ``SharedH5Dataset.__init__``, before any sampler exists:

- a rank *wants* stream mode when its daemon refused the full shard for room (CapacityError:
  BudgetExceeded, ShmFull) and the data can be read (one file or many, fixed-size or
  variable-length rows); no daemon (DaemonUnavailable) is not a reason: the lazy fallback
  stays, bounded by its cache;
- every rank whose daemon answered reports its *limit*: the daemon's budget, or the size of
  its /dev/shm when that is smaller (never its free space: what other files take at that
  moment would change the window, and with it the order, from job to job);
- with torch.distributed initialised over more than one rank, one all-reduce (MAX of
  ``[wants, -limit]``) makes every rank take the same decision and the same window: stream
  if any rank wants it, with the smallest limit of any node. Without a process group each
  rank decides alone: ranks of one node see the same budget and /dev/shm size, so those that
  stream take the same window, but whether a rank streams follows its own acquire (a refusal
  for what other jobs hold, or for what other files take of /dev/shm: ShmFull, can come to
  one rank and not to another).

The window is the blocks the agreed limit holds (``resolve_stream`` with the limit as the
budget: the default block, smaller when the limit would hold fewer than 8, as ``h5serve
inspect`` recommends through h5serve/order/stream_plan.py), once the small keys a daemon holds
whole (labels: ``whole_keys``, as in stream mode with the default window) have taken their
room; passed to StreamBackend as bytes with those keys, so every rank's sampler has the same
capacity whether its blocks come from a daemon (which holds the labels whole) or from h5py
(which reads every key in blocks).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...errors import CapacityError, ConfigError, H5ServeError, ShmFull
from ...hdf5.description import DatasetDescription
from ...order.stream_plan import segment_cost
from ...util.units import format_bytes
from ...wire.connection import DaemonClient
from ..spec import BackendSpec
from .backend import StreamAsk, StreamSource, resolve_stream, stream_row_bytes, stream_source, whole_cost, whole_keys

__all__ = ["StreamPlan", "decide", "streamable"]

_UNKNOWN = -(1 << 62)  # an all-reduce MAX of -limit never picks a rank that knows no limit


@dataclass(frozen=True)
class StreamPlan:
    """What an automatically streamed dataset is served with, and why."""

    need: int  # bytes the full mode needs in shared memory (rows and a header page per key)
    budget: int  # the daemon's budget (agreed: the smallest of any rank's)
    limit: int  # what the window may take: the budget, or /dev/shm's size when smaller
    window: int  # bytes of rows of the window's blocks (capacity x block bytes)
    block_rows: int
    block_bytes: int
    capacity: int
    reason: str  # "budget", or "shm" (/dev/shm smaller than the budget, or full of other files)
    whole: tuple[bool, ...] = ()  # per key: held whole beside the window (with a daemon: stream.whole_keys)


def streamable(describe: Callable[[], DatasetDescription]) -> StreamSource | None:
    """The datasets ``describe`` describes (one file or many, fixed-size or variable-length
    rows) as stream mode reads them, or None when they cannot be read or checked.
    ``describe``: the dataset's description of its files (built once, and handed on to
    whichever backend serves)."""
    try:
        return stream_source(describe())
    except H5ServeError:
        return None


def _limit(spec: BackendSpec) -> tuple[int, int] | None:
    """(budget, what a window may take: the budget, or the size of the daemon's shm filesystem
    when smaller) from the node's daemon; None when none answers. Never the free space, which
    changes with what else is on the node: the window, and so the order, would too."""
    try:
        with DaemonClient(spec.runtime_dir, spec.timeout, spec.daemon_user) as client:
            info = client.ping()
    except H5ServeError:
        return None
    budget = info.get("budget")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        return None
    limit = budget
    try:
        st = os.statvfs(str(info.get("shm_dir", "/dev/shm")))
        limit = min(limit, st.f_blocks * st.f_frsize)
    except OSError:
        pass
    return budget, limit


def _grouped(world_size: int) -> bool:
    """Whether the dataset spans an initialised process group of more than one rank."""
    import torch.distributed as dist

    return world_size > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _agree(want: bool, budget: int | None, limit: int | None, world_size: int) -> tuple[bool, int | None, int | None]:
    """Every rank's (want, budget, limit) made one: any rank's want, the smallest known budget
    and limit (one all-reduce when a process group of more than one rank is initialised)."""
    import torch.distributed as dist

    if not _grouped(world_size):
        return want, budget, limit
    value = torch.tensor([int(want), _UNKNOWN if budget is None else -budget, _UNKNOWN if limit is None else -limit],
                         dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    got = [int(v) for v in value.tolist()]
    return bool(got[0]), None if got[1] == _UNKNOWN else -got[1], None if got[2] == _UNKNOWN else -got[2]


def decide(spec: BackendSpec, error: H5ServeError | None, world_size: int, ranks: int | None,
           describe: Callable[[], DatasetDescription]) -> StreamPlan | None:
    """Whether the global/node dataset ``spec`` (whose daemon acquire ended in ``error``, None:
    served) is streamed instead, and how; None: serve it as today. ``describe``: as for
    ``streamable``. A collective when
    torch.distributed is initialised over more than one rank: call it on every rank."""
    source = streamable(describe) if isinstance(error, CapacityError) else None
    want = source is not None
    if not want and not _grouped(world_size):
        return None
    known = _limit(spec) if want or error is None else None
    budget, limit = (None, None) if known is None else known
    want, budget, limit = _agree(want and known is not None, budget, limit, world_size)
    if not want or budget is None or limit is None:
        return None
    if source is None:  # this rank was served (or had no daemon) and another was refused
        source = streamable(describe)
        if source is None:
            return None
    infos = source.infos
    whole = whole_keys(infos, limit, bool(spec.files))  # labels held whole, as with mode="stream" and a daemon
    try:  # the blocks and window the rest holds, as inspect recommends them (stream_plan.daemon_window)
        config = resolve_stream(infos, StreamAsk(budget=limit - whole_cost(infos, whole), ranks=ranks), source)
    except ConfigError:  # not even one block fits: the lazy fallback
        return None
    rows = len(spec.selection.rows(infos[0].rows))
    need = sum(segment_cost(rows * stream_row_bytes(i)) for i in infos)
    reason = "shm" if isinstance(error, ShmFull) or limit < budget else "budget"
    return StreamPlan(need, budget, limit, config.capacity * config.block_bytes, config.layout.block_rows,
                      config.block_bytes, config.capacity, reason, tuple(whole))


def warning_text(plan: StreamPlan, mode: str, shown_path: str) -> str:
    """The one warning of an automatically streamed dataset: why, what changes, how to silence it."""
    order = ("DistributedShuffleSampler's (or DistributedSampler's) permutation" if mode == "global"
             else "the node permutation")
    budget = format_bytes(plan.budget)
    if plan.reason == "shm" and plan.limit < plan.budget:
        room = f"the size of /dev/shm ({format_bytes(plan.limit)}; the daemon's budget is {budget})"
    elif plan.reason == "shm":
        room = f"what other files leave free in /dev/shm (the daemon's budget is {budget})"
    elif plan.need > plan.budget:
        room = f"the daemon's budget of {budget}"
    else:
        room = f"what is free of the daemon's budget of {budget} (other jobs' segments hold the rest)"
    return (f"h5serve: {shown_path} in mode={mode!r} needs {format_bytes(plan.need)} of shared memory, more than "
            f"{room}: streaming it instead (mode='stream': blocks of {plan.block_rows} rows, "
            f"{format_bytes(plan.block_bytes)}, through a window of {plan.capacity} blocks, "
            f"{format_bytes(plan.window)}), not reading rows lazily. The order is now block-shuffled "
            f"(make_loader's StreamSampler), not {order}; with your own sampler pass auto_stream=False. "
            f"To silence this: pass mode='stream', or start the daemon with --max-memory of at least "
            f"{format_bytes(plan.need)} (and as much free in /dev/shm); auto_stream=False keeps lazy row reads.")
