"""SharedH5Dataset: one rank's shard (or, in global mode, the whole file), served zero-copy
from the daemon or read lazily.

Both backends give the same ``indices`` and the same samples for the same local index, so a
run without a daemon is the same run, only slower.
"""

from __future__ import annotations

import operator
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate, default_collate_fn_map

from ..errors import ConfigError, H5ServeError, falls_back
from ..sharding import GLOBAL, NODE, Selection, node_selection, resolve_rank_world
from ..source import resolve_dtype
from .backends import Backend, BackendSpec, LazyBackend, ShmBackend
from . import ring
from .gather import as_positions
from .resharding import check_not_measured_by_distributed_sampler

__all__ = ["SharedH5Dataset", "Batch", "SampleList", "collate"]

FALLBACKS = ("lazy", "error")


class BatchRow(tuple):
    """One ``(x[i], y[i])`` pair of a Batch: a plain tuple to everyone, and the type by which
    ``default_collate`` recognises a whole Batch (see ``_collate_rows``)."""

    __slots__ = ()


class Batch(Sequence):
    """What ``__getitems__`` returns for (x, y) data: the gathered batch tensors ``x`` and ``y``.

    ``collate`` returns them as they are (the fast path: no per-sample objects at all), and so
    does ``default_collate`` (as the list ``[x, y]``, its usual result for tuple samples): a
    plain DataLoader without ``collate_fn`` is as fast. Indexed, it is a sequence of
    per-sample ``(x[i], y[i])`` pairs, made on demand.
    """

    __slots__ = ("x", "y")

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x = x
        self.y = y

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return BatchRow((self.x[index], self.y[index]))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return map(BatchRow, zip(self.x.unbind(0), self.y.unbind(0)))


def _collate_rows(batch: Sequence[BatchRow], *, collate_fn_map: dict | None = None) -> list[Any]:
    """``default_collate`` of BatchRow samples: a whole Batch is ``[x, y]`` at once; rows
    gathered some other way are transposed and collated as tuples always are."""
    if isinstance(batch, Batch):
        return [batch.x, batch.y]
    return [default_collate(list(samples)) for samples in zip(*batch)]


# torch's documented way to extend default_collate (the docstring of torch.utils.data's
# ``collate``): keyed on our own type only, so nothing else collates differently.
default_collate_fn_map[BatchRow] = _collate_rows


class SampleList(list):
    """What ``__getitems__`` returns for x-only data: the per-sample rows as a real list
    (``default_collate`` stacks lists and tuples only), carrying the gathered tensor ``x``
    that ``collate`` returns without stacking again."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__(x.unbind(0))
        self.x = x
        self.y = None


def collate(batch: Any) -> Any:
    """The ``collate_fn`` that goes with SharedH5Dataset: the gathered tensors of a batch as
    they are (``x`` or ``(x, y)``), anything else through ``default_collate``. In a make_loader
    worker, batches go through its ring (h5serve/client/ring.py) and arrive in the training
    process as those same tensors."""
    if isinstance(batch, ring.RingBatch):
        return batch
    if isinstance(batch, Batch):
        return batch.x, batch.y
    if isinstance(batch, SampleList):
        return batch.x
    # in a make_loader worker, a transform's tensors are stacked straight into its ring
    return ring.collate(batch) or default_collate(batch)


def _check_cache_bytes(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ConfigError(f"cache_bytes must be a number of bytes >= 0 (0: no cache) or None (auto), got {value!r}")
    return int(value)


class SharedH5Dataset(Dataset):
    """This rank's shard of ``path[x_key]`` (and ``path[y_key]``).

    ``mode``: ``"contiguous"`` (balanced slices), ``"interleave"`` (rows ``r, r+W, ...``) or
    ``"global"``: every rank's dataset is the whole file (``len(ds)`` is every row,
    ``ds.indices`` is ``arange(total)``), one segment set per node shared by every rank and
    every job whatever its world size; use it with a distributed sampler
    (``make_loader`` picks ``DistributedShuffleSampler``; ``torch.utils.data.DistributedSampler``
    works too).

    Rank and world size come from the arguments, else an initialized torch.distributed
    process group, else RANK / WORLD_SIZE, else 0 / 1. ``backend`` is ``"shm"`` when served
    by the daemon, ``"lazy"`` when read through h5py (``fallback="lazy"``, the default, when
    no daemon answers; ``fallback="error"`` raises DaemonUnavailable instead).

    The fast path: ``make_loader(ds, batch_size)``, or a DataLoader with
    ``collate_fn=h5serve.client.collate`` (one gather per batch, no per-sample tensors).
    ``cache_bytes``: the lazy backend keeps the chunks it has read in this process, up to
    the whole shard, when the shard fits in ``cache_bytes`` (default: half the memory
    available; 0: never cache, read rows through HDF5 each time).

    The daemon is trusted only when its runtime dir, socket, pidfile and segments belong to
    this user, root, or ``daemon_user`` (a shared daemon's user name or uid; default
    ``$H5SERVE_DAEMON_USER``); any other is refused like a missing daemon (a warning naming
    the path and owner, then lazy reads).

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
        cache_bytes: int | None = None,
        daemon_user: str | int | None = None,
        local_rank: int | None = None,
        local_world_size: int | None = None,
        node_rank: int | None = None,
        num_nodes: int | None = None,
    ) -> None:
        if fallback not in FALLBACKS:
            raise ConfigError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
        for name, key in (("x_key", x_key), ("y_key", y_key)):
            if key is not None and (not isinstance(key, str) or not key):
                raise ConfigError(f"{name} must be a non-empty string naming a dataset, got {key!r}")
        self.rank, self.world_size = resolve_rank_world(rank, world_size)
        self.layout = None  # node mode: the NodeLayout this rank's node was resolved from
        layout_args = (local_rank, local_world_size, node_rank, num_nodes)
        if mode == NODE:
            selection = self._node_selection(rank, world_size, *layout_args)
        elif any(a is not None for a in layout_args):
            raise ConfigError("local_rank, local_world_size, node_rank and num_nodes describe the node for "
                              f"mode='node' only (mode={mode!r}): drop them, or use mode='node'")
        else:
            selection = Selection(mode, self.world_size, self.rank)
        self.spec = BackendSpec(
            path=os.path.abspath(os.fspath(path)),
            x_key=x_key,
            y_key=y_key,
            selection=selection,
            dtype_x=resolve_dtype(dtype_x, "dtype_x"),
            dtype_y=resolve_dtype(dtype_y, "dtype_y"),
            runtime_dir=None if runtime_dir is None else os.fspath(runtime_dir),
            timeout=timeout,
            daemon_user=daemon_user,
            h5_options=self._h5_options(),
            cache_bytes=_check_cache_bytes(cache_bytes),
        )
        self.mode = mode
        self.transform = transform
        self.target_transform = target_transform
        self.fallback = fallback
        self._backend: Backend = self._open_backend()
        self.indices: np.ndarray = self.spec.selection.indices(self._backend.total_rows)

    def _node_selection(self, rank: int | None, world_size: int | None, local_rank: int | None,
                        local_world_size: int | None, node_rank: int | None, num_nodes: int | None) -> Selection:
        """Resolve which ranks share this node (h5serve.topology) and select their rows.

        Raised when the layout is contradictory or the node's ranks are not consecutive: ConfigError.
        """
        from ..topology import resolve_layout

        self.layout = resolve_layout(rank=rank, world_size=world_size, local_rank=local_rank,
                                     local_world_size=local_world_size, node_rank=node_rank, num_nodes=num_nodes)
        self.rank, self.world_size = self.layout.rank, self.layout.world_size
        return node_selection(self.world_size, self.layout.ranks)

    # ----- backend choice --------------------------------------------------------------------
    def _h5_options(self) -> dict[str, Any]:
        return {}

    def _open_backend(self) -> Backend:
        try:
            return ShmBackend.connect(self.spec, self.rank)
        except H5ServeError as exc:  # errors.py decides which ones lazy reads can stand in for
            if self.fallback == "error" or not falls_back(exc):
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

    def shard_sizes(self) -> list[int]:
        """Rows in every rank's shard, rank 0 first: what make_loader gives every rank the
        same number of batches from (global mode: every rank has all rows)."""
        return self.spec.selection.sizes(self.total_rows)

    # ----- access ----------------------------------------------------------------------------
    def __len__(self) -> int:
        if self.mode != GLOBAL and self.world_size > 1:
            check_not_measured_by_distributed_sampler(self)
        return len(self.indices)

    def _gather(self, local: Sequence[int] | np.ndarray | torch.Tensor) -> list[torch.Tensor]:
        return self._backend.gather(as_positions(local, len(self.indices)))

    def _sample(self, x: torch.Tensor, y: torch.Tensor | None) -> Any:
        if self.transform is not None:
            x = self.transform(x)
        if y is None:
            return x
        if self.target_transform is not None:
            y = self.target_transform(y)
        return x, y

    def __getitem__(self, index: int) -> Any:
        tensors = self._gather([operator.index(index)])
        return self._sample(tensors[0][0], tensors[1][0] if len(tensors) > 1 else None)

    def __getitems__(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> Sequence[Any]:
        """A whole batch with one vectorised gather per array (DataLoader calls this): a Batch
        (or SampleList) for ``collate``, or per-sample results when there are transforms. In a
        make_loader worker, a plain batch is gathered into the worker's ring (h5serve/client/ring.py)."""
        if ring.active() and self.transform is None and self.target_transform is None:
            tensors = ring.gather(self._backend, as_positions(indices, len(self.indices)))
            if isinstance(tensors, ring.RingBatch):
                return tensors
        else:
            tensors = self._gather(indices)
        x, y = tensors[0], (tensors[1] if len(tensors) > 1 else None)
        if self.transform is None and self.target_transform is None:
            return SampleList(x) if y is None else Batch(x, y)
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
