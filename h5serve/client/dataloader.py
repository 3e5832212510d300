"""make_loader: a DataLoader with h5serve's fast path and the predecessor's best practices.

The fast path is one gather per batch: the batch sampler hands the dataset a tensor of
indices (no Python int per sample), ``__getitems__`` gathers every row of the batch at once,
and ``collate`` passes the gathered tensors through (no per-sample tensors, no second stack).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

# torch internals (stable since torch 1.x): ShmDataLoader's iterator is torch's, minus one record
from torch.utils.data._utils.pin_memory import pin_memory
from torch.utils.data.dataloader import _DatasetKind, _SingleProcessDataLoaderIter

from ..errors import ConfigError, DataError
from ..order.sharding import GLOBAL, NODE
from ..util.checks import is_int
from . import ring
from ._process import return_batch_memory
from .dataset import SharedH5Dataset, collate
from .gather import IndexBatches
from .lazy import h5_worker_init_fn
from .samplers.node import NodePlace, NodeShuffleSampler
from .samplers.resharding import check_sampler
from .samplers.shuffle import DistributedShuffleSampler, EpochBatchSampler, EpochShuffleSampler
from .streaming.sampler import StreamSampler

__all__ = ["ShmDataLoader", "make_loader", "seed_worker"]

DEFAULT_PREFETCH_FACTOR = 2


class _LeanIterator(_SingleProcessDataLoaderIter):
    """torch's single-process iterator with two shortcuts that change no batch:

    - no per-batch profiler ``record_function`` while no profiler runs (~20 us a batch here);
      with one, torch's own ``__next__`` records every batch;
    - over make_loader's batch sampler, a SharedH5Dataset and ``collate``, a batch is one call
      (``SharedH5Dataset.collated_batch``) on a view of the sampler's epoch order, checked once
      per pass, instead of an index tensor, torch's fetcher, a check per batch and a ``Batch``
      for ``collate`` to unpack. Each such step costs microseconds right after a batch's copy
      has flushed the CPU's caches (docs/performance.md).
    """

    def __init__(self, loader: DataLoader) -> None:
        super().__init__(loader)
        self._choose_path(loader)

    def _reset(self, loader: DataLoader, first_iter: bool = False) -> None:
        super()._reset(loader, first_iter)
        self._choose_path(loader)

    def _choose_path(self, loader: DataLoader) -> None:
        batches, dataset = self._sampler_iter, self._dataset
        self._next_view: Callable[[], np.ndarray] | None = None
        if (type(batches) is IndexBatches and loader.collate_fn is collate and isinstance(dataset, SharedH5Dataset)
                and dataset.plain_batches() and batches.within(len(dataset.indices))):
            self._next_view = batches.next_view
            self._collated = dataset.collated_batch
        self._fast = self._next_view is not None and not self._pin_memory

    def _next_data(self) -> Any:
        if self._next_view is None:
            return super()._next_data()
        data = self._collated(self._next_view())
        if self._pin_memory:
            data = pin_memory(data, self._pin_memory_device)
        return data

    def __next__(self) -> Any:
        if torch.autograd._profiler_enabled():
            return super().__next__()
        if self._fast:
            data = self._collated(self._next_view())  # type: ignore[misc]
        else:
            if self._sampler_iter is None:
                self._reset()  # type: ignore[call-arg]  # as torch's own __next__ calls it
            data = self._next_data()
        self._num_yielded += 1
        return data


class ShmDataLoader(DataLoader):
    """The DataLoader make_loader builds: torch's, except that with ``num_workers=0`` over a
    map-style dataset its iterator skips the profiler record of every batch while no profiler
    is running (torch.profiler still sees each batch), and over make_loader's own batch
    sampler, dataset and collate it gathers each batch in one call. The batches are the same;
    any DataLoader argument works."""

    def _get_iterator(self) -> Any:
        if self.num_workers == 0 and self._dataset_kind == _DatasetKind.Map:
            return _LeanIterator(self)
        return super()._get_iterator()


def seed_worker(worker_id: int, user_init: Callable[[int], None] | None = None, ring_slots: int = 0) -> None:
    """DataLoader ``worker_init_fn``: drop inherited HDF5 handles, seed ``random`` and NumPy
    from the worker's torch seed (distinct per worker and per epoch), keep freed batches from
    piling up in the worker's heap, hand plain batches over through a ring of ``ring_slots``
    shared slots (0: as ordinary tensors; h5serve/client/ring.py), then run ``user_init``."""
    h5_worker_init_fn(worker_id)
    return_batch_memory()
    ring.enable(ring_slots)
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)
    if user_init is not None:
        user_init(worker_id)


def shard_sizes_of(dataset: Sized) -> list[int]:
    """Every rank's shard size, from the dataset's ``shard_sizes()`` (SharedH5Dataset and its
    subclasses have it). A dataset without one is taken as this rank's whole data, the same on
    every rank (``[len(dataset)]``)."""
    method = getattr(dataset, "shard_sizes", None)
    return list(method()) if callable(method) else [len(dataset)]


def is_global(dataset: object) -> bool:
    """Whether ``dataset`` is the whole file on every rank (``SharedH5Dataset(mode="global")``)."""
    return getattr(dataset, "mode", None) == GLOBAL


def is_node(dataset: object) -> bool:
    """Whether ``dataset`` holds its node's rows (``SharedH5Dataset(mode="node")``)."""
    return getattr(dataset, "mode", None) == NODE


def node_sampler(dataset: Any, batch_size: int, shuffle: bool, seed: int, drop_last: bool,
                 arrays: bool) -> NodeShuffleSampler:
    """The NodeShuffleSampler of a node-mode dataset, placed by the dataset's layout."""
    layout = dataset.layout
    place = NodePlace(layout.local_rank, layout.local_world_size, layout.node_rank, layout.num_nodes)
    return NodeShuffleSampler(len(dataset), batch_size, place, dataset.shard_sizes(), shuffle=shuffle, seed=seed,
                              drop_last=drop_last, arrays=arrays)


def stream_sampler(dataset: Any, batch_size: int, shuffle: bool, seed: int, drop_last: bool,
                   workers: int = 0, prefetch_factor: int = DEFAULT_PREFETCH_FACTOR) -> StreamSampler:
    """The StreamSampler of a stream-mode dataset, placed by its layout, within its window (the
    default window without a daemon: each of ``workers`` DataLoader workers' share of it, which
    is what each worker's block cache holds: client/streaming/blockcache.py); told of the workers and
    their ``prefetch_factor``, so that its batches say what a worker keeps mapped between them."""
    layout, config = dataset.layout, dataset.stream.config
    place = NodePlace(layout.local_rank, layout.local_world_size, layout.node_rank, layout.num_nodes)
    return StreamSampler(config.layout, batch_size, place, config.capacity_for(workers), shuffle=shuffle, seed=seed,
                         drop_last=drop_last, block_bytes=config.block_bytes, workers=workers,
                         prefetch_factor=prefetch_factor)


def _check_has_rows(dataset: Any) -> None:
    """Raised when ``dataset`` (one with ``total_rows``: SharedH5Dataset and its kin) has no rows:
    DataError naming its files."""
    if getattr(dataset, "total_rows", None) != 0:
        return
    files: tuple[str, ...] = tuple(getattr(dataset, "files", ()))
    shown = files[0] if len(files) == 1 else f"{len(files)} files ({files[0]} ... {files[-1]})" if files else "dataset"
    raise DataError(f"{shown} has no rows: every epoch would have no batch, and training would silently do nothing. "
                    "Check that the file was written completely (and that the keys are the ones with the samples), "
                    "or pass the file that holds them")


def _batch_sampler(dataset: Any, batch_size: int, shuffle: bool, seed: int, drop_last: bool,
                   sampler: EpochShuffleSampler | DistributedShuffleSampler | NodeShuffleSampler | StreamSampler | None,
                   workers: int, prefetch_factor: int = DEFAULT_PREFETCH_FACTOR,
                   ) -> EpochBatchSampler | DistributedShuffleSampler | NodeShuffleSampler | StreamSampler:
    """The batch sampler make_loader uses: DistributedShuffleSampler over a global dataset (or
    the one passed), a StreamSampler over a stream dataset, else an EpochBatchSampler over
    ``sampler`` equalised across the shards. With ``workers``, batches are arrays (and a
    StreamSampler made here is told of them and their ``prefetch_factor``).

    Raised when the dataset has no rows at all: DataError (an epoch of no batches would train
    on nothing, silently)."""
    check_sampler(dataset, sampler)  # torch's DistributedSampler over a rank-sharded dataset
    _check_has_rows(dataset)
    arrays = workers > 0
    if getattr(dataset, "stream", None) is not None:
        if sampler is None:
            return stream_sampler(dataset, batch_size, shuffle, seed, drop_last, workers, prefetch_factor)
        if not isinstance(sampler, StreamSampler):
            raise ConfigError(f"a stream-mode dataset is read through its window in StreamSampler order; got a "
                              f"{type(sampler).__name__}: drop sampler= (make_loader builds the StreamSampler)")
        if sampler.batch_size != batch_size or sampler.total_rows != len(dataset):
            raise ConfigError(f"sampler covers {sampler.total_rows} rows in batches of {sampler.batch_size}, but the "
                              f"dataset has {len(dataset)} and batch_size is {batch_size}")
        sampler.set_workers(workers, prefetch_factor)
        return sampler
    if isinstance(sampler, StreamSampler):
        raise ConfigError("a StreamSampler reads a dataset through its window of blocks: use it with "
                          "SharedH5Dataset(mode='stream') only")
    if sampler is None and is_node(dataset):
        return node_sampler(dataset, batch_size, shuffle, seed, drop_last, arrays)
    if isinstance(sampler, (DistributedShuffleSampler, NodeShuffleSampler)):
        if sampler.data_len != len(dataset) or sampler.batch_size != batch_size:
            raise ConfigError(f"sampler covers {sampler.data_len} samples in batches of {sampler.batch_size}, but "
                              f"the dataset has {len(dataset)} and batch_size is {batch_size}")
        sampler.arrays = arrays
        return sampler
    if sampler is None and is_global(dataset):
        return DistributedShuffleSampler(len(dataset), batch_size, dataset.world_size, dataset.rank, shuffle=shuffle,
                                         seed=seed, drop_last=drop_last, drop_last_batch=drop_last, arrays=arrays)
    if sampler is None:
        sampler = EpochShuffleSampler(len(dataset), seed=seed, shuffle=shuffle)
    elif sampler.data_len != len(dataset):
        raise ConfigError(f"sampler covers {sampler.data_len} samples but the dataset has {len(dataset)}")
    return EpochBatchSampler(sampler, batch_size, drop_last, arrays=arrays, shard_sizes=shard_sizes_of(dataset),
                             mode=getattr(dataset, "mode", None))


def make_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    sampler: EpochShuffleSampler | DistributedShuffleSampler | NodeShuffleSampler | StreamSampler | None = None,
    num_workers: int = 0,
    pin_memory: bool | None = None,
    persistent_workers: bool | None = None,
    prefetch_factor: int | None = None,
    worker_init_fn: Callable[[int], None] | None = None,
    loader_class: type[DataLoader] = DataLoader,
    worker_ring: bool = True,
    **dataloader_kwargs: Any,
) -> DataLoader:
    """A DataLoader over ``dataset`` (a rank's shard) in EpochShuffleSampler order.

    - every rank gets the same number of batches per epoch, so DDP never waits for a rank
      that ran out (h5serve/order/equalise.py): with ``drop_last=False`` a shard smaller than the
      largest repeats samples of its own epoch order, from the start, up to the largest shard's
      size, and every rank yields ``ceil(largest / batch_size)`` batches (the last one as short
      on every rank); with ``drop_last=True`` every rank yields ``floor(smallest / batch_size)``
      full batches. The shard sizes come from ``dataset.shard_sizes()``; a dataset without it
      counts as unsharded. ``sampler``'s epoch length is set to match;
    - a global dataset (``SharedH5Dataset(mode="global")``: all rows on every rank) gets a
      ``DistributedShuffleSampler`` with the dataset's world size and rank: exactly the indices of
      ``DataLoader(ds, batch_size, sampler=DistributedSampler(ds, shuffle=shuffle, seed=seed,
      drop_last=drop_last), drop_last=drop_last)``, as index tensors; pass your own as ``sampler``;
    - a node dataset (``SharedH5Dataset(mode="node")``: the node's rows) gets a
      ``NodeShuffleSampler``: the node's rows permuted per epoch and dealt to its ranks, equal
      batches on every rank of every node;
    - a stream dataset (``SharedH5Dataset(mode="stream")``) gets a ``StreamSampler``: blocks
      dealt to nodes, rows drawn across the blocks in the window, equal batches on every rank;
      its batches tell the dataset which blocks to keep;
    - other datasets: batches come as index tensors (arrays, with workers) from an EpochBatchSampler
      over ``sampler`` (default: a new
      ``EpochShuffleSampler(len(dataset), seed, shuffle)``); call
      ``loader.batch_sampler.set_epoch(epoch)`` each epoch, and checkpoint with
      ``loader.batch_sampler.state_dict(consumed=...)``;
    - ``collate_fn=collate``: batches are ``(x, y)`` (or ``x``) tensors as gathered;
    - ``pin_memory`` defaults to ``torch.cuda.is_available()``;
    - with workers: ``persistent_workers=True``, ``prefetch_factor=2`` and a worker_init_fn
      that drops inherited HDF5 handles and seeds ``random``/NumPy per worker (then calls
      yours). With no CPU-heavy transform, ``num_workers=0`` is fastest (docs/performance.md);
    - ``worker_ring=True`` (with workers): each worker gathers plain batches (no transform)
      into a few shared slots that the training process maps once and copies each batch out
      of: one memcpy per batch instead of a new shared-memory file per tensor.
      ``worker_ring=False`` returns ordinary tensors, as a plain DataLoader does.

    The loader is a ``ShmDataLoader``: a DataLoader that, with ``num_workers=0``, skips torch's
    per-batch profiler record while no profiler runs and gathers each batch in one call on a
    view of the batch sampler's order (the same batches). ``loader_class``: a DataLoader
    subclass to build instead, e.g. torchdata's ``StatefulDataLoader``, whose ``state_dict()``
    then holds the batch sampler's state as of the last batch it returned (workers'
    prefetching accounted for) and resumes mid-epoch.

    Other keyword arguments go to ``loader_class`` as they are.

    Raised for a bad batch size, worker count or sampler (torch's ``DistributedSampler`` for any
    mode but global: it would shard the rank's share again), or when some rank would get no
    batch (``drop_last=True`` with a shard smaller than a batch; an empty shard): ConfigError.
    Raised when the dataset has no rows at all (a 0-row file): DataError.
    """
    if not (isinstance(loader_class, type) and issubclass(loader_class, DataLoader)):
        raise ConfigError(f"loader_class must be DataLoader or a subclass (e.g. torchdata's StatefulDataLoader), "
                          f"got {loader_class!r}")
    if not is_int(num_workers) or num_workers < 0:
        raise ConfigError(f"num_workers must be an integer >= 0, got {num_workers!r}")
    for name in ("batch_sampler", "collate_fn", "batch_size", "shuffle"):
        if name in dataloader_kwargs:
            raise ConfigError(f"make_loader sets {name} itself; build a DataLoader directly to choose your own")
    factor = DEFAULT_PREFETCH_FACTOR if prefetch_factor is None else prefetch_factor
    kwargs: dict[str, Any] = {
        # to workers, indices travel as arrays: a tensor would cost a shared-memory file per batch
        "batch_sampler": _batch_sampler(dataset, batch_size, shuffle, seed, drop_last, sampler, num_workers,
                                        factor if num_workers else 0),
        "collate_fn": collate,
        "num_workers": num_workers,
        "pin_memory": torch.cuda.is_available() if pin_memory is None else pin_memory,
    }
    if num_workers > 0:
        kwargs["persistent_workers"] = True if persistent_workers is None else persistent_workers
        kwargs["prefetch_factor"] = factor
        # a worker has at most prefetch_factor batches outstanding: one more slot never runs out
        slots = kwargs["prefetch_factor"] + 1 if worker_ring else 0
        kwargs["worker_init_fn"] = functools.partial(seed_worker, user_init=worker_init_fn, ring_slots=slots)
    elif worker_init_fn is not None or persistent_workers or prefetch_factor is not None:
        raise ConfigError("worker_init_fn, persistent_workers and prefetch_factor need num_workers > 0")
    kwargs.update(dataloader_kwargs)
    return (ShmDataLoader if loader_class is DataLoader else loader_class)(dataset, **kwargs)
