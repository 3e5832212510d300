"""Stream mode without a daemon (``SharedH5Dataset(mode="stream")``): the file's blocks
(h5serve/stream_order.py) read whole through h5py into a BlockCache of at most ``window``
bytes in this process, batches gathered from the blocks held, in the stream sampler's order
(client/stream_sampler.py) — the order the daemon's shared window will serve.

``window``: bytes (``"2GiB"``, h5serve/units.parse_size) this process may hold; None: its share
of half the node's available memory (``auto_cache_bytes``: divided by the job's ranks on the
node), rounded down to a power of two blocks and agreed (the smallest) across the ranks when
torch.distributed is initialised, since the order depends on it. Without a daemon every rank
(and every DataLoader worker) holds its own window.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..checks import is_int
from ..errors import ConfigError, UnsupportedDataset
from ..hdf5.identity import open_h5
from ..hdf5.source import DatasetInfo, check_cast, check_lengths, inspect_dataset
from ..stream_order import BlockLayout, block_unit, check_block_rows, default_block_rows
from ..units import format_bytes, parse_size, row_nbytes
from .backends import BackendSpec, H5Handle
from .blockcache import BlockCache, StreamBatch
from .chunkcache import auto_cache_bytes

__all__ = ["StreamConfig", "StreamBackend", "StreamBatch", "resolve_stream", "window_bytes"]

log = logging.getLogger("h5serve")


@dataclass(frozen=True)
class StreamConfig:
    """The blocks of a stream dataset and how many of them a window holds."""

    layout: BlockLayout
    block_bytes: int  # one block of every key, in the source dtypes
    capacity: int  # blocks a window holds
    window_bytes: int  # what was asked for (or picked)


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
                   ranks: int | None = None) -> StreamConfig:
    """The block layout and window of the datasets ``infos`` (equal rows).

    Raised when ``block_rows`` is not whole chunks of every key, or the window is smaller
    than one block: ConfigError naming the numbers."""
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
    asked = window_bytes(window)
    size = auto_cache_bytes(ranks) if asked is None else asked
    capacity = size // max(block, 1)
    if capacity < 1:
        said = "the default window (half the node's available memory shared by its ranks)" if asked is None\
            else f"window={window!r}"
        raise ConfigError(
            f"{said} is {format_bytes(size)}, smaller than one block ({rows} rows x {row_bytes} bytes = "
            f"{format_bytes(block)}): pass a window of at least {format_bytes(block)}, or smaller blocks "
            f"(block_rows=, a multiple of {unit})")
    if asked is None:  # ranks must agree on it: a power of two survives small differences in free memory
        capacity = _agreed(1 << (capacity.bit_length() - 1))
    capacity = min(capacity, max(layout.n_blocks, 1))
    return StreamConfig(layout, block, capacity, size)


class StreamBackend:
    """Rows of whole blocks read through h5py into a BlockCache of ``config.capacity`` blocks.

    Raised for variable-length rows or many files (not served in stream mode yet):
    UnsupportedDataset. Raised as ``resolve_stream`` is: ConfigError."""

    name = "lazy"

    def __init__(self, spec: BackendSpec, window: object, block_rows: object, ranks: int | None = None) -> None:
        if spec.files:
            raise UnsupportedDataset("mode='stream' reads one file for now; pass one file (or use mode='global')")
        with open_h5(spec.path) as f:  # metadata only; closed before any fork
            infos = [inspect_dataset(f, key, vlen=True) for key in spec.keys]
        check_lengths(*infos)
        vlen = [i.key for i in infos if i.vlen]
        if vlen:
            raise UnsupportedDataset(f"mode='stream' does not serve variable-length rows yet ({', '.join(vlen)}): "
                                     "use mode='global' or 'node' for them")
        out = [check_cast(info, requested) for info, requested in zip(infos, spec.dtypes)]
        self.out_dtypes, self.total_rows = out, infos[0].rows
        self.vlen_kinds = [""] * len(infos)
        self.spec, self.infos = spec, infos
        self.config = resolve_stream(infos, window, block_rows, ranks)
        self.handle = H5Handle(spec.path, dict(spec.h5_options))
        self.cache = BlockCache(infos, out, self.config.layout, self.config.capacity, self.handle)
        log.info("h5serve: streaming %s in blocks of %d rows (%s), a window of %d blocks", spec.path,
                 self.config.layout.block_rows, format_bytes(self.config.block_bytes), self.config.capacity)

    def retain(self, alive: np.ndarray) -> None:
        """Free the blocks not in ``alive`` (the node's window at this step)."""
        self.cache.retain(alive)

    def gather(self, positions: torch.Tensor) -> list[Any]:
        return list(self.cache.gather(positions.numpy()))

    def close(self) -> None:
        self.cache.clear()
        self.handle.close()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        cache = BlockCache(self.infos, self.out_dtypes, self.config.layout, self.config.capacity, self.handle)
        state["cache"] = cache  # a spawned worker reads its own blocks
        return state
