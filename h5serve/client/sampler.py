"""EpochShuffleSampler: the predecessor's per-epoch shuffling over a rank-local shard, plus
checkpointable state for resuming mid-epoch; EpochBatchSampler: its order cut into index
tensors, with the same number of batches on every rank (h5serve/equalise.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Iterator

import torch
from torch.utils.data import Sampler

from ..equalise import check_batch_size, equal_epoch_size
from ..errors import ConfigError

__all__ = ["EpochShuffleSampler", "EpochBatchSampler"]

_STATE_KEYS = ("data_len", "seed", "shuffle", "epoch", "consumed")


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
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
        for index in self._remaining().tolist():
            self._yielded += 1
            yield index

    def __len__(self) -> int:
        return self.epoch_length - self._start

    def batches(self, batch_size: int, drop_last: bool = False) -> Iterator[torch.Tensor]:
        """The same order as iterating, cut into int64 tensors of ``batch_size`` indices: no
        Python int per index (what EpochBatchSampler and make_loader use)."""
        check_batch_size(batch_size)
        order = self._remaining()
        end = len(order) - len(order) % batch_size if drop_last else len(order)
        for i in range(0, end, batch_size):
            # A copy, not a view: torch ops on a view of the whole order cost time in proportion
            # to the order (index_select: ~7 ms for 100k), and pickling one to a worker sends it all.
            batch = order[i : i + batch_size].clone()
            self._yielded += len(batch)
            yield batch

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
    every rank gets the same number of batches per epoch (``h5serve.equalise``): the wrapped
    sampler's epoch is padded with its own order to the largest shard (``drop_last=False``) or
    cut to the smallest shard's full batches (``drop_last=True``). make_loader passes them.

    ``arrays=True``: int64 numpy arrays instead, for DataLoader workers. DataLoader sends each
    batch of indices to a worker through a queue, and a tensor travels as a new shared-memory
    file plus a file descriptor per batch, an array as a few bytes of pickle (on the bench:
    ~1.3x the samples/s with 2 workers).
    """

    def __init__(self, sampler: EpochShuffleSampler, batch_size: int, drop_last: bool = False,
                 arrays: bool = False, *, shard_sizes: Sequence[int] | None = None) -> None:
        """Raised for a bad batch size, a sampler of another kind, or shard sizes that leave
        some rank no batch or do not include the sampler's shard: ConfigError."""
        if not isinstance(sampler, EpochShuffleSampler):
            raise ConfigError(f"EpochBatchSampler wraps an EpochShuffleSampler, got {type(sampler).__name__}")
        check_batch_size(batch_size)
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = bool(drop_last)
        self.arrays = bool(arrays)
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
        batches = self.sampler.batches(self.batch_size, self.drop_last)
        return (batch.numpy() for batch in batches) if self.arrays else batches

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        return self.sampler.state_dict(consumed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
