"""The predecessor's datasets, written from its documentation (its `H5LazyDataset` and
`RankMemCachedH5Dataset`, whose names and signatures h5serve.client keeps), as the baselines h5serve is
measured against. Deliberately plain: what the docs describe, nothing
h5serve added (no batched reads, no shared memory, no per-batch cast).
"""

from __future__ import annotations

from typing import Any

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

SEED_RDCC = {"rdcc_nbytes": 256 * 1024**2, "rdcc_nslots": 1_000_003, "rdcc_w0": 0.75}


class SeedH5LazyDataset(Dataset):
    """h5-dataloader.md's H5LazyDataset: a handle opened lazily per process with the seed's
    chunk cache settings, the dataset looked up and indexed once per item."""

    def __init__(self, path: str, x_key: str, y_key: str | None = None, x_dtype: Any = None,
                 y_dtype: Any = None, swmr: bool = True, **rdcc: Any) -> None:
        self.path, self.x_key, self.y_key = path, x_key, y_key
        self.x_dtype, self.y_dtype, self.swmr = x_dtype, y_dtype, swmr
        self.rdcc = {**SEED_RDCC, **rdcc}
        self._file: h5py.File | None = None
        with h5py.File(path, "r") as f:
            self._len = int(f[x_key].shape[0])

    def _h5(self) -> h5py.File:
        if self._file is None:
            self._file = h5py.File(self.path, "r", swmr=self.swmr, **self.rdcc)
        return self._file

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, idx: int) -> Any:
        f = self._h5()
        x = f[self.x_key][idx]
        if self.x_dtype is not None:
            x = np.asarray(x, dtype=self.x_dtype)
        x = torch.from_numpy(np.asarray(x))
        if self.y_key is None:
            return x
        y = f[self.y_key][idx]
        if self.y_dtype is not None:
            y = np.asarray(y, dtype=self.y_dtype)
        return x, torch.as_tensor(y)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class SeedRankMemCachedDataset(Dataset):
    """rank-cached-h5-dataloader.md's RankMemCachedH5Dataset: the rank's shard read with
    ``f[key][sel]`` into private memory and cast (default float32) at start; items are
    indexed one by one and stacked by default_collate."""

    def __init__(self, path: str, x_key: str, y_key: str | None = None, *, rank: int, world_size: int,
                 mode: str = "contiguous", dtype_x: Any = np.float32, dtype_y: Any = None) -> None:
        with h5py.File(path, "r", swmr=True, **SEED_RDCC) as f:
            total = int(f[x_key].shape[0])
            if mode == "contiguous":
                base, extra = divmod(total, world_size)
                start = rank * base + min(rank, extra)
                sel: Any = slice(start, start + base + (1 if rank < extra else 0))
            else:
                sel = np.arange(rank, total, world_size)
            x = f[x_key][sel]
            y = f[y_key][sel] if y_key is not None else None
        if dtype_x is not None:
            x = x.astype(dtype_x)
        if y is not None and dtype_y is not None:
            y = y.astype(dtype_y)
        self.x = torch.from_numpy(x)
        self.y = None if y is None else torch.from_numpy(y)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, idx: int) -> Any:
        if self.y is None:
            return self.x[idx]
        return self.x[idx], self.y[idx]
