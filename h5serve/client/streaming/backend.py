"""Stream mode (``SharedH5Dataset(mode="stream")``): the file's blocks (h5serve/order/stream_order.py)
served in the stream sampler's order (client/streaming/sampler.py), from one of two sources:

- the node's daemon, when one answers: every block a segment in shared memory, one copy per
  node whatever the ranks and jobs, prefetched ahead of use (client/streaming/daemon_blocks.py);
- else (or when it cannot serve them: ``falls_back``) whole blocks read through h5py into a
  BlockCache of at most ``window`` bytes in this process (client/streaming/blockcache.py).

The order is a function of the block layout and the window's capacity only. ``window``: bytes
(``"2GiB"``, h5serve/util/units.py ``parse_size``). Capacity (blocks) is ``window // block bytes`` either
way, and the block (``block_rows=None``) is fitted to ``window``, so one ``window`` gives one
order with or without a daemon. With a daemon, the window must fit its budget (``ping`` says
it) counting a segment per key and block, its header page and rows in whole pages (as the
daemon counts them). Without one, every rank (and every DataLoader worker) holds its own window.

``window=None`` takes what holds the window: with a daemon, as many blocks as its budget
holds; without one, ``default_window`` (DEFAULT_WINDOW_FRACTION of the node's memory, physical
or the cgroup's limit, divided among the job's ranks on the node and, when make_loader runs
DataLoader workers, among each rank's workers: ``StreamConfig.capacity_for``). So the block and
the window, and with them the order, differ between the two, and without a daemon with the
number of workers when the file does not fit: ``window=`` (and ``block_rows=``) pin them. A
default is made of what every rank of a node sees alike (the daemon's budget, the node's
memory, the file's layout), never of what is free at the moment; with torch.distributed
initialised the ranks also agree, on the smallest of every rank's memory for the window and
then of every rank's capacity, so a rank with no daemon reads in the order of those with one.

Many files: blocks are laid out per file (a block never spans two) and, with a daemon, each
is a segment of the one file that holds it. Variable-length rows: a block is their offsets
and values; the window counts the values by the mean row length of each file's first rows.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...errors import ConfigError, H5ServeError, falls_back
from ...hdf5.description import DatasetDescription
from ...hdf5.source import DatasetInfo
from ...order.stream_order import BlockLayout, block_unit, check_block_rows
from ...order.stream_plan import KeyShape, fitted_block_rows, held_whole, held_whole_bytes, segment_cost
from ...segments.format import VALUES_ALIGN
from ...util.checks import is_int
from ...util.units import format_bytes, parse_size, row_nbytes
from ..backends.chunkcache import local_ranks
from ..backends.files import FileHandles
from ..backends.protocol import NoHooks
from ..remote import pinned
from ..spec import BackendSpec, describe_spec
from .batch import StreamBatch
from .blockcache import BlockCache, worker_capacity
from .daemon_blocks import DaemonBlocks
from .window_fit import DaemonWindow, check_window, daemon_window, remote_probe

__all__ = ["StreamAsk", "StreamConfig", "StreamBackend", "StreamBatch", "StreamSource", "default_window", "key_shape",
           "node_memory", "resolve_stream", "stream_row_bytes", "stream_source", "whole_cost", "whole_keys",
           "window_bytes"]

log = logging.getLogger("h5serve")


@dataclass(frozen=True)
class StreamConfig:
    """The blocks of a stream dataset and how many of them a window holds."""

    layout: BlockLayout
    block_bytes: int  # one block of every key, in the source dtypes
    capacity: int  # blocks a window holds
    window_bytes: int  # what was asked for (or picked)
    block_cost: int = 0  # with a daemon: one block of every key in shared memory, headers included, whole pages
    budget: int = 0  # with a daemon: its budget
    worker_room: int = 0  # window=None without a daemon: the blocks it holds, shared by the rank's workers

    def capacity_for(self, workers: int) -> int:
        """Blocks the window holds in each of ``workers`` DataLoader workers (0: none, the rank
        reads itself): ``capacity``, or for the default window without a daemon (shared among
        the workers) each worker's share of it.

        Raised when that share holds no block: ConfigError naming the numbers."""
        if not self.worker_room or workers <= 1:
            return self.capacity
        share = worker_capacity(self.worker_room, self.layout.n_blocks, workers)
        if share < 1:
            raise ConfigError(
                f"the default window without a daemon ({format_bytes(self.window_bytes)} a rank, shared by its "
                f"DataLoader workers) holds {self.worker_room} blocks of {format_bytes(self.block_bytes)}, fewer than "
                f"one for each of {workers} workers: use fewer workers, pass window= (bytes each process holds), or "
                "start a daemon (one window per node)")
        return share


def window_bytes(window: object) -> int | None:
    """``window`` as bytes (None stays None).

    Raised when it is not a size or is not positive: ConfigError naming ``window=``."""
    if window is None:
        return None
    if isinstance(window, str):
        try:
            size = parse_size(window)
        except ConfigError as exc:
            raise ConfigError(f"window={window!r} is not a size: pass bytes as an int, or a string like '2GiB' or "
                              "'512MiB' (window=None: the default window)") from exc
    elif is_int(window, numpy=True):
        size = int(window)
    else:
        raise ConfigError(f"window must be a size in bytes (an int, or a string like '2GiB'), got {window!r}")
    if size < 1:
        raise ConfigError(f"window must be more than 0 bytes, got {window!r}")
    return size


DEFAULT_WINDOW_FRACTION = 0.25  # of the node's memory (node_memory): the default window of all its ranks together


def _meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"no {field} in /proc/meminfo")


def _cgroup_limits() -> list[int]:
    """The memory limits of this process's cgroup and its ancestors (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``); none when unlimited or not found."""
    limits: list[int] = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return limits
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, name = "/sys/fs/cgroup", "memory.max"
        elif "memory" in controllers.split(","):
            base, name = "/sys/fs/cgroup/memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            try:
                with open("/".join([base, *parts[:depth], name])) as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text.isdigit() and int(text) < 1 << 60:
                limits.append(int(text))
    return limits


def node_memory() -> int:
    """The node's memory as every process of a job on it sees it alike: its physical memory
    (``MemTotal``), or its cgroup's memory limit when lower (one job's ranks share their
    cgroup). Never what is free now, which differs from process to process and moment to
    moment (the default window, and so the order, must be the same on every rank of a node)."""
    try:
        total = _meminfo("MemTotal")
    except (OSError, ValueError):
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min([total, *_cgroup_limits()])


def default_window(ranks: int | None) -> int:
    """The default window of a rank without a daemon: DEFAULT_WINDOW_FRACTION of
    ``node_memory()`` shared by the job's ``ranks`` on the node (default: ``local_ranks()``,
    torchrun's ``LOCAL_WORLD_SIZE``); the same on every rank of the node without any collective.
    A rank's DataLoader workers share it in turn (``StreamConfig.capacity_for``), so the node's
    windows together stay within DEFAULT_WINDOW_FRACTION of its memory whatever the workers."""
    return int(node_memory() * DEFAULT_WINDOW_FRACTION) // (ranks or local_ranks())


def _agreed(value: int, world_size: int) -> int:
    """The smallest ``value`` of every rank when the dataset spans an initialised process
    group of more than one rank (a collective: every rank builds the dataset), else ``value``."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return value
    if world_size <= 1 or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return value
    reduced = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(reduced, op=dist.ReduceOp.MIN)
    return int(reduced.item())


def key_shape(info: DatasetInfo) -> KeyShape:
    """``info`` as the stream plan sees it (order/stream_plan.py)."""
    return KeyShape(info.chunk_rows if info.chunked else 1, stream_row_bytes(info), info.rows, bool(info.vlen))


def whole_keys(infos: Sequence[DatasetInfo], budget: int, many_files: bool) -> list[bool]:
    """Which keys a daemon-served stream of ``budget`` holds whole (stream_plan.held_whole)."""
    return held_whole([key_shape(i) for i in infos], budget, many_files)


def whole_cost(infos: Sequence[DatasetInfo], whole: Sequence[bool]) -> int:
    """The shared memory the keys held whole take."""
    return held_whole_bytes([key_shape(i) for i in infos], whole)


def stream_row_bytes(info: DatasetInfo) -> int:
    """Bytes one row of ``info`` takes in a block: its values (variable-length rows: an int64
    offset and the mean length of the first rows, an estimate the window is sized by)."""
    if info.vlen:
        return 8 + math.ceil(info.mean_length * info.dtype.itemsize)
    return row_nbytes(info.row_shape, info.dtype)


@dataclass(frozen=True)
class StreamAsk:
    """What a stream dataset's window and blocks are made of: what was asked for and where it runs."""

    window: object = None  # bytes, or a size such as "2GiB"; None: the default window
    block_rows: object = None  # rows a block (whole chunks); None: fitted to the window
    budget: int | None = None  # the daemon's, when a daemon serves the blocks
    ranks: int | None = None  # the job's ranks on this node: the default window's share without a daemon
    world_size: int = 1  # the ranks that agree on one block and one capacity (an all-reduce each)


def resolve_stream(infos: list[DatasetInfo], ask: StreamAsk, files: StreamSource | None = None) -> StreamConfig:
    """The block layout and window of the datasets ``infos`` (equal rows), as ``ask`` says.
    ``files``: what the blocks are read from (``stream_source``), for many files: the rows of
    each (blocks are laid out per file) and every key of every file, whose chunks blocks are
    whole numbers of (without it, one file: ``infos``). The
    default window (``window=None``) is what the daemon's budget holds, else
    ``default_window(ranks)``: both the same on every rank of a node; with a process group
    over ``world_size > 1`` ranks every rank fits its block to the smallest of every rank's
    (one all-reduce) and takes the smallest capacity (another), so a rank that reached no
    daemon while others did reads the same blocks in the same order. ``block_rows`` larger
    than the (longest) file is cut to the file's rows in whole chunks: one block a file.

    Raised when ``window`` is not a size, ``block_rows`` is not whole chunks of every key, the
    window is smaller than one block, or (with a daemon) larger than its budget: ConfigError
    naming the numbers."""
    window, block_rows, budget, ranks, world_size = ask.window, ask.block_rows, ask.budget, ask.ranks, ask.world_size
    file_rows = files.file_rows if files is not None else ()
    chunked = [i for each in files.file_infos for i in each] if files is not None else []
    chunks_said = files.chunks_said if files is not None else ""
    total = infos[0].rows
    longest = max(file_rows, default=total)
    each = chunked or infos
    unit = block_unit([i.chunk_rows if i.chunked else 1 for i in each])
    row_bytes = sum(stream_row_bytes(i) for i in infos)
    asked = window_bytes(window)
    if budget is not None and asked is not None and asked > budget:
        raise ConfigError(f"window={window!r} ({format_bytes(asked)}) is larger than the daemon's budget of "
                          f"{format_bytes(budget)}: pass a window of at most that (window=None: what the budget "
                          "holds), or start the daemon with a larger --max-memory")
    size = asked if asked is not None else budget if budget is not None else default_window(ranks)
    if block_rows is None:  # whole chunks, smaller than the default when the window would hold few
        limit = size if asked is not None else _agreed(size, world_size)  # every rank the same block
        rows = fitted_block_rows(unit, [stream_row_bytes(i) for i in infos], longest, limit)
    else:
        chunks = chunks_said or ", ".join(f"{i.key}: {i.chunk_rows} rows a chunk" for i in each if i.chunked)
        rows = min(check_block_rows(block_rows, unit, chunks), unit * max(-(-longest // unit), 1))
    layout = BlockLayout(total, rows, tuple(file_rows))
    block = rows * row_bytes
    # the daemon's segments: a header page each and the rows (vlen: one more offset, the values aligned), each in
    # whole pages, as the daemon's budget counts them
    cost = sum(segment_cost(rows * stream_row_bytes(i) + (8 + VALUES_ALIGN if i.vlen else 0)) for i in infos)
    own = size // max(cost if budget is not None and asked is None else block, 1)
    capacity = own if asked is not None else _agreed(own, world_size)  # the order depends on it: one for all
    if capacity < 1:
        said = ("the default window (a quarter of the node's memory shared by its ranks)" if budget is None
                else "the daemon's budget") if asked is None else f"window={window!r}"
        if own >= 1:
            said = f"another rank's {said.removeprefix('the ')} (the smallest of the job's ranks, which all take it)"
        values = " (variable-length rows: their mean length in the first rows)" if any(i.vlen for i in infos) else ""
        smaller = (f", or smaller blocks (block_rows=, a multiple of {unit})" if rows > unit else
                   f" (blocks are one chunk already: {unit} rows, the least a block can be; or rewrite the file with "
                   "smaller chunks)")
        raise ConfigError(
            f"{said} is {format_bytes(size)}, smaller than one block ({rows} rows x {row_bytes} bytes{values} = "
            f"{format_bytes(block)}{'' if budget is None else f', {format_bytes(cost)} in shared memory'}): pass a "
            f"window of at least {format_bytes(block if budget is None else cost)}{smaller}")
    room = capacity if asked is None and budget is None else 0  # the default window without a daemon: workers share it
    capacity = min(capacity, max(layout.n_blocks, 1))
    if budget is not None:
        check_window(size, capacity, block, cost, budget)
    return StreamConfig(layout, block, capacity, size, cost, budget or 0, room)


@dataclass(frozen=True)
class StreamSource:
    """What a stream dataset's blocks are read from: ``infos``, one per key (the dtype rows are
    held in: for many files the set's; ``rows`` every file's), ``file_infos[k][i]`` key ``k`` in
    file ``i``, and the rows of each of many files (empty: one file)."""

    infos: list[DatasetInfo]
    file_infos: list[list[DatasetInfo]]
    out_dtypes: list[np.dtype]
    file_rows: tuple[int, ...] = ()
    chunks_said: str = ""  # many files: each key's chunk rows and the first file that has them


def stream_source(description: DatasetDescription) -> StreamSource:
    """What the blocks of the dataset ``description`` holds are read from (one file's, or many
    files', checked as every reader's are: hdf5/description.py)."""
    keys = description.keys
    if len(description.files) == 1:
        infos = [k.first for k in keys]
        return StreamSource(infos, [[i] for i in infos], description.out_dtypes)
    file_infos = [list(k.infos) for k in keys]
    total = description.total_rows
    held = [dataclasses.replace(k.first, rows=total, dtype=k.dtype,
                                mean_length=sum(i.mean_length * i.rows for i in k.infos) / max(total, 1))
            for k in keys]
    said: dict[tuple[str, int], str] = {}
    for infos in file_infos:
        for path, info in zip(description.files, infos):
            if info.chunked:
                said.setdefault((info.key, info.chunk_rows), path)
    chunks = ", ".join(f"{key}: {n} rows a chunk in {path}" for (key, n), path in list(said.items())[:8])
    return StreamSource(held, file_infos, description.out_dtypes, description.file_rows, chunks)


class StreamBackend(NoHooks):
    """Rows of whole blocks: daemon segments (``name == "shm"``, ``cache`` a DaemonBlocks)
    when the node's daemon answers, else read through h5py into a BlockCache of
    ``config.capacity`` blocks (``name == "lazy"``). ``on_fallback``: called with the reason
    when no daemon serves them and the blocks are read here (None: raise it instead).

    ``description``: the files as h5py reads them (hdf5/description.py; None: described here).
    ``whole``: which keys a daemon holds whole beside the window (automatic stream mode's plan,
    whose window left them room); None: ``whole_keys`` of the daemon's budget with the default
    window, none with an asked one.

    Raised as ``describe`` is (a missing file or key, files that disagree): DataError; as
    ``resolve_stream`` is: ConfigError."""

    def __init__(self, spec: BackendSpec, window: object, block_rows: object, ranks: int | None = None,
                 on_fallback: Callable[[H5ServeError], None] | None = None,
                 description: DatasetDescription | None = None, whole: Sequence[bool] | None = None) -> None:
        description = describe_spec(spec) if description is None else description
        spec = pinned(spec, lambda: description)  # an s3:// object the daemon fetches: with its identity
        source = stream_source(description)
        infos = source.infos
        self.out_dtypes, self.total_rows = source.out_dtypes, infos[0].rows
        self.vlen_kinds = [i.vlen for i in infos]
        self.spec, self.infos, self.source = spec, infos, source
        daemon = self._daemon(on_fallback)
        # with a daemon and the default window, small keys (labels) are held whole, their room
        # taken from the window's; an asked window keeps every key in blocks (the order, which
        # the window sets, stays the one it is without a daemon), unless ``whole`` says which
        # (automatic stream mode: its window already left them room)
        if daemon is None:
            whole = [False] * len(infos)
        elif whole is not None:
            whole = list(whole)
        else:
            whole = [False] * len(infos) if window is not None else whole_keys(infos, daemon.budget, bool(spec.files))
        budget = None if daemon is None else daemon.budget - whole_cost(infos, whole)
        self.config = resolve_stream(infos, StreamAsk(window, block_rows, budget, ranks, spec.selection.world_size),
                                     source)
        self.handles = FileHandles(spec.files or (spec.path,), dict(spec.h5_options), description)
        self.cache: BlockCache | DaemonBlocks
        if daemon is None:
            self.name = "lazy"
            self.cache = self._block_cache()
        else:
            self.name = "shm"
            self.cache = DaemonBlocks(spec, infos, self.out_dtypes, self.config.layout, self.config.capacity,
                                      daemon.budget, self.config.block_cost, whole, daemon.arena)
        log.info("h5serve: streaming %s in blocks of %d rows (%s), a window of %d blocks, %s",
                 spec.pattern or spec.path, self.config.layout.block_rows, format_bytes(self.config.block_bytes),
                 self.config.capacity, "from the daemon's shared memory" if daemon else "read here through h5py")

    def _block_cache(self) -> BlockCache:
        c = self.config
        return BlockCache(self.infos, self.out_dtypes, c.layout, c.capacity, self.handles, self.source.file_infos,
                          c.capacity * c.block_bytes, c.worker_room)

    def _daemon(self, on_fallback: Callable[[H5ServeError], None] | None) -> DaemonWindow | None:
        if self.spec.remote and self.spec.pin is None and not self.spec.pins:  # read here: said by client/remote.py
            return None
        try:
            return daemon_window(self.spec, remote_probe(self.spec, self.infos))
        except H5ServeError as exc:
            if on_fallback is None or not falls_back(exc):
                raise
            on_fallback(exc)
            return None

    def retain(self, batch: StreamBatch) -> None:
        """Free the blocks not in the node's window at this batch (``batch.alive``); with a
        daemon, ask for the blocks it takes next (``batch.ahead``)."""
        self.cache.retain(batch.alive)
        self.cache.prefetch(batch.ahead, batch.alive)

    def finish(self, batch: StreamBatch) -> None:
        """After ``batch`` was gathered: close the blocks this rank has used for the last time
        and, in a DataLoader worker, those it may not keep until its next batch (``batch.keep``)."""
        self.cache.release(batch.done, batch.keep)

    def gather(self, positions: torch.Tensor) -> list[Any]:
        return list(self.cache.gather(positions.numpy()))

    def close(self) -> None:
        self.cache.close()
        self.handles.close()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if isinstance(self.cache, BlockCache):  # a spawned worker reads its own blocks
            state["cache"] = self._block_cache()
        return state
