"""Stream mode's block cache: whole blocks of the file read through h5py into this process,
at most ``capacity`` blocks (and the window's bytes) at a time, and batches gathered out of them.

A block is read whole (one chunk-aligned h5py read per key, h5serve/hdf5/reads.py; of many
files, from the one file that holds it; variable-length rows in one h5py call, as offsets and
values), never row by row. Which blocks to keep: the stream sampler's batches come as ``StreamBatch``es that
carry the blocks its node's window holds at that step (``alive``); every other block is
freed before the batch is gathered, so the cache never holds more than that window, however
the batches are spread over DataLoader workers and whatever the resume point. Batches
without that hint (plain indices from another sampler) evict the least recently used block,
still within ``capacity``.

Every DataLoader worker holds a cache of its own. A cache given ``worker_room`` (the blocks the
default window holds: stream mode without a daemon and ``window=None``) takes only its share of
it in a worker, ``worker_capacity(worker_room, blocks, num_workers)``, so that a rank's workers
together hold no more than the rank would alone; make_loader sizes the sampler's window by the
same function (client/dataloader.py), so the window each worker is handed fits its share.

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
from torch.utils.data import get_worker_info

from ...hdf5.reads import read_block_into
from ...hdf5.source import DatasetInfo
from ...hdf5.vlen import gather as vlen_gather
from ...hdf5.vlen import offsets_of, read_vlen
from ...order.sharding import RowRange
from ...order.stream_order import BlockLayout
from ...util.units import row_nbytes
from ..backends.files import FileHandles
from ..gather import as_column
from ..ragged import RaggedColumn

__all__ = ["Arrays", "BlockCache", "block_nbytes", "gather_by_block", "worker_capacity"]


Arrays = np.ndarray | tuple[np.ndarray, np.ndarray]  # a key's rows of a block: fixed, or (offsets, values)


Column = torch.Tensor | np.ndarray | RaggedColumn


def gather_by_block(rows: np.ndarray, layout: BlockLayout, infos: list[DatasetInfo], out_dtypes: list[np.dtype],
                    arrays_of: Callable[[int, set[int]], list[Arrays]]) -> list[Column]:
    """The rows ``rows`` (global, int64) of every dataset, gathered a block at a time:
    ``arrays_of(block, needed)`` gives each dataset's rows of ``block`` (``needed``: every block
    this batch touches, which the source keeps while it makes room), whatever holds them (a
    block cache, a segment of the daemon's): an array, or for variable-length rows (``vlen``)
    their offsets and values; one ``take`` per block and dataset, cast per batch."""
    ids = layout.block_of(rows)
    order = np.argsort(ids, kind="stable")
    bounds = np.flatnonzero(np.diff(ids[order])) + 1
    groups = np.split(order, bounds) if len(order) else []
    needed = {int(ids[g[0]]) for g in groups}
    outs: list[Any] = [[] if i.vlen else np.empty((len(rows), *i.row_shape), dtype=i.dtype) for i in infos]
    for group in groups:
        block = int(ids[group[0]])
        _take(outs, arrays_of(block, needed), group, rows[group] - layout.bounds[block])
    columns: list[Column] = []
    for info, out, d in zip(infos, outs, out_dtypes):
        if info.vlen:
            columns.append(_ragged(out, groups, len(rows), info, d))
        else:
            columns.append(as_column(out if out.dtype == d else out.astype(d)))
    return columns


def _take(outs: list[Any], arrays: list[Arrays], group: np.ndarray, local: np.ndarray) -> None:
    """Copy the rows ``local`` of one block's ``arrays`` into ``outs`` at the batch positions
    ``group``. A function of its own so that no view of the block outlives the copy: a daemon's
    segment stays leased while any array views it, and a process that waits for room for its
    next block must hold none (client/streaming/daemon_blocks.py)."""
    for out, array in zip(outs, arrays):
        if isinstance(array, tuple):
            out.append(vlen_gather(array[0], array[1], local))
        else:
            out[group] = array.take(local, axis=0)


def _ragged(parts: list[tuple[np.ndarray, np.ndarray]], groups: list[np.ndarray], n: int, info: DatasetInfo,
            out_dtype: np.dtype) -> RaggedColumn:
    """Each block's rows of the batch (``parts``, for the positions ``groups``) put in the batch's order."""
    if len(parts) == 1:
        flat, lengths = parts[0]
    elif not parts:
        flat, lengths = np.empty(0, dtype=info.dtype), np.zeros(0, dtype=np.int64)
    else:
        where = np.empty(n, dtype=np.int64)
        where[np.concatenate(groups)] = np.arange(n)
        flat, lengths = vlen_gather(offsets_of(np.concatenate([p[1] for p in parts])),
                                    np.concatenate([p[0] for p in parts]), where)
    return RaggedColumn(flat if flat.dtype == out_dtype else flat.astype(out_dtype), lengths, info.vlen)


def worker_capacity(room: int, blocks: int, workers: int) -> int:
    """The blocks one of ``workers`` DataLoader workers (0: the rank's own process) may hold of
    a window with room for ``room`` blocks, in a file of ``blocks`` blocks: an equal share,
    at most every block (0 when the share holds none)."""
    return min(int(room) // max(int(workers), 1), max(int(blocks), 1))


def block_nbytes(arrays: list[Arrays]) -> int:
    """Bytes a block's arrays hold (variable-length rows: their offsets and values)."""
    return sum(sum(x.nbytes for x in a) if isinstance(a, tuple) else a.nbytes for a in arrays)


class BlockCache:
    """At most ``capacity`` blocks of ``layout`` of the datasets ``infos`` (one per key: the
    dtype rows are held in, for many files the set's), and never more than ``limit`` bytes
    (variable-length rows: values counted as read) unless one batch needs more, read whole
    through ``handles``; ``gather`` returns rows in ``out_dtypes``. ``file_infos[k][i]``: key
    ``k`` in file ``i`` (one file: ``[[info] for info in infos]``).

    ``worker_room`` (0: none): the blocks a window shared by a rank's DataLoader workers holds;
    in a worker the cache then holds at most ``worker_capacity(worker_room, blocks, workers)``
    blocks (and that share of ``limit``)."""

    def __init__(self, infos: list[DatasetInfo], out_dtypes: list[np.dtype], layout: BlockLayout, capacity: int,
                 handles: FileHandles, file_infos: list[list[DatasetInfo]] | None = None, limit: int = 0,
                 worker_room: int = 0) -> None:
        self.infos, self.out_dtypes, self.layout = infos, [np.dtype(d) for d in out_dtypes], layout
        self.file_infos = file_infos or [[info] for info in infos]
        self.capacity = int(capacity)
        self.handles = handles
        self.block_bytes = layout.block_rows * sum(row_nbytes(i.row_shape, i.dtype) for i in infos)
        self.limit = int(limit) or self.capacity * self.block_bytes
        self.worker_room = int(worker_room)
        self._whole = (self.capacity, self.limit)  # what the rank's own process may hold
        self._blocks: OrderedDict[int, list[Arrays]] = OrderedDict()
        self._nbytes: dict[int, int] = {}
        self._pid = os.getpid()
        self.reads = 0  # blocks read from the file by this process
        self.peak = 0  # most blocks held at once
        self.peak_bytes = 0  # most bytes held at once

    @property
    def held(self) -> list[int]:
        """The blocks held now, least recently used first."""
        self._check_pid()
        return list(self._blocks)

    @property
    def nbytes(self) -> int:
        return sum(self._nbytes.values())

    def _check_pid(self) -> None:
        if self._pid != os.getpid():  # a worker: the parent's blocks are not this process's to count
            self._blocks, self._nbytes, self._pid, self.reads, self.peak = OrderedDict(), {}, os.getpid(), 0, 0
            self.peak_bytes = 0
            self._share_among_workers()

    def _share_among_workers(self) -> None:
        """In a DataLoader worker of a cache with ``worker_room``: hold only this worker's share."""
        worker = get_worker_info()
        if not self.worker_room or worker is None:
            return
        capacity, limit = self._whole
        self.capacity = max(worker_capacity(self.worker_room, self.layout.n_blocks, worker.num_workers), 1)
        self.limit = limit * self.capacity // max(capacity, 1)

    def _drop(self, block: int) -> None:
        del self._blocks[block]
        del self._nbytes[block]

    def retain(self, alive: np.ndarray) -> None:
        """Free every held block not in ``alive``."""
        self._check_pid()
        if not self._blocks:
            return
        held = np.fromiter(self._blocks, dtype=np.int64, count=len(self._blocks))
        for block in held[~np.isin(held, alive)].tolist():  # in the time of the blocks held, not a set of the window
            self._drop(block)

    def _read(self, block: int) -> list[Arrays]:
        """Every key's rows of ``block``, read whole from the file that holds them."""
        index, a, b = self.layout.locate(block)
        handle = self.handles.get(index)
        arrays: list[Arrays] = []
        for each in self.file_infos:
            info = each[index]
            dset = handle.dataset(info.key)  # checks the file first
            if info.vlen:
                lengths, values = read_vlen(dset, info.key, info.vlen, info.dtype, slice(a, b), a, b)
                arrays.append((offsets_of(lengths), values))
                continue
            out = np.empty((b - a, *info.row_shape), dtype=info.dtype)
            # the same chunk-aligned read the lazy cache uses
            read_block_into(dset, info, RowRange.of(a, b - a), out, a, b)
            arrays.append(out)
        return arrays

    def _block(self, block: int, needed: set[int]) -> list[Arrays]:
        arrays = self._blocks.get(block)
        if arrays is not None:
            self._blocks.move_to_end(block)
            return arrays
        arrays = self._read(block)
        size = block_nbytes(arrays)
        # no hint freed room (or the values are longer than estimated): least recently used first
        while self._blocks and (len(self._blocks) >= self.capacity or self.nbytes + size > self.limit):
            # a batch spread over more blocks than the window: one it has gathered from goes
            self._drop(next((b for b in self._blocks if b not in needed), next(iter(self._blocks))))
        self._blocks[block], self._nbytes[block] = arrays, size
        self.reads += 1
        self.peak = max(self.peak, len(self._blocks))
        self.peak_bytes = max(self.peak_bytes, self.nbytes)
        return arrays

    def gather(self, rows: np.ndarray) -> list[torch.Tensor | np.ndarray | RaggedColumn]:
        """The rows ``rows`` (global, int64) of every dataset, reading the blocks that hold them
        if not held (one block at a time, so a batch spread over more blocks than ``capacity``
        still stays within it).

        Raised when the file changed since it was opened: SourceChanged; when HDF5 cannot
        read a block: DataError."""
        self._check_pid()
        return gather_by_block(rows, self.layout, self.infos, self.out_dtypes, self._block)

    def prefetch(self, ahead: np.ndarray, alive: np.ndarray) -> None:
        """Nothing: blocks read here are read when a batch needs them (DaemonBlocks asks early)."""

    def release(self, done: np.ndarray, keep: np.ndarray | None = None) -> None:
        """Nothing: ``retain`` frees what the window no longer holds (DaemonBlocks unmaps earlier)."""

    def clear(self) -> None:
        self._blocks, self._nbytes = OrderedDict(), {}

    def close(self) -> None:
        self.clear()
