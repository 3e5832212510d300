"""EpochShuffleSampler: the predecessor's per-epoch shuffling over a rank-local shard, plus
checkpointable state for resuming mid-epoch; EpochBatchSampler: its order cut into index
tensors, with the same number of batches on every rank (h5serve/order/equalise.py);
DistributedShuffleSampler: torch's DistributedSampler order over a whole (global-mode)
dataset, as index tensors, checkpointable."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

from ...errors import ConfigError
from ...order.equalise import check_batch_size, equal_epoch_size
from ...util.checks import is_int
from ..gather import IndexBatches
from .resharding import check_not_rebuilt, check_not_resharded

__all__ = ["EpochShuffleSampler", "EpochBatchSampler", "DistributedShuffleSampler", "distributed_num_samples",
           "check_state_origin", "counted_batches", "wrap_order"]

_STATE_KEYS = ("data_len", "seed", "shuffle", "epoch", "consumed")


def _check_count(name: str, value: object) -> int:
    if not is_int(value) or value < 0:
        raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def wrap_order(order: torch.Tensor, length: int) -> torch.Tensor:
    """``order`` cut to ``length`` or, when longer, repeated from its start (how
    torch.utils.data.DistributedSampler pads): ``result[i] == order[i % len(order)]``."""
    if length <= len(order):
        return order[:length]
    if len(order) == 0:
        raise ConfigError(f"an empty order cannot be padded to {length} samples")
    return order.repeat(-(-length // len(order)))[:length]


class EpochShuffleSampler(Sampler[int]):
    """Local indices ``0..data_len-1``, reshuffled each epoch from ``seed + epoch``.

    Deterministic: the same (seed, epoch) gives the same order in every process and on
    every backend, so a shm run and a lazy run see exactly the same sequence.

    Resuming: ``state_dict(consumed=n)`` records the epoch and how many samples of it the
    training loop has consumed; after ``load_state_dict`` the next iteration yields exactly the
    rest of that epoch's order (whatever ``num_workers`` is then), and later epochs are whole.
    Without ``consumed``, the count of indices this sampler has handed out is used: with
    DataLoader workers that runs ahead of training by the prefetched batches, so pass
    ``consumed=batches_done * batch_size`` when you checkpoint.

    Used alone, an epoch is the shard's ``data_len`` indices, as in the predecessor: ranks with
    shards of different sizes then get different numbers of batches, which hangs DDP.
    ``epoch_length`` (set by EpochBatchSampler with ``shard_sizes``, hence by make_loader)
    makes an epoch that many indices: the order repeated from its start past ``data_len``, or
    cut short; checkpoints count positions in that order.
    """

    def __init__(self, data_len: int, seed: int = 0, shuffle: bool = True, *,
                 epoch_length: int | None = None) -> None:
        self.data_len = _check_count("data_len", data_len)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self._start = 0  # where the next iteration begins (after load_state_dict)
        self._yielded = 0  # indices handed out in the current epoch
        self._epoch_length: int | None = None  # None: data_len, the predecessor's epoch
        if epoch_length is not None:
            self.set_epoch_length(epoch_length)

    @property
    def epoch_length(self) -> int:
        """Indices per epoch: ``data_len`` unless set otherwise."""
        return self.data_len if self._epoch_length is None else self._epoch_length

    def set_epoch_length(self, samples: int) -> None:
        """Yield ``samples`` indices per epoch: the epoch's order repeated from its start to pad
        it (as DistributedSampler pads), or cut short. The first ``min(samples, data_len)``
        indices are those of the unpadded order, so a resume point stays valid.

        Raised when ``samples`` is negative, when an empty shard would have to be padded, or
        when a pending resume lies beyond the new length: ConfigError.
        """
        samples = _check_count("epoch_length", samples)
        if self.data_len == 0 and samples > 0:
            raise ConfigError(f"an empty shard cannot be padded to {samples} samples per epoch")
        if self._start > samples:
            raise ConfigError(
                f"the loaded sampler state resumes at sample {self._start}, past the {samples} samples per "
                "epoch asked for: resume with the batch size, drop_last and world size it was saved with"
            )
        self._epoch_length = samples

    def set_epoch(self, epoch: int) -> None:
        if int(epoch) != self.epoch:
            self._start = 0  # a pending resume applies to the epoch it was saved in only
        self.epoch = int(epoch)

    def order(self) -> torch.Tensor:
        """This epoch's whole order (``epoch_length`` indices) as an int64 tensor."""
        order = self._permutation()
        return order if self._epoch_length is None else wrap_order(order, self._epoch_length)

    def _permutation(self) -> torch.Tensor:
        """This epoch's permutation of ``0..data_len-1``."""
        if not self.shuffle:
            return torch.arange(self.data_len)
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.data_len, generator=generator)

    def _remaining(self) -> torch.Tensor:
        """This epoch's order from where iteration starts (a pending resume is used up)."""
        start, self._start = self._start, 0
        self._yielded = start
        return self.order()[start:]

    def __iter__(self) -> Iterator[int]:
        check_not_resharded(self)
        return self._indices()

    def _indices(self) -> Iterator[int]:
        for index in self._remaining().tolist():
            self._yielded += 1
            yield index

    def __len__(self) -> int:
        return self.epoch_length - self._start

    def batches(self, batch_size: int, drop_last: bool = False) -> Iterator[torch.Tensor]:
        """The same order as iterating, cut into int64 tensors of ``batch_size`` indices: no
        Python int per index (what EpochBatchSampler and make_loader use)."""
        check_batch_size(batch_size)
        return self._counted(self._remaining(), batch_size, drop_last, False)

    def _counted(self, order: torch.Tensor, batch_size: int, drop_last: bool, arrays: bool) -> IndexBatches:
        end = len(order) - len(order) % batch_size if drop_last else len(order)
        return IndexBatches(self, order, batch_size, end, arrays)

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """What to checkpoint next to the model. ``consumed``: samples of this epoch already
        used for training (default: indices handed out so far)."""
        consumed = self._yielded if consumed is None else int(consumed)
        if not 0 <= consumed <= self.epoch_length:
            raise ConfigError(f"consumed must be in [0, {self.epoch_length}] (samples per epoch), got {consumed}")
        return {"data_len": self.data_len, "seed": self.seed, "shuffle": self.shuffle, "epoch": self.epoch,
                "consumed": consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next iteration continues this epoch's order (padded
        or cut to ``epoch_length``, so set that first: make_loader does) at ``consumed``.

        Raised when the state is malformed, was saved for a shard of another length, or resumes
        past this sampler's epoch: ConfigError.
        """
        if not isinstance(state, dict) or any(k not in state for k in _STATE_KEYS):
            raise ConfigError(f"sampler state must be a dict with keys {_STATE_KEYS}, got {state!r:.200}")
        if state["data_len"] != self.data_len:
            raise ConfigError(
                f"sampler state was saved for a shard of {state['data_len']} samples, this one has "
                f"{self.data_len}: resume with the same dataset, world size and mode"
            )
        if not 0 <= int(state["consumed"]) <= self.epoch_length:
            raise ConfigError(
                f"sampler state has consumed={state['consumed']!r} outside [0, {self.epoch_length}] (samples per "
                "epoch): resume with the batch size, drop_last and world size it was saved with"
            )
        self.seed, self.shuffle, self.epoch = int(state["seed"]), bool(state["shuffle"]), int(state["epoch"])
        self._start = int(state["consumed"])
        self._yielded = self._start


class EpochBatchSampler(Sampler[torch.Tensor]):
    """Batches of an EpochShuffleSampler's order, as int64 tensors (DataLoader
    ``batch_sampler=``): the same samples in the same order as
    ``DataLoader(sampler=sampler, batch_size=...)``, without a Python int per index.
    ``set_epoch``, ``state_dict`` and ``load_state_dict`` act on the wrapped sampler.

    ``shard_sizes``: the shard size of every rank (``SharedH5Dataset.shard_sizes()``). Then
    every rank gets the same number of batches per epoch (``h5serve.order.equalise``): the wrapped
    sampler's epoch is padded with its own order to the largest shard (``drop_last=False``) or
    cut to the smallest shard's full batches (``drop_last=True``). make_loader passes them.

    ``arrays=True``: int64 numpy arrays instead, for DataLoader workers. DataLoader sends each
    batch of indices to a worker through a queue, and a tensor travels as a new shared-memory
    file plus a file descriptor per batch, an array as a few bytes of pickle (on the bench:
    ~1.3x the samples/s with 2 workers).
    """

    def __init__(self, sampler: EpochShuffleSampler, batch_size: int, drop_last: bool = False,
                 arrays: bool = False, *, shard_sizes: Sequence[int] | None = None, mode: str | None = None) -> None:
        """``mode``: the dataset's sharding mode, recorded in checkpoints with the world size
        (``len(shard_sizes)``); make_loader passes both.

        Raised for a bad batch size, a sampler of another kind, or shard sizes that leave
        some rank no batch or do not include the sampler's shard: ConfigError."""
        check_not_rebuilt(type(self), sampler)
        if not isinstance(sampler, EpochShuffleSampler):
            raise ConfigError(f"EpochBatchSampler wraps an EpochShuffleSampler, got {type(sampler).__name__}")
        check_batch_size(batch_size)
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = bool(drop_last)
        self.arrays = bool(arrays)
        self.mode = mode
        self.world_size = None if shard_sizes is None else len(list(shard_sizes))
        if shard_sizes is not None:
            self._equalise(shard_sizes)

    def _equalise(self, shard_sizes: Sequence[int]) -> None:
        """Set the wrapped sampler's epoch to the length every rank can yield."""
        sizes = list(shard_sizes)
        size = equal_epoch_size(sizes, self.batch_size, self.drop_last)
        if self.sampler.data_len not in sizes:
            raise ConfigError(
                f"the sampler covers {self.sampler.data_len} samples, but no rank's shard has that many "
                f"(shard sizes from {min(sizes)} to {max(sizes)}): pass the sizes of this dataset's shards"
            )
        if self.sampler._epoch_length not in (None, size.samples):
            raise ConfigError(
                f"the sampler already yields {self.sampler.epoch_length} samples per epoch, this loader needs "
                f"{size.samples}: give each loader its own EpochShuffleSampler"
            )
        self.sampler.set_epoch_length(size.samples)

    def __iter__(self) -> Iterator[torch.Tensor]:
        check_not_resharded(self)
        check_batch_size(self.batch_size)
        return self.sampler._counted(self.sampler._remaining(), self.batch_size, self.drop_last, self.arrays)

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The wrapped sampler's state, plus the mode and world size when known and
        ``consumed_global`` (every rank consumes as many: ``consumed * world_size``)."""
        state = self.sampler.state_dict(consumed)
        if self.world_size is not None:
            state.update(mode=self.mode, world_size=self.world_size,
                         consumed_global=state["consumed"] * self.world_size)
        return state

    def load_state_dict(self, state: dict[str, Any], *, next_epoch: bool = False) -> None:
        """Resume: the rest of the saved epoch, which needs the same mode and world size (a
        rank's shard depends on both). ``next_epoch=True``: the start of the next epoch, with
        any mode and world size.

        Raised when the state is malformed, or (without ``next_epoch``) from another shard,
        mode or world size: ConfigError.
        """
        if not isinstance(state, dict) or any(k not in state for k in _STATE_KEYS):
            raise ConfigError(f"sampler state must be a dict with keys {_STATE_KEYS}, got {state!r:.200}")
        if next_epoch:
            self.sampler.seed, self.sampler.shuffle = int(state["seed"]), bool(state["shuffle"])
            self.sampler.set_epoch(int(state["epoch"]) + 1)
            return
        for key, here in (("mode", self.mode), ("world_size", self.world_size)):
            if here is not None and key in state and state[key] != here:
                raise ConfigError(
                    f"sampler state was saved with {key}={state[key]!r}, this loader has {key}={here!r}: each rank's "
                    "shard depends on the mode and world size, so a mid-epoch resume needs the same; resume with "
                    "them, use mode='global' (elastic), or start at the next epoch with "
                    "load_state_dict(state, next_epoch=True)")
        self.sampler.load_state_dict(state)


_DIST_STATE_KEYS = ("sampler", "mode", "data_len", "seed", "shuffle", "drop_last", "epoch", "world_size",
                    "consumed", "consumed_global")


def counted_batches(sampler: Any, order: torch.Tensor) -> IndexBatches:
    """``order`` cut into ``sampler.batch_size`` batches (copies: see gather.IndexBatches),
    numpy arrays when ``sampler.arrays``, each counted in ``sampler._yielded`` as it is handed out."""
    return IndexBatches(sampler, order, sampler.batch_size, arrays=sampler.arrays)


def distributed_num_samples(data_len: int, world_size: int, drop_last: bool) -> int:
    """Samples per rank per epoch, as ``torch.utils.data.DistributedSampler`` computes them:
    ``ceil(n / W)`` (padded), or ``floor(n / W)`` with ``drop_last`` when ``W`` does not divide ``n``."""
    return data_len // world_size if drop_last else -(-data_len // world_size)


def check_state_origin(sampler: Any, state: Any, keys: tuple[str, ...], length_key: str, length: int) -> None:
    """Raised when ``state`` is not a dict with ``keys``, is from another sampler class or mode
    than ``sampler``'s, or from a dataset of another length: ConfigError."""
    if not isinstance(state, dict) or any(k not in state for k in keys):
        raise ConfigError(f"sampler state must be a dict with keys {keys}, got {state!r:.200}")
    if (state["sampler"], state["mode"]) != (type(sampler).__name__, sampler.mode):
        raise ConfigError(f"sampler state is from a {state['sampler']} in mode {state['mode']!r}, this is a "
                          f"{type(sampler).__name__} in mode {sampler.mode!r}: resume with the sampler it was "
                          "saved from")
    if state[length_key] != length:
        raise ConfigError(f"sampler state was saved for a dataset of {state[length_key]} rows, this one has "
                          f"{length}: resume with the same file and key")


class DistributedShuffleSampler(Sampler[torch.Tensor]):
    """Batches, as int64 index tensors, of exactly the indices that
    ``torch.utils.data.DistributedSampler(dataset, num_replicas=world_size, rank=rank,
    shuffle=shuffle, seed=seed, drop_last=drop_last)`` yields each epoch: the same permutation
    (``torch.randperm`` from ``seed + epoch``), the same padding (the permutation repeated from
    its start up to ``ceil(n / W) * W``) or cut (``drop_last``), the same stride (rank ``r``
    takes positions ``r, r + W, ...``). A job moving from DistributedSampler keeps its sample
    order; the batches skip DataLoader's per-index Python ints (the fast path). For a dataset of
    all rows on every rank: ``SharedH5Dataset(mode="global")``, where make_loader uses it.

    Every rank yields the same number of samples (``DistributedSampler``'s ``num_samples``),
    so the same number of batches (h5serve/order/equalise.py): ``ceil(num_samples / batch_size)``,
    the last one as short on every rank, or with ``drop_last_batch`` only the full ones, as
    ``DataLoader(..., drop_last=True)`` over DistributedSampler would.

    ``set_epoch(epoch)`` before each epoch, as with DistributedSampler. ``state_dict(consumed=n)``
    records the seed, epoch, world size, mode and the samples consumed: ``n`` on this rank (the
    same on every rank) and ``consumed_global``, how far into the epoch's permutation all ranks
    together are. ``load_state_dict`` resumes mid-epoch (whatever ``num_workers``):

    - with the same world size and ``drop_last``: exactly the rest of this rank's order;
    - with another world size (elastic): the rest of the epoch is the permutation from
      ``consumed_global`` on, padded or cut to a multiple of the new world size as
      DistributedSampler would pad the whole, and dealt with the same stride. No sample of the
      epoch is seen twice (padding aside) or skipped; every rank again yields the same count.

    ``arrays=True``: numpy arrays (for DataLoader workers).

    Raised for a bad size, rank, world size or batch size, or when ``drop_last_batch`` would
    leave every rank without a batch: ConfigError.
    """

    mode = "global"

    def __init__(self, data_len: int, batch_size: int, world_size: int | None = None, rank: int | None = None,
                 *, shuffle: bool = True, seed: int = 0, drop_last: bool = False, drop_last_batch: bool = False,
                 arrays: bool = False) -> None:
        from ...order.sharding import resolve_rank_world

        check_not_rebuilt(type(self), data_len)
        self.data_len = _check_count("data_len", data_len)
        check_batch_size(batch_size)
        self.rank, self.world_size = resolve_rank_world(rank, world_size)
        self.batch_size = batch_size
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.drop_last, self.drop_last_batch, self.arrays = bool(drop_last), bool(drop_last_batch), bool(arrays)
        self.num_samples = distributed_num_samples(self.data_len, self.world_size, self.drop_last)
        self.epoch_size = equal_epoch_size([self.num_samples] * self.world_size, batch_size, self.drop_last_batch)
        self.epoch = 0
        self._offset = 0  # where in the epoch's permutation this pass starts (> 0 after an elastic resume)
        self._resuming = False  # a loaded state applies to the next iteration (offset and start)
        self._start = 0  # where in this rank's order the next iteration begins (after load_state_dict)
        self._yielded = 0  # samples handed out in the current pass

    def set_epoch(self, epoch: int) -> None:
        if int(epoch) != self.epoch:  # a pending resume applies to the epoch it was saved in only
            self._offset, self._start, self._resuming = 0, 0, False
        self.epoch = int(epoch)

    @property
    def sampler(self) -> DistributedShuffleSampler:
        """Itself: Lightning sets each epoch through ``loader.batch_sampler.sampler.set_epoch``."""
        return self

    def permutation(self) -> torch.Tensor:
        """This epoch's permutation of ``0..data_len-1`` (``torch.randperm`` from ``seed + epoch``)."""
        if not self.shuffle:
            return torch.arange(self.data_len)
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.data_len, generator=generator)

    def _pass_samples(self) -> int:
        """Samples per rank in the current pass: ``num_samples`` for a whole epoch; after an
        elastic resume, DistributedSampler's count for the rest of the permutation."""
        return distributed_num_samples(self.data_len - self._offset, self.world_size, self.drop_last)

    def samples_per_rank(self, offset: int | None = None) -> int:
        """Samples each rank yields in the pass starting at ``offset`` of the permutation
        (default: the current pass), all ranks alike."""
        offset = self._offset if offset is None else offset
        if offset == 0:
            return self.epoch_size.samples
        samples = distributed_num_samples(self.data_len - offset, self.world_size, self.drop_last)
        return samples - samples % self.batch_size if self.drop_last_batch else samples  # < a batch: none

    def global_order(self) -> torch.Tensor:
        """The order all ranks take their samples from, rank ``r`` positions ``r, r + W, ...``:
        the epoch's permutation (from an elastic resume point on) padded or cut to
        ``samples * world_size``, as DistributedSampler builds it before striding."""
        return wrap_order(self.permutation()[self._offset :], self._pass_samples() * self.world_size)

    def indices(self) -> torch.Tensor:
        """This rank's indices for the epoch (before any batch is dropped)."""
        return self.global_order()[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[torch.Tensor]:
        check_not_resharded(self)
        if not self._resuming:
            self._offset = 0
        start, self._start, self._resuming = self._start, 0, False
        self._yielded = start
        return counted_batches(self, self.indices()[start : self.samples_per_rank()])

    def __len__(self) -> int:
        left = max(self.samples_per_rank(self._offset if self._resuming else 0) - self._start, 0)
        return (left + self.batch_size - 1) // self.batch_size

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """What to checkpoint next to the model. ``consumed``: samples of this epoch this rank
        has trained on (default: handed out so far; with workers pass
        ``batches_done * batch_size``: they prefetch). ``consumed_global`` in the result is how
        many positions of the epoch's permutation all ranks together have consumed
        (``data_len`` once the epoch is over)."""
        done = self.samples_per_rank()
        consumed = self._yielded if consumed is None else int(consumed)
        if not 0 <= consumed <= done:
            raise ConfigError(f"consumed must be in [0, {done}] (samples per rank in this epoch), got {consumed}")
        # positions past the rest of the permutation are padding; a finished epoch is all consumed
        consumed_global = self.data_len if consumed == done else min(
            self._offset + consumed * self.world_size, self.data_len)
        return {"sampler": type(self).__name__, "mode": self.mode, "data_len": self.data_len, "seed": self.seed,
                "shuffle": self.shuffle, "drop_last": self.drop_last, "epoch": self.epoch,
                "world_size": self.world_size, "offset": self._offset, "consumed": consumed,
                "consumed_global": consumed_global}

    def load_state_dict(self, state: dict[str, Any], *, next_epoch: bool = False) -> None:
        """Resume from ``state_dict()``: the next iteration continues that epoch where it
        stopped, with the same or another world size (see the class). ``next_epoch=True``:
        start at the beginning of the next epoch instead.

        Raised when the state is malformed, from another sampler kind, mode or dataset length,
        or resumes past the end of its epoch: ConfigError.
        """
        check_state_origin(self, state, _DIST_STATE_KEYS, "data_len", self.data_len)
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        if next_epoch:
            self.epoch, self._offset, self._start, self._yielded = int(state["epoch"]) + 1, 0, 0, 0
            self._resuming = False
            return
        self.epoch, self._resuming = int(state["epoch"]), True
        offset = _state_count(state, "offset", self.data_len, default=0)
        consumed_global = _state_count(state, "consumed_global", self.data_len)
        if (state["world_size"], bool(state["drop_last"])) == (self.world_size, self.drop_last):
            self._offset, self._start = offset, 0  # this rank's order continues where it stopped
            done = self.samples_per_rank()
            if not 0 <= int(state["consumed"]) <= done:
                raise ConfigError(f"sampler state has consumed={state['consumed']!r} outside [0, {done}] (samples "
                                  "per rank in that epoch): resume with the batch size it was saved with")
            self._start = int(state["consumed"])
        else:  # elastic: deal the rest of the permutation to this world
            self._offset, self._start = consumed_global, 0
        self._yielded = self._start


def _state_count(state: dict[str, Any], key: str, high: int, default: int | None = None) -> int:
    """``state[key]`` as an int in [0, high]. Raised when it is not: ConfigError."""
    value = state.get(key, default)
    if not is_int(value) or not 0 <= value <= high:
        raise ConfigError(f"sampler state has {key}={value!r}, not an integer in [0, {high}] (the dataset's rows): "
                          "resume with the state the sampler saved")
    return value
