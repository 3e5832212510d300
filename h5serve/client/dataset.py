"""SharedH5Dataset: one rank's shard, served zero-copy from the daemon or read lazily.

Both backends give the same ``indices`` and the same samples for the same local index, so a
run without a daemon is the same run, only slower.
"""

from __future__ import annotations

import operator
import os
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate

from ..errors import (
    AccessDenied,
    CapacityError,
    ConfigError,
    DaemonUnavailable,
    H5ServeError,
    ProtocolError,
    SegmentError,
)
from ..sharding import Selection, resolve_rank_world
from ..source import resolve_dtype
from .backends import Backend, BackendSpec, LazyBackend, ShmBackend

__all__ = ["SharedH5Dataset", "Batch", "collate"]

FALLBACKS = ("lazy", "error")
# Errors after which training can go on from the file itself: anything else is the user's to fix.
# AccessDenied is the daemon's policy (--allow-root), not the user's right to read the file;
# ProtocolError is a daemon of another h5serve version.
_FALLBACK_ERRORS = (DaemonUnavailable, CapacityError, SegmentError, AccessDenied, ProtocolError)


class Batch(list):
    """What ``__getitems__`` returns: a list of per-sample tuples (so ``default_collate``
    works) that also carries the gathered batch tensors ``x`` and ``y``; ``collate``
    returns those directly without stacking the samples again."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor | None) -> None:
        super().__init__(x.unbind(0) if y is None else zip(x.unbind(0), y.unbind(0)))
        self.x = x
        self.y = y


def collate(batch: Any) -> Any:
    """A ``collate_fn`` for DataLoader: the gathered tensors of a Batch, else default_collate."""
    if isinstance(batch, Batch):
        return batch.x if batch.y is None else (batch.x, batch.y)
    return default_collate(batch)


class SharedH5Dataset(Dataset):
    """This rank's shard of ``path[x_key]`` (and ``path[y_key]``).

    Rank and world size come from the arguments, else an initialized torch.distributed
    process group, else RANK / WORLD_SIZE, else 0 / 1. ``backend`` is ``"shm"`` when served
    by the daemon, ``"lazy"`` when read through h5py (``fallback="lazy"``, the default, when
    no daemon answers; ``fallback="error"`` raises DaemonUnavailable instead).

    Raised for bad arguments: ConfigError. Raised for a missing file or key, mismatched
    lengths or an unservable dtype: the DataError subclass that says which.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        x_key: str,
        y_key: str | None = None,
        *,
        mode: str = "contiguous",
        rank: int | None = None,
        world_size: int | None = None,
        dtype_x: Any = None,
        dtype_y: Any = None,
        transform: Callable[[torch.Tensor], Any] | None = None,
        target_transform: Callable[[torch.Tensor], Any] | None = None,
        fallback: str = "lazy",
        runtime_dir: str | os.PathLike[str] | None = None,
        timeout: float | None = None,
    ) -> None:
        if fallback not in FALLBACKS:
            raise ConfigError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
        for name, key in (("x_key", x_key), ("y_key", y_key)):
            if key is not None and (not isinstance(key, str) or not key):
                raise ConfigError(f"{name} must be a non-empty string naming a dataset, got {key!r}")
        self.rank, self.world_size = resolve_rank_world(rank, world_size)
        self.spec = BackendSpec(
            path=os.path.abspath(os.fspath(path)),
            x_key=x_key,
            y_key=y_key,
            selection=Selection(mode, self.world_size, self.rank),
            dtype_x=resolve_dtype(dtype_x, "dtype_x"),
            dtype_y=resolve_dtype(dtype_y, "dtype_y"),
            runtime_dir=None if runtime_dir is None else os.fspath(runtime_dir),
            timeout=timeout,
            h5_options=self._h5_options(),
        )
        self.mode = mode
        self.transform = transform
        self.target_transform = target_transform
        self.fallback = fallback
        self._backend: Backend = self._open_backend()
        self.indices: np.ndarray = self.spec.selection.indices(self._backend.total_rows)

    # ----- backend choice --------------------------------------------------------------------
    def _h5_options(self) -> dict[str, Any]:
        return {}

    def _open_backend(self) -> Backend:
        try:
            return ShmBackend.connect(self.spec, self.rank)
        except _FALLBACK_ERRORS as exc:
            if self.fallback == "error":
                raise
            self._announce_fallback(exc)
            return self._fallback_backend()

    def _announce_fallback(self, exc: H5ServeError) -> None:
        warnings.warn(
            f"h5serve: {exc}. Reading {self.spec.path} lazily through h5py instead (same rows, same "
            "order, slower); pass fallback='error' to fail instead.",
            RuntimeWarning,
            stacklevel=4,
        )

    def _fallback_backend(self) -> Backend:
        return LazyBackend(self.spec)

    @property
    def backend(self) -> str:
        """``"shm"`` (daemon), ``"lazy"`` (h5py) or ``"memory"`` (compat preload)."""
        return self._backend.name

    @property
    def total_rows(self) -> int:
        """Rows in the whole dataset, across all ranks."""
        return self._backend.total_rows

    # ----- access ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.indices)

    def _gather(self, local: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        positions = np.asarray(local, dtype=np.int64).reshape(-1)
        n = len(self.indices)
        if positions.size and (positions.min() < -n or positions.max() >= n):
            raise IndexError(f"index out of range for a shard of {n} rows")
        return self._backend.gather(np.where(positions < 0, positions + n, positions))

    def _sample(self, x: torch.Tensor, y: torch.Tensor | None) -> Any:
        if self.transform is not None:
            x = self.transform(x)
        if y is None:
            return x
        if self.target_transform is not None:
            y = self.target_transform(y)
        return x, y

    def __getitem__(self, index: int) -> Any:
        arrays = self._gather([operator.index(index)])
        x = torch.from_numpy(arrays[0][0, ...])
        y = torch.from_numpy(arrays[1][0, ...]) if len(arrays) > 1 else None
        return self._sample(x, y)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A whole batch with one vectorised gather per array (DataLoader calls this)."""
        arrays = self._gather(indices)
        x = torch.from_numpy(arrays[0])
        y = torch.from_numpy(arrays[1]) if len(arrays) > 1 else None
        if self.transform is None and self.target_transform is None:
            return Batch(x, y)
        if y is None:
            return [self._sample(xi, None) for xi in x.unbind(0)]
        return [self._sample(xi, yi) for xi, yi in zip(x.unbind(0), y.unbind(0))]

    def close(self) -> None:
        """Release the mapping and lease (or the h5py handle) held by this process."""
        self._backend.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.spec.path!r}, x_key={self.spec.x_key!r}, y_key={self.spec.y_key!r}, "
            f"mode={self.mode!r}, rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, "
            f"rows={len(self)})"
        )
