"""The predecessor's two datasets as its documentation describes them, for the demo's
comparison: a private preload per rank, and a lazy reader that indexes h5py once per item.

Deliberately plain (what the predecessor did, nothing h5serve added): no batched reads, no
shared memory, no per-batch cast. ``bench/baselines.py`` measures the same two.
"""

from __future__ import annotations

from typing import Any

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["PredecessorPreload", "PredecessorLazy", "PREDECESSOR_RDCC"]

PREDECESSOR_RDCC = {"rdcc_nbytes": 256 * 1024**2, "rdcc_nslots": 1_000_003, "rdcc_w0": 0.75}


class PredecessorPreload(Dataset):
    """``RankMemCachedH5Dataset`` as documented: ``f[key][rows]`` read into this process's
    memory and cast to ``dtype_x`` (float32 by default) once, at construction."""

    def __init__(self, path: str, x_key: str, y_key: str, rows: slice = slice(None), dtype_x: Any = np.float32) -> None:
        with h5py.File(path, "r", swmr=True, **PREDECESSOR_RDCC) as f:
            x = f[x_key][rows]
            self.y = torch.from_numpy(f[y_key][rows])
        self.x = torch.from_numpy(x.astype(dtype_x))

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[idx], self.y[idx]


class PredecessorLazy(Dataset):
    """``H5LazyDataset`` as documented: a handle opened on first use in each process, with the
    predecessor's chunk cache settings; the dataset looked up and indexed once per item."""

    def __init__(self, path: str, x_key: str, y_key: str, x_dtype: Any = np.float32) -> None:
        self.path, self.x_key, self.y_key, self.x_dtype = path, x_key, y_key, x_dtype
        self._file: h5py.File | None = None
        with h5py.File(path, "r") as f:
            self._len = int(f[x_key].shape[0])

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._file is None:
            self._file = h5py.File(self.path, "r", swmr=True, **PREDECESSOR_RDCC)
        x = np.asarray(self._file[self.x_key][idx], dtype=self.x_dtype)
        return torch.from_numpy(x), torch.as_tensor(self._file[self.y_key][idx])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
