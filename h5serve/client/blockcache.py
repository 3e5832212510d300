"""Stream mode's block cache: whole blocks of the file read through h5py into this process,
at most ``capacity`` blocks at a time, and batches gathered out of them.

A block is read whole (one chunk-aligned h5py read per key, h5serve/hdf5/reads.py), never
row by row. Which blocks to keep: the stream sampler's batches come as ``StreamBatch``es that
carry the blocks its node's window holds at that step (``alive``); every other block is
freed before the batch is gathered, so the cache never holds more than that window, however
the batches are spread over DataLoader workers and whatever the resume point. Batches
without that hint (plain indices from another sampler) evict the least recently used block,
still within ``capacity``.

Every read goes through ``H5Handle.dataset``, which checks that the file has not been
truncated or rewritten since this process opened it (SourceChanged), as the lazy path does.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..hdf5.reads import read_block_into
from ..hdf5.source import DatasetInfo
from ..order.sharding import RowRange
from ..order.stream_order import BlockLayout
from ..util.units import row_nbytes
from .backends import H5Handle
from .gather import as_column

__all__ = ["StreamBatch", "BlockCache", "gather_by_block"]


def gather_by_block(rows: np.ndarray, block_rows: int, infos: list[DatasetInfo], out_dtypes: list[np.dtype],
                    arrays_of: Callable[[int, set[int]], list[np.ndarray]]) -> list[torch.Tensor | np.ndarray]:
    """The rows ``rows`` (global, int64) of every dataset, gathered a block at a time:
    ``arrays_of(block, needed)`` gives each dataset's rows of ``block`` (``needed``: every block
    this batch touches, which the source keeps while it makes room), whatever holds them (a
    block cache, a segment of the daemon's); one ``take`` per block and dataset, cast per batch."""
    ids = rows // block_rows
    order = np.argsort(ids, kind="stable")
    bounds = np.flatnonzero(np.diff(ids[order])) + 1
    groups = np.split(order, bounds) if len(order) else []
    needed = {int(ids[g[0]]) for g in groups}
    outs = [np.empty((len(rows), *i.row_shape), dtype=i.dtype) for i in infos]
    for group in groups:
        block = int(ids[group[0]])
        local = rows[group] - block * block_rows
        for out, array in zip(outs, arrays_of(block, needed)):
            out[group] = array.take(local, axis=0)
    return [as_column(out if out.dtype == d else out.astype(d)) for out, d in zip(outs, out_dtypes)]


class StreamBatch:
    """A stream sampler's batch: ``rows`` (int64 global rows, in order); ``alive``, the
    blocks the node's window holds at this step (the cache frees any other); ``ahead``, the
    blocks the window takes next, by first use (a daemon-backed window asks for them early:
    client/stream_daemon.py); ``done``, the blocks whose last use on this rank is this batch."""

    __slots__ = ("rows", "alive", "ahead", "done")

    def __init__(self, rows: np.ndarray, alive: np.ndarray, ahead: np.ndarray | None = None,
                 done: np.ndarray | None = None) -> None:
        self.rows = rows
        self.alive = alive
        self.ahead = _EMPTY if ahead is None else ahead
        self.done = _EMPTY if done is None else done

    def __len__(self) -> int:
        return len(self.rows)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.rows if dtype is None else self.rows.astype(dtype)

    def __reduce__(self) -> tuple[Any, ...]:
        return (StreamBatch, (self.rows, self.alive, self.ahead, self.done))

    def __repr__(self) -> str:
        return (f"StreamBatch(rows={len(self.rows)}, alive={self.alive.tolist()}, ahead={self.ahead.tolist()}, "
                f"done={self.done.tolist()})")


_EMPTY = np.zeros(0, dtype=np.int64)


class BlockCache:
    """At most ``capacity`` blocks of ``layout`` of the datasets ``infos`` (source dtypes),
    read whole through ``handle``; ``gather`` returns rows in ``out_dtypes``."""

    def __init__(self, infos: list[DatasetInfo], out_dtypes: list[np.dtype], layout: BlockLayout, capacity: int,
                 handle: H5Handle) -> None:
        self.infos, self.out_dtypes, self.layout = infos, [np.dtype(d) for d in out_dtypes], layout
        self.capacity = int(capacity)
        self.handle = handle
        self.block_bytes = layout.block_rows * sum(row_nbytes(i.row_shape, i.dtype) for i in infos)
        self._blocks: OrderedDict[int, list[np.ndarray]] = OrderedDict()
        self._pid = os.getpid()
        self.reads = 0  # blocks read from the file by this process
        self.peak = 0  # most blocks held at once

    @property
    def held(self) -> list[int]:
        """The blocks held now, least recently used first."""
        self._check_pid()
        return list(self._blocks)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for arrays in self._blocks.values() for a in arrays)

    def _check_pid(self) -> None:
        if self._pid != os.getpid():  # a forked worker: the parent's blocks are not this process's to count
            self._blocks, self._pid, self.reads, self.peak = OrderedDict(), os.getpid(), 0, 0

    def retain(self, alive: np.ndarray) -> None:
        """Free every held block not in ``alive``."""
        self._check_pid()
        keep = set(np.asarray(alive).tolist())
        for block in [b for b in self._blocks if b not in keep]:
            del self._blocks[block]

    def _block(self, block: int, needed: set[int]) -> list[np.ndarray]:
        arrays = self._blocks.get(block)
        if arrays is not None:
            self._blocks.move_to_end(block)
            return arrays
        while len(self._blocks) >= self.capacity:  # no hint freed room: the least recently used goes
            victim = next((b for b in self._blocks if b not in needed), next(iter(self._blocks)))
            del self._blocks[victim]
        a, b = self.layout.span(block)
        rows = RowRange.of(a, b - a)
        arrays = []
        for info in self.infos:
            out = np.empty((b - a, *info.row_shape), dtype=info.dtype)
            # the same chunk-aligned read the lazy cache uses; dataset() checks the file first
            read_block_into(self.handle.dataset(info.key), info, rows, out, a, b)
            arrays.append(out)
        self._blocks[block] = arrays
        self.reads += 1
        self.peak = max(self.peak, len(self._blocks))
        return arrays

    def gather(self, rows: np.ndarray) -> list[torch.Tensor | np.ndarray]:
        """The rows ``rows`` (global, int64) of every dataset, reading the blocks that hold them
        if not held (one block at a time, so a batch spread over more blocks than ``capacity``
        still stays within it).

        Raised when the file changed since it was opened: SourceChanged; when HDF5 cannot
        read a block: DataError."""
        self._check_pid()
        return gather_by_block(rows, self.layout.block_rows, self.infos, self.out_dtypes, self._block)

    def clear(self) -> None:
        self._blocks = OrderedDict()
