"""Catching a second sharding: a sampler that splits an already-sharded h5serve dataset or
sampler across the ranks again.

Rank-sharded datasets (contiguous, interleave, node, stream) hold only this rank's or this
node's rows, and h5serve's samplers already hand each rank its own batches. A wrapper that
shards again gives every rank a fraction of its share, silently: the job trains on 1/W of the
data. Where each such wrapper is caught, and how:

- make_loader given torch's ``DistributedSampler`` for a rank-sharded dataset: refused when it
  is given (``check_sampler``), from the objects themselves.
- Lightning's default (``use_distributed_sampler=True``) around make_loader's loader: it
  rebuilds the batch sampler as ``type(bs)(DistributedSampler(ds), ...)``, refused in the
  batch sampler's ``__init__`` (``check_not_rebuilt``), from its argument.
- Accelerate's ``prepare`` of a plain ``DataLoader(ds, shuffle=True)`` over a rank-sharded
  dataset: its ``DataLoaderShard`` calls ``dataset.set_epoch(epoch)`` at the start of every
  pass when no sampler it holds has a ``set_epoch`` (torch's RandomSampler and
  SequentialSampler have none); ``SharedH5Dataset.set_epoch`` refuses (``check_not_prepared``).
  Not caught with ``use_seedable_sampler=True`` (then Accelerate's own sampler takes the call).
- Lightning's ``DistributedSamplerWrapper`` and Accelerate's ``BatchSamplerShard`` iterating an
  h5serve sampler (make_loader's through ``prepare``; ``DataLoader(sampler=EpochShuffleSampler)``
  under either): refused in the sampler's ``__iter__`` (``check_not_resharded``) by looking at
  the caller's frames, once per epoch. Neither wrapper reads anything from the sampler that
  tells it apart from any other consumer: Lightning's only measures it (``len``) and lists it;
  Accelerate's reads ``batch_size``, ``drop_last``, ``.sampler`` and ``set_epoch``, as every
  loader and framework does, and ``prepare`` asks ``hasattr(sampler, "generator")``, which a
  property raising there would answer for anyone asking. So the frames stay here, outside
  ``len()`` and the per-batch path.

- torch's ``DistributedSampler`` over a rank-sharded dataset of more than one rank, in a
  DataLoader you build (``DataLoader(ds, sampler=DistributedSampler(ds))``) or inserted by
  Lightning's default into a plain ``DataLoader(ds, shuffle=True)``: refused in ``len(ds)``
  (``length_unless_resharded``) from the caller's frame. This is the one
  check kept on frames on purpose. A DistributedSampler only measures its dataset (``len``, in
  ``__init__`` and each ``__iter__``) and hands the DataLoader indices from its own seed and
  epoch, which look like any subset sampler's; torch and Lightning call nothing else on the
  dataset. Without the frame the job trains every rank on 1/W of its share, silently, under
  Lightning's default settings: a frame lookup per ``len()`` (never per batch) is the smaller cost.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from torch.utils.data import DistributedSampler

from ...errors import ConfigError
from ...order.sharding import GLOBAL, NODE, STREAM

__all__ = ["length_unless_resharded", "check_not_prepared", "check_not_rebuilt", "check_not_resharded",
           "check_sampler"]

# module of the wrapper -> what to tell the user
_WRAPPERS = {
    "lightning.fabric.utilities.distributed": "lightning",
    "lightning_fabric.utilities.distributed": "lightning",
    "accelerate.data_loader": "accelerate",
}
_FRAMES_TO_LOOK = 6  # the wrapper's frame is the caller's, or a few sampler/generator frames above

_FIXES = {
    "lightning": (
        "Lightning is wrapping it in a DistributedSampler (Trainer(use_distributed_sampler=True), the default), "
        "which would shard its batches a second time: each rank would train on 1/world_size of its share. Pass "
        "Trainer(use_distributed_sampler=False) and keep make_loader's loader; or, to let Lightning shard, use "
        "SharedH5Dataset(mode='global') with a plain DataLoader(ds, batch_size, shuffle=True)"
    ),
    "accelerate": (
        "accelerator.prepare(loader) shards the loader's batches across processes a second time: each process "
        "would train on 1/num_processes of its share. Do not pass this loader to prepare (build it with "
        "make_loader and prepare the model and optimizer only); or, to let Accelerate shard, use "
        "SharedH5Dataset(mode='global') with a plain DataLoader(ds, batch_size, shuffle=True) through prepare"
    ),
}


def _wrapper_in(frame: FrameType | None) -> str | None:
    """The kind of resharding wrapper among the first frames from ``frame`` up, if any."""
    for _ in range(_FRAMES_TO_LOOK):
        if frame is None:
            return None
        kind = _WRAPPERS.get(frame.f_globals.get("__name__", ""))
        if kind is not None:
            owner = frame.f_locals.get("self")
            return kind if getattr(owner, "num_processes", 2) > 1 else None  # Accelerate with one process: no split
        frame = frame.f_back
    return None


def check_not_resharded(sampler: Any) -> None:
    """Call first thing in an h5serve sampler's ``__iter__`` (a plain function returning the
    generator, so the frame above is the one iterating).

    Raised when Lightning's or Accelerate's distributed wrapper is iterating ``sampler``:
    ConfigError naming the fix.
    """
    kind = _wrapper_in(sys._getframe(2))
    if kind is not None:
        raise ConfigError(f"{type(sampler).__name__} already gives each rank its own batches; {_FIXES[kind]}")


def check_not_rebuilt(sampler_class: type, argument: object) -> None:
    """Call first thing in an h5serve batch sampler's ``__init__`` with its first argument.
    Lightning (``use_distributed_sampler=True``) rebuilds a DataLoader's batch sampler as
    ``type(batch_sampler)(DistributedSampler(dataset), batch_size=..., drop_last=...)``.

    Raised when ``argument`` is a torch Sampler where h5serve takes a length or its own
    sampler: ConfigError naming the fix.
    """
    from torch.utils.data import Sampler

    if isinstance(argument, Sampler) and not type(argument).__module__.startswith("h5serve."):
        raise ConfigError(f"{sampler_class.__name__} got a {type(argument).__name__} to wrap: {_FIXES['lightning']}")


def check_sampler(dataset: Any, sampler: object) -> None:
    """Call where a dataset is handed the sampler to draw its batches with (make_loader).

    Raised when ``sampler`` is torch's DistributedSampler and ``dataset`` a rank-sharded
    SharedH5Dataset: ConfigError naming the fix.
    """
    if isinstance(sampler, DistributedSampler) and _sharded(dataset):
        raise ConfigError(
            f"SharedH5Dataset(mode={dataset.mode!r}) holds {_held(dataset)} and h5serve's samplers deal it to the "
            f"ranks already; a DistributedSampler over {sampler.num_replicas} replicas would shard it a second time "
            f"(each rank would train on 1/{sampler.num_replicas} of its share). Use make_loader(ds, batch_size) "
            "without sampler=; or use mode='global' if you want DistributedSampler")


def length_unless_resharded(dataset: Any) -> int:
    """``len(dataset.indices)`` for its ``__len__`` of 2+ ranks (never per batch): torch's DistributedSampler
    measures its dataset in ``__init__`` and ``__iter__`` and calls nothing else on it, so the
    caller's frame is the only place it can be seen (the module's docstring says why it is kept).

    Raised when a DistributedSampler over more than one replica is measuring a rank-sharded
    ``dataset``: ConfigError naming the fix.
    """
    if not _sharded(dataset):
        return len(dataset.indices)
    caller = sys._getframe(2)
    owner = caller.f_locals.get("self") if caller is not None else None
    if isinstance(owner, DistributedSampler) and owner.num_replicas > 1:
        raise ConfigError(
            f"SharedH5Dataset(mode={dataset.mode!r}) holds {_held(dataset)}, and a DistributedSampler over "
            f"{owner.num_replicas} replicas would shard it a second time (each rank would train on 1/"
            f"{owner.num_replicas} of its share). Use make_loader(ds, batch_size) without a sampler (with "
            "Lightning: Trainer(use_distributed_sampler=False)); or use mode='global' if you want DistributedSampler")
    return len(dataset.indices)


def check_not_prepared(dataset: Any) -> None:
    """Call in a rank-sharded dataset's ``set_epoch``: Accelerate's prepared DataLoader
    (``DataLoaderShard.set_epoch``, at the start of every pass) calls ``dataset.set_epoch`` when
    no sampler it holds has one, as in ``accelerator.prepare(DataLoader(ds, shuffle=True))``.

    Raised when ``dataset`` is rank-sharded over more than one rank: ConfigError naming the fix.
    """
    if _sharded(dataset) and dataset.world_size > 1:
        raise ConfigError(f"SharedH5Dataset(mode={dataset.mode!r}) holds {_held(dataset)}, and its set_epoch was "
                          "called, as Accelerate's prepared DataLoader calls it when its sampler has none; "
                          f"{_FIXES['accelerate']}")


def _sharded(dataset: Any) -> bool:
    """Whether ``dataset`` is a SharedH5Dataset asked for a rank-sharded mode (every mode but global)."""
    mode = getattr(dataset, "requested_mode", None)
    return mode is not None and mode != GLOBAL


def _held(dataset: Any) -> str:
    shares = {NODE: "this node's rows", STREAM: "this node's blocks"}
    return shares.get(dataset.mode, f"only rank {dataset.rank}'s shard")
