"""H5LazyDataset and h5_worker_init_fn: the predecessor's lazy reader, kept compatible.

Each process opens its own h5py handle on first use (handles are never pickled or shared
across a fork); metadata is read once in a ``with`` block at construction and closed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from ..hdf5.description import describe
from ..hdf5.reads import read_rows
from ..hdf5.source import resolve_dtype
from ..order.sharding import Selection
from .backends.chunkcache import ChunkCache
from .backends.handle import H5Handle
from .gather import as_positions

__all__ = ["H5LazyDataset", "h5_worker_init_fn"]


def _as_tensor(value: Any) -> Any:
    if isinstance(value, (np.ndarray, np.generic)) and value.dtype.kind == "S":
        return value.tolist()  # byte strings: bytes, as SharedH5Dataset returns them
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, np.generic):
        return torch.from_numpy(np.asarray(value))
    return value


def _as_numpy(column: torch.Tensor | np.ndarray) -> np.ndarray:
    return column.numpy() if isinstance(column, torch.Tensor) else column


class H5LazyDataset(Dataset):
    """Every row of ``path[x_key]`` (and ``path[y_key]``), read on demand through h5py.

    As in the predecessor, transforms receive NumPy arrays (cast to ``x_dtype``/``y_dtype``
    when given); results that are arrays come back as tensors.

    ``rdcc_nbytes`` is the chunk cache budget: when the datasets fit in it, each process keeps
    the chunks it has read (in h5serve's own cache, which gathers a batch without a call into
    HDF5 per row); otherwise HDF5's chunk cache gets ``rdcc_*`` as given.

    Raised for a missing file or key, mismatched lengths or an unservable dtype: the
    DataError subclass that says which. Raised for a bad dtype argument: ConfigError.
    """

    def __init__(
        self,
        path: str,
        x_key: str,
        y_key: str | None = None,
        x_dtype: Any = None,
        y_dtype: Any = None,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        rdcc_nbytes: int = 256 * 1024**2,
        rdcc_nslots: int = 1_000_003,
        rdcc_w0: float = 0.75,
        swmr: bool = True,
    ) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.x_key, self.y_key = x_key, y_key
        self.transform, self.target_transform = transform, target_transform
        keys = (x_key,) if y_key is None else (x_key, y_key)
        requested = (resolve_dtype(x_dtype, "x_dtype"), resolve_dtype(y_dtype, "y_dtype"))
        described = describe((self.path,), keys, requested[:len(keys)], vlen=False)
        self._infos, self._dtypes = described.infos, described.out_dtypes
        self._whole = Selection("contiguous", 1, 0)
        self._cached = sum(ChunkCache.nbytes_for(info, self._whole) for info in self._infos) <= rdcc_nbytes
        rdcc = {} if self._cached else {"rdcc_nbytes": rdcc_nbytes, "rdcc_nslots": rdcc_nslots, "rdcc_w0": rdcc_w0}
        self._handle = H5Handle(self.path, {**rdcc, "swmr": swmr})
        self._caches: list[ChunkCache] | None = None

    def __len__(self) -> int:
        return self._infos[0].rows

    def _read(self, rows: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        positions = as_positions(rows, len(self))
        if self._cached:
            if self._caches is None:
                self._caches = [ChunkCache(info, self._whole, d) for info, d in zip(self._infos, self._dtypes)]
            return [_as_numpy(cache.take(self._handle.dataset, positions)) for cache in self._caches]
        rows = positions.numpy()
        out = []
        for info, d in zip(self._infos, self._dtypes):
            dset, stored = self._handle.located(info)
            out.append(read_rows(dset, info, rows, d, stored))
        return out

    def _sample(self, x: np.ndarray, y: np.ndarray | None) -> Any:
        x = _as_tensor(self.transform(x) if self.transform is not None else x)
        if y is None:
            return x
        return x, _as_tensor(self.target_transform(y) if self.target_transform is not None else y)

    def __getitem__(self, idx: int) -> Any:
        arrays = self._read([int(idx)])
        return self._sample(arrays[0][0, ...], arrays[1][0, ...] if len(arrays) > 1 else None)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A batch with one h5py read per array (sorted, unique rows), then per-sample transforms."""
        arrays = self._read(indices)
        ys = arrays[1] if len(arrays) > 1 else [None] * len(arrays[0])
        return [self._sample(x, y) for x, y in zip(arrays[0], ys)]

    def close(self) -> None:
        """Close this process's h5py handle and drop its cache (both come back on next access)."""
        self._handle.close()
        self._caches = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_caches": None}  # a spawned worker fills its own cache

    def _drop_inherited_handles(self) -> None:
        self._handle.drop_inherited()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _drop_handles(dataset: Any) -> None:
    for inner in (getattr(dataset, "dataset", None), *getattr(dataset, "datasets", ())):
        if inner is not None:
            _drop_handles(inner)
    drop = getattr(dataset, "_drop_inherited_handles", None)
    if drop is not None:
        drop()
    backend = getattr(dataset, "_backend", None)
    handle = getattr(backend, "handle", None)
    if handle is not None:
        handle.drop_inherited()


def h5_worker_init_fn(_worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: forget HDF5 handles inherited from the parent process,
    so each worker opens its own (h5py handles must not cross a fork)."""
    info = get_worker_info()
    if info is not None:
        _drop_handles(info.dataset)
