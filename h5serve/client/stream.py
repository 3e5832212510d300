"""Stream mode (``SharedH5Dataset(mode="stream")``): the file's blocks (h5serve/stream_order.py)
served in the stream sampler's order (client/stream_sampler.py), from one of two sources:

- the node's daemon, when one answers: every block a segment in shared memory, one copy per
  node whatever the ranks and jobs, prefetched ahead of use (client/stream_daemon.py);
- else (or when it cannot serve them: ``falls_back``) whole blocks read through h5py into a
  BlockCache of at most ``window`` bytes in this process (client/blockcache.py). Same rows,
  same order: the order depends on the block layout and the window's capacity only.

``window``: bytes (``"2GiB"``, h5serve/units.parse_size). Capacity (blocks) is ``window //
block bytes`` either way, so one ``window`` gives one order with or without a daemon. With a
daemon, the window must fit its budget (``ping`` says it) counting a header page per key and
block; None: as many blocks as the budget holds. Without one, every rank (and every
DataLoader worker) holds its own window; None: its share of half the node's available memory
(``auto_cache_bytes``: divided by the job's ranks on the node), rounded down to a power of two
blocks and agreed (the smallest) across the ranks when torch.distributed is initialised,
since the order depends on it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError, H5ServeError, UnsupportedDataset, falls_back
from ..hdf5.description import DatasetDescription
from ..hdf5.source import DatasetInfo
from ..order.stream_order import BlockLayout, block_unit, check_block_rows, default_block_rows
from ..segments import HEADER_SIZE
from ..util.checks import is_int
from ..util.units import format_bytes, parse_size, row_nbytes
from .blockcache import BlockCache, StreamBatch
from .chunkcache import auto_cache_bytes
from .handle import H5Handle
from .spec import BackendSpec, describe_spec
from .stream_daemon import DaemonBlocks, DaemonWindow, check_window, daemon_window

__all__ = ["StreamConfig", "StreamBackend", "StreamBatch", "resolve_stream", "window_bytes"]

log = logging.getLogger("h5serve")


@dataclass(frozen=True)
class StreamConfig:
    """The blocks of a stream dataset and how many of them a window holds."""

    layout: BlockLayout
    block_bytes: int  # one block of every key, in the source dtypes
    capacity: int  # blocks a window holds
    window_bytes: int  # what was asked for (or picked)
    block_cost: int = 0  # with a daemon: one block of every key in shared memory, headers included
    budget: int = 0  # with a daemon: its budget


def window_bytes(window: object) -> int | None:
    """``window`` as bytes (None stays None).

    Raised when it is not a size or is not positive: ConfigError."""
    if window is None:
        return None
    if isinstance(window, str):
        size = parse_size(window)
    elif is_int(window, numpy=True):
        size = int(window)
    else:
        raise ConfigError(f"window must be a size in bytes (an int, or a string like '2GiB'), got {window!r}")
    if size < 1:
        raise ConfigError(f"window must be more than 0 bytes, got {window!r}")
    return size


def _agreed(capacity: int) -> int:
    """The smallest ``capacity`` of every rank when a process group is initialised (a collective)."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return capacity
    if not (dist.is_available() and dist.is_initialized()):
        return capacity
    value = torch.tensor([capacity], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value.item())


def resolve_stream(infos: list[DatasetInfo], window: object, block_rows: object,
                   ranks: int | None = None, budget: int | None = None) -> StreamConfig:
    """The block layout and window of the datasets ``infos`` (equal rows); ``budget``: the
    daemon's, when a daemon serves the blocks.

    Raised when ``block_rows`` is not whole chunks of every key, the window is smaller than
    one block, or (with a daemon) larger than its budget: ConfigError naming the numbers."""
    total = infos[0].rows
    unit = block_unit([i.chunk_rows if i.chunked else 1 for i in infos])
    row_bytes = sum(row_nbytes(i.row_shape, i.dtype) for i in infos)
    if block_rows is None:
        rows = default_block_rows(unit, row_bytes, total)
    else:
        chunks = ", ".join(f"{i.key}: {i.chunk_rows} rows a chunk" for i in infos if i.chunked)
        rows = check_block_rows(block_rows, unit, chunks)
    layout = BlockLayout(total, rows)
    block = rows * row_bytes
    cost = block + len(infos) * HEADER_SIZE  # the daemon's segments: a header page each
    asked = window_bytes(window)
    if budget is not None and asked is not None and asked > budget:
        raise ConfigError(f"window={window!r} ({format_bytes(asked)}) is larger than the daemon's budget of "
                          f"{format_bytes(budget)}: pass a window of at most that (window=None: what the budget "
                          "holds), or start the daemon with a larger --max-memory")
    if budget is not None and asked is None:
        size, capacity = budget, budget // cost
    else:
        size = auto_cache_bytes(ranks) if asked is None else asked
        capacity = size // max(block, 1)
    if capacity < 1:
        said = ("the default window (half the node's available memory shared by its ranks)" if budget is None
                else "the daemon's budget") if asked is None else f"window={window!r}"
        raise ConfigError(
            f"{said} is {format_bytes(size)}, smaller than one block ({rows} rows x {row_bytes} bytes = "
            f"{format_bytes(block)}{'' if budget is None else f', {format_bytes(cost)} in shared memory'}): pass a "
            f"window of at least {format_bytes(block if budget is None else cost)}, or smaller blocks (block_rows=, a "
            f"multiple of {unit})")
    if asked is None and budget is None:  # ranks must agree on it: a power of two survives small differences
        capacity = _agreed(1 << (capacity.bit_length() - 1))
    capacity = min(capacity, max(layout.n_blocks, 1))
    if budget is not None:
        check_window(size, capacity, block, cost, budget)
    return StreamConfig(layout, block, capacity, size, cost, budget or 0)


class StreamBackend:
    """Rows of whole blocks: daemon segments (``name == "shm"``, ``cache`` a DaemonBlocks)
    when the node's daemon answers, else read through h5py into a BlockCache of
    ``config.capacity`` blocks (``name == "lazy"``). ``on_fallback``: called with the reason
    when no daemon serves them and the blocks are read here (None: raise it instead).

    Raised for variable-length rows or many files (not served in stream mode yet):
    UnsupportedDataset. Raised as ``resolve_stream`` is: ConfigError."""

    def __init__(self, spec: BackendSpec, window: object, block_rows: object, ranks: int | None = None,
                 on_fallback: Callable[[H5ServeError], None] | None = None,
                 description: DatasetDescription | None = None) -> None:
        if spec.files:
            raise UnsupportedDataset("mode='stream' reads one file for now; pass one file (or use mode='global')")
        if description is None:  # the file as h5py reads it (hdf5/description.py), opened once
            description = describe_spec(spec)
        infos = description.infos
        vlen = [i.key for i in infos if i.vlen]
        if vlen:
            raise UnsupportedDataset(f"mode='stream' does not serve variable-length rows yet ({', '.join(vlen)}): "
                                     "use mode='global' or 'node' for them")
        out = description.out_dtypes
        self.out_dtypes, self.total_rows = out, description.total_rows
        self.vlen_kinds = [""] * len(infos)
        self.spec, self.infos = spec, infos
        daemon = self._daemon(on_fallback)
        self.config = resolve_stream(infos, window, block_rows, ranks, None if daemon is None else daemon.budget)
        self.handle = H5Handle(spec.path, dict(spec.h5_options))
        self.cache: BlockCache | DaemonBlocks
        if daemon is None:
            self.name = "lazy"
            self.cache = BlockCache(infos, out, self.config.layout, self.config.capacity, self.handle)
        else:
            self.name = "shm"
            self.cache = DaemonBlocks(spec, infos, out, self.config.layout, self.config.capacity, daemon.budget,
                                      self.config.block_cost)
        log.info("h5serve: streaming %s in blocks of %d rows (%s), a window of %d blocks, %s", spec.path,
                 self.config.layout.block_rows, format_bytes(self.config.block_bytes), self.config.capacity,
                 "from the daemon's shared memory" if daemon else "read here through h5py")

    def _daemon(self, on_fallback: Callable[[H5ServeError], None] | None) -> DaemonWindow | None:
        try:
            return daemon_window(self.spec)
        except H5ServeError as exc:
            if on_fallback is None or not falls_back(exc):
                raise
            on_fallback(exc)
            return None

    def retain(self, batch: StreamBatch) -> None:
        """Free the blocks not in the node's window at this batch (``batch.alive``); with a
        daemon, ask for the blocks it takes next (``batch.ahead``)."""
        self.cache.retain(batch.alive)
        if isinstance(self.cache, DaemonBlocks):
            self.cache.prefetch(batch.ahead, batch.alive)

    def finish(self, batch: StreamBatch) -> None:
        """After ``batch`` was gathered: close the blocks this rank has used for the last time."""
        if isinstance(self.cache, DaemonBlocks):
            self.cache.release(batch.done)

    def gather(self, positions: torch.Tensor) -> list[Any]:
        return list(self.cache.gather(positions.numpy()))

    def close(self) -> None:
        if isinstance(self.cache, DaemonBlocks):
            self.cache.close()
        else:
            self.cache.clear()
        self.handle.close()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if isinstance(self.cache, BlockCache):  # a spawned worker reads its own blocks
            state["cache"] = BlockCache(self.infos, self.out_dtypes, self.config.layout, self.config.capacity,
                                        self.handle)
        return state
