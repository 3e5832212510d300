"""The lazy backend's chunk cache: a shard's rows kept in this process as their chunks are read.

Reading scattered rows through h5py costs tens of microseconds a row (a shuffled batch of 256
rows touches ~256 chunks), so the lazy path reads each chunk the batch touches once, whole and
aligned, into a shard-sized array, and gathers batches out of that array afterwards. After one
epoch every row is in memory and a batch costs what the shm path costs; before that, each chunk
is decompressed once instead of once per row.

The cache holds rows in the source dtype (the cast to the requested dtype happens per batch),
grows only as chunks are touched, and lives in this process: DataLoader workers each fill
their own (forked workers share what the parent had already filled, copy-on-write).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import h5py
import numpy as np
import torch

from ...errors import DataError
from ...hdf5.reads import read_block_into, read_rows
from ...hdf5.source import DatasetInfo
from ...order.sharding import RowRange, Selection, as_rows
from ...util.units import row_nbytes
from ..gather import RowSource, as_column

__all__ = ["ChunkCache", "auto_cache_bytes", "hdf5_cache_options", "local_ranks"]

AUTO_CACHE_FRACTION = 0.5  # of MemAvailable: the most one lazy dataset caches by default
MIN_READ_BYTES = 1 << 20  # small chunks are read a run at a time: each h5py call costs ~30 us


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def local_ranks() -> int:
    """How many ranks of this job share the node, as the launcher says (torchrun's
    ``LOCAL_WORLD_SIZE``); 1 when not launched by one."""
    try:
        return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


def auto_cache_bytes(ranks: int | None = None) -> int:
    """The default cache budget of one rank: AUTO_CACHE_FRACTION of the node's memory
    available now, shared by the ``ranks`` ranks on the node (default: ``local_ranks()``),
    so that every rank caching its shard stays within that fraction of the node together."""
    return int(_mem_available() * AUTO_CACHE_FRACTION) // (ranks or local_ranks())


def _next_prime(n: int) -> int:
    def prime(k: int) -> bool:
        return k >= 2 and all(k % d for d in range(2, int(k**0.5) + 1))

    while not prime(n):
        n += 1
    return n


def hdf5_cache_options(info: DatasetInfo, budget: int) -> dict[str, int]:
    """HDF5 chunk cache settings for reading ``info`` uncached, sized from its chunk shape:
    room for the chunks one shuffled batch touches (up to 256), within ``budget``."""
    chunk = max(row_nbytes(info.row_shape, info.dtype) * info.chunk_rows, 1)
    nbytes = int(min(max(256 * chunk, 4 << 20), max(budget, 1 << 20), 1 << 30))
    return {"rdcc_nbytes": nbytes, "rdcc_nslots": _next_prime(max(100 * (nbytes // chunk), 521))}


class ChunkCache:
    """One array's shard, filled a block of whole chunks at a time on first touch; gathers like RowSource."""

    def __init__(self, info: DatasetInfo, selection: Selection | RowRange, out_dtype: np.dtype) -> None:
        self.info = info
        self.selection = as_rows(selection, info.rows)
        count = len(self.selection)
        self.first, self.step = self.selection.start, self.selection.step
        last = self.first + (count - 1) * self.step + 1 if count else self.first
        self.block_rows = self._block_rows(info)
        self.block0 = self.first // self.block_rows
        self.loaded = np.zeros(max(-(-last // self.block_rows) - self.block0, 0), dtype=bool)
        self.missing = int(self.loaded.size) if count else 0
        self.data = np.empty((count, *info.row_shape), dtype=info.dtype)  # pages arrive as chunks do
        self.rows = RowSource(self.data, out_dtype)
        self._buffer: np.ndarray | None = None

    @staticmethod
    def _block_rows(info: DatasetInfo) -> int:
        """Rows read at a time: whole chunks, at least MIN_READ_BYTES of them (any rows when
        the dataset is not chunked)."""
        per_row = max(row_nbytes(info.row_shape, info.dtype), 1)
        if not info.chunked:
            return max(MIN_READ_BYTES // per_row, 1)
        return info.chunk_rows * max(MIN_READ_BYTES // (per_row * info.chunk_rows), 1)

    @staticmethod
    def nbytes_for(info: DatasetInfo, selection: Selection | RowRange) -> int:
        """What the cache holds once every row has been read."""
        return len(as_rows(selection, info.rows)) * row_nbytes(info.row_shape, info.dtype)

    def take(self, dataset: Callable[[str], h5py.Dataset], positions: torch.Tensor) -> torch.Tensor | np.ndarray:
        """Rows at ``positions``, reading the chunks that hold them first if not yet read
        (through ``dataset(key)``, called only then).

        Raised when HDF5 cannot read a chunk: DataError (the chunk stays unread).
        """
        if self.missing:
            dset = dataset(self.info.key)
            rows = self.first + positions.numpy() * self.step
            blocks = np.unique(rows // self.block_rows) - self.block0
            damaged = False
            for c in blocks[~self.loaded[blocks]].tolist():
                a = (self.block0 + c) * self.block_rows
                try:
                    _, _, self._buffer = read_block_into(
                        dset, self.info, self.selection, self.data, a, a + self.block_rows, self._buffer
                    )
                except DataError:
                    damaged = True  # the block stays unread; asked again, it fails again
                    continue
                self.loaded[c] = True
                self.missing -= 1
            if damaged:
                # Serve this batch straight from HDF5, a chunk run at a time: rows of good chunks
                # still read, and the error names the rows of the damaged chunk.
                return as_column(read_rows(dset, self.info, rows, self.rows.out_dtype))
            if not self.missing:
                self._buffer = None
        return self.rows.take(positions)
