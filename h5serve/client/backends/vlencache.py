"""The lazy backend's cache of variable-length rows: a shard's rows kept in this process as
blocks of them are read (the ChunkCache of h5serve/client/backends/chunkcache.py, for vlen keys).

A batch reads the blocks of rows it touches that are not cached yet (one h5py call per block,
HDF5's per-element conversion paid once per row), and is gathered out of the cached blocks: a
vectorised gather per block touched, then one more into the batch's order. Once every block is
cached they are joined into one offsets/values pair, and batches cost what the shm path
costs. Values are cached in the source dtype and cast per batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ...hdf5.source import DatasetInfo
from ...hdf5.vlen import gather, offsets_of, read_vlen
from ...order.sharding import RowRange, Selection, as_rows
from ..ragged import RaggedColumn, RaggedSource

__all__ = ["VlenCache"]

BLOCK_VALUE_BYTES = 1 << 20  # about this many bytes of values per block read
MIN_BLOCK_ROWS, MAX_BLOCK_ROWS = 256, 65_536


class VlenCache:
    """One variable-length key's shard, filled a block of rows at a time on first touch."""

    def __init__(self, info: DatasetInfo, selection: Selection | RowRange, out_dtype: np.dtype,
                 block_rows: int | None = None) -> None:
        self.info = info
        self.selection = as_rows(selection, info.rows)
        self.count = len(self.selection)
        self.out_dtype = np.dtype(out_dtype)
        if block_rows is None:
            per_row = max(info.mean_length * info.dtype.itemsize, 1.0)
            block_rows = int(min(max(BLOCK_VALUE_BYTES // per_row, MIN_BLOCK_ROWS), MAX_BLOCK_ROWS))
        self.block_rows = block_rows
        self.blocks: list[tuple[np.ndarray, np.ndarray] | None] = [None] * -(-self.count // block_rows)
        self.missing = len(self.blocks)
        self.whole: RaggedSource | None = None if self.missing else self._join()

    @staticmethod
    def nbytes_for(info: DatasetInfo, selection: Selection | RowRange) -> int:
        """About what the cache holds once every row has been read (from the mean length of
        the first rows)."""
        return int(len(as_rows(selection, info.rows)) * (8 + info.mean_length * info.dtype.itemsize))

    def _read(self, dset: Any, b: int) -> None:
        k0 = b * self.block_rows
        k1 = min(k0 + self.block_rows, self.count)
        s = self.selection
        a, stop = s.start + k0 * s.step, s.start + (k1 - 1) * s.step + 1
        lengths, values = read_vlen(dset, self.info.key, self.info.vlen, self.info.dtype, slice(a, stop, s.step), a,
                                    stop)
        self.blocks[b] = (offsets_of(lengths), values)
        self.missing -= 1

    def _join(self) -> RaggedSource:
        """Every block as one offsets/values pair (the blocks are dropped)."""
        parts = [p for p in self.blocks if p is not None]
        lengths = np.concatenate([np.diff(o) for o, _ in parts]) if parts else np.zeros(0, np.int64)
        values = np.concatenate([v for _, v in parts]) if parts else np.empty(0, self.info.dtype)
        self.blocks = []
        return RaggedSource(offsets_of(lengths), values, self.out_dtype, self.info.vlen)

    def take(self, dataset: Callable[[str], Any], positions: torch.Tensor) -> RaggedColumn:
        """Rows at ``positions``, reading the blocks that hold them first if not yet read
        (through ``dataset(key)``, called only then).

        Raised when HDF5 cannot read a block: DataError (the block stays unread).
        """
        if self.whole is not None:
            return self.whole.take(positions)
        pos = positions.numpy()
        owner = pos // self.block_rows
        touched = np.unique(owner).tolist()
        unread = [b for b in touched if self.blocks[b] is None]
        if unread:
            dset = dataset(self.info.key)
            for b in unread:
                self._read(dset, b)
            if not self.missing:
                self.whole = self._join()
                return self.whole.take(positions)
        # per block touched, its rows; then the batch's order out of them
        order = np.argsort(owner, kind="stable")
        bounds = np.searchsorted(owner[order], touched + [touched[-1] + 1] if touched else [0])
        flats, lengths = [], []
        for i, b in enumerate(touched):
            offsets, values = self.blocks[b]
            flat, n = gather(offsets, values, pos[order[bounds[i]:bounds[i + 1]]] - b * self.block_rows)
            flats.append(flat)
            lengths.append(n)
        by_block = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        where = np.empty(len(pos), dtype=np.int64)
        where[order] = np.arange(len(pos))
        flat, n = gather(offsets_of(by_block), np.concatenate(flats) if flats else np.empty(0, self.info.dtype),
                         where)
        return RaggedColumn(flat.astype(self.out_dtype, copy=False), n, self.info.vlen)
