"""Catching a second sharding: a sampler that splits an already-sharded h5serve dataset or
sampler across the ranks again.

Rank-sharded datasets (contiguous, interleave, node) hold only this rank's or this node's
rows, and h5serve's samplers already hand each rank its own batches. A wrapper that shards
again gives every rank a fraction of its share, silently: the job trains on 1/W of the data.
Three wrappers do that without being asked:

- torch's ``DistributedSampler(dataset)`` over a sharded dataset (Lightning inserts one into a
  plain DataLoader by default);
- Lightning's ``DistributedSamplerWrapper`` around a custom sampler;
- Accelerate's ``BatchSamplerShard`` (``accelerator.prepare(loader)``) around any batch sampler.

None of them tells the wrapped object who is calling, so the check looks at the caller's
frame: one frame lookup per ``len()`` or per epoch, no cost per sample. It is best effort: a
wrapper not listed here, or one that copies the indices elsewhere first, is not seen.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from torch.utils.data import DistributedSampler

from ...errors import ConfigError

__all__ = ["check_not_measured_by_distributed_sampler", "check_not_rebuilt", "check_not_resharded"]

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


def check_not_measured_by_distributed_sampler(dataset: Any) -> None:
    """Call in a rank-sharded dataset's ``__len__``: torch's DistributedSampler measures its
    dataset in ``__init__`` and ``__iter__``, the samplers under Accelerate's
    ``BatchSamplerShard`` in ``__iter__``.

    Raised when a DistributedSampler over more than one replica, or Accelerate's wrapper, is
    measuring ``dataset``: ConfigError naming the fix.
    """
    caller = sys._getframe(2)
    owner = caller.f_locals.get("self") if caller is not None else None
    if not isinstance(owner, DistributedSampler) or owner.num_replicas <= 1:
        if _wrapper_in(caller) == "accelerate":
            raise ConfigError(f"SharedH5Dataset(mode={dataset.mode!r}) holds {_held(dataset)}; {_FIXES['accelerate']}")
        return
    raise ConfigError(
        f"SharedH5Dataset(mode={dataset.mode!r}) holds {_held(dataset)}, and a DistributedSampler over "
        f"{owner.num_replicas} replicas would shard it a second time (each rank would train on 1/"
        f"{owner.num_replicas} of its share). Use make_loader(ds, batch_size) without a sampler (with Lightning: "
        "Trainer(use_distributed_sampler=False)); or use mode='global' if you want DistributedSampler"
    )


def _held(dataset: Any) -> str:
    return "this node's rows" if dataset.mode == "node" else f"only rank {dataset.rank}'s shard"
