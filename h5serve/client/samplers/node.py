"""NodeShuffleSampler: node mode's order. Each epoch a node's rows (the union of its ranks'
contiguous shards, ``SharedH5Dataset(mode="node")``) are permuted from ``(seed, epoch, node)``
and dealt to the node's local ranks, every rank of every node the same number of samples and
batches (h5serve/order/equalise.py over every rank's shard size)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from ...errors import ConfigError
from ...order.equalise import EpochSize, check_batch_size, equal_epoch_size
from ...util.checks import is_int
from .resharding import check_not_rebuilt, check_not_resharded
from .shuffle import check_state_origin, counted_batches, wrap_order

__all__ = ["NodeShuffleSampler", "NodePlace", "node_generator"]

_STATE_KEYS = ("sampler", "mode", "data_len", "total_rows", "seed", "shuffle", "drop_last", "epoch", "world_size",
               "num_nodes", "node_rank", "local_rank", "local_world_size", "consumed", "consumed_global")


def _count(name: str, value: object, low: int = 0) -> int:
    if not is_int(value, numpy=True) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class NodePlace:
    """Where a rank sits for dealing: ``local_rank`` of ``local_world_size`` ranks on node
    ``node_rank`` of ``num_nodes``.

    Raised when a field is out of range: ConfigError.
    """

    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int

    def __post_init__(self) -> None:
        _count("local_world_size", self.local_world_size, 1)
        _count("num_nodes", self.num_nodes, 1)
        if not 0 <= _count("local_rank", self.local_rank) < self.local_world_size:
            raise ConfigError(f"local_rank must be in [0, {self.local_world_size - 1}], got {self.local_rank}")
        if not 0 <= _count("node_rank", self.node_rank) < self.num_nodes:
            raise ConfigError(f"node_rank must be in [0, {self.num_nodes - 1}], got {self.node_rank}")


def node_generator(seed: int, epoch: int, node: int) -> torch.Generator:
    """A torch generator seeded from ``(seed, epoch, node)`` alone: the same on every rank of
    the node and on every backend, different for every epoch and node."""
    state = np.random.SeedSequence([int(seed) % 2**64, int(epoch) % 2**64, int(node)]).generate_state(1, np.uint64)
    generator = torch.Generator()
    generator.manual_seed(int(state[0]) & (2**63 - 1))
    return generator


class NodeShuffleSampler(Sampler[torch.Tensor]):
    """Batches, as int64 index tensors into a node-mode dataset (local positions
    ``0..data_len-1`` of the node's rows), for one rank of the node.

    Each epoch the node's ``data_len`` rows are permuted from ``(seed, epoch, node_rank)``
    (``shuffle=False``: file order); the permutation is padded by repeating it from its start
    (``drop_last=False``), or cut (``drop_last=True``), to ``samples * local_world_size``, and
    local rank ``l`` takes positions ``l, l + L, ...``: the node's ranks together see every row
    of the node once per epoch (padding aside). ``samples`` comes from ``equal_epoch_size`` over
    ``shard_sizes``, every rank's contiguous shard size (``SharedH5Dataset.shard_sizes()``), so
    every rank of every node yields the same samples and batches, whatever the layout.

    ``set_epoch(epoch)`` before each epoch. ``state_dict(consumed=n)`` records seed, epoch, the
    layout and the samples consumed (``n`` per rank, ``n * world_size`` globally);
    ``load_state_dict`` resumes exactly with the same layout, and with
    ``next_epoch=True`` at the next epoch's start with any layout. ``arrays=True``: numpy arrays
    (for DataLoader workers).

    Raised for a bad size, place, batch size or shard sizes, a node with more rows than its
    ranks' shards hold, or when ``drop_last`` would leave every rank without a batch: ConfigError.
    """

    mode = "node"

    def __init__(self, data_len: int, batch_size: int, place: NodePlace | None = None,
                 shard_sizes: Sequence[int] | None = None, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, arrays: bool = False) -> None:
        check_not_rebuilt(type(self), data_len)
        self.data_len = _count("data_len", data_len)
        check_batch_size(batch_size)
        if shard_sizes is None:
            raise ConfigError("NodeShuffleSampler needs shard_sizes, every rank's shard size (ds.shard_sizes())")
        if not isinstance(place, NodePlace):
            raise ConfigError(f"place must be a NodePlace, got {type(place).__name__}")
        self.place, self.batch_size = place, batch_size
        self.shard_sizes = [_count("shard size", s) for s in shard_sizes]
        self.shuffle, self.seed, self.drop_last, self.arrays = bool(shuffle), int(seed), bool(drop_last), bool(arrays)
        self.epoch_size: EpochSize = equal_epoch_size(self.shard_sizes, batch_size, self.drop_last)
        self._check_fits()
        self.epoch = 0
        self._start = 0  # where the next iteration begins (after load_state_dict)
        self._yielded = 0  # samples handed out in the current epoch

    def _check_fits(self) -> None:
        """Raised when the node's rows cannot be dealt: ConfigError."""
        if len(self.shard_sizes) < self.place.local_world_size:
            raise ConfigError(f"{self.place.local_world_size} ranks on this node, but shard sizes of only "
                              f"{len(self.shard_sizes)} ranks: pass every rank's shard size")
        if self.epoch_size.samples and self.data_len == 0:
            raise ConfigError("this node holds no rows, so its ranks cannot yield the other ranks' batches: "
                              "use fewer ranks than the dataset has rows")
        if self.drop_last and self.epoch_size.samples * self.place.local_world_size > self.data_len:
            raise ConfigError(
                f"drop_last: {self.place.local_world_size} ranks x {self.epoch_size.samples} samples exceed the "
                f"node's {self.data_len} rows: pass the shard sizes of this dataset's world")

    @property
    def world_size(self) -> int:
        return len(self.shard_sizes)

    @property
    def total_rows(self) -> int:
        return sum(self.shard_sizes)

    def set_epoch(self, epoch: int) -> None:
        if int(epoch) != self.epoch:
            self._start = 0  # a pending resume applies to the epoch it was saved in only
        self.epoch = int(epoch)

    @property
    def sampler(self) -> NodeShuffleSampler:
        """Itself: Lightning sets each epoch through ``loader.batch_sampler.sampler.set_epoch``."""
        return self

    def node_order(self) -> torch.Tensor:
        """This epoch's order of the whole node, padded or cut to ``samples * local_world_size``."""
        if self.shuffle:
            order = torch.randperm(self.data_len, generator=node_generator(self.seed, self.epoch,
                                                                           self.place.node_rank))
        else:
            order = torch.arange(self.data_len)
        return wrap_order(order, self.epoch_size.samples * self.place.local_world_size)

    def indices(self) -> torch.Tensor:
        """This rank's ``samples`` indices for the epoch."""
        return self.node_order()[self.place.local_rank :: self.place.local_world_size]

    def __iter__(self) -> Iterator[torch.Tensor]:
        check_not_resharded(self)
        start, self._start = self._start, 0
        self._yielded = start
        return counted_batches(self, self.indices()[start:])

    def __len__(self) -> int:
        left = max(self.epoch_size.samples - self._start, 0)
        return -(-left // self.batch_size)

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """What to checkpoint next to the model. ``consumed``: samples of this epoch this rank
        has trained on (default: handed out so far; with workers pass
        ``batches_done * batch_size``: they prefetch)."""
        consumed = self._yielded if consumed is None else int(consumed)
        if not 0 <= consumed <= self.epoch_size.samples:
            raise ConfigError(f"consumed must be in [0, {self.epoch_size.samples}] (samples per rank per epoch), "
                              f"got {consumed}")
        p = self.place
        return {"sampler": type(self).__name__, "mode": self.mode, "data_len": self.data_len,
                "total_rows": self.total_rows, "seed": self.seed, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "epoch": self.epoch, "world_size": self.world_size,
                "num_nodes": p.num_nodes, "node_rank": p.node_rank, "local_rank": p.local_rank,
                "local_world_size": p.local_world_size, "consumed": consumed,
                "consumed_global": consumed * self.world_size}

    def load_state_dict(self, state: dict[str, Any], *, next_epoch: bool = False) -> None:
        """Resume from ``state_dict()``: the next iteration continues that epoch at the sample
        it stopped at. ``next_epoch=True``: start at the beginning of the next epoch instead
        (works with any layout and world size).

        Raised when the state is malformed, from another sampler kind, mode or file length, or
        (without ``next_epoch``) from another layout, ``drop_last`` or batch size: ConfigError.
        """
        check_state_origin(self, state, _STATE_KEYS, "total_rows", self.total_rows)
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        if next_epoch:
            self.epoch, self._start, self._yielded = int(state["epoch"]) + 1, 0, 0
            return
        self._check_same_layout(state)
        self.epoch, self._start = int(state["epoch"]), int(state["consumed"])
        self._yielded = self._start

    def _check_same_layout(self, state: dict[str, Any]) -> None:
        """Raised when ``state`` cannot continue mid-epoch here: ConfigError."""
        p = self.place
        saved = {k: state[k] for k in ("world_size", "num_nodes", "node_rank", "local_rank", "local_world_size",
                                       "data_len", "drop_last")}
        here = {"world_size": self.world_size, "num_nodes": p.num_nodes, "node_rank": p.node_rank,
                "local_rank": p.local_rank, "local_world_size": p.local_world_size, "data_len": self.data_len,
                "drop_last": self.drop_last}
        differ = {k: (saved[k], here[k]) for k in saved if saved[k] != here[k]}
        if differ:
            said = ", ".join(f"{k}={a} (this job: {b})" for k, (a, b) in differ.items())
            raise ConfigError(
                f"node-mode sampler state was saved with another layout: {said}. A node's order is dealt among "
                "that node's ranks, so a mid-epoch resume needs the same layout: resume with it, or start at the "
                "next epoch boundary with load_state_dict(state, next_epoch=True)")
        if not 0 <= int(state["consumed"]) <= self.epoch_size.samples:
            raise ConfigError(f"sampler state has consumed={state['consumed']!r} outside [0, "
                              f"{self.epoch_size.samples}] (samples per rank per epoch): resume with the batch "
                              "size and drop_last it was saved with")
