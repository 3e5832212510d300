"""EpochShuffleSampler: the predecessor's per-epoch shuffling over a rank-local shard."""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import Sampler

from ..errors import ConfigError

__all__ = ["EpochShuffleSampler"]


class EpochShuffleSampler(Sampler[int]):
    """Local indices ``0..data_len-1``, reshuffled each epoch from ``seed + epoch``.

    Deterministic: the same (seed, epoch) gives the same order in every process and on
    every backend, so a shm run and a lazy run see exactly the same sequence.
    """

    def __init__(self, data_len: int, seed: int = 0, shuffle: bool = True) -> None:
        if isinstance(data_len, bool) or not isinstance(data_len, int) or data_len < 0:
            raise ConfigError(f"data_len must be a non-negative integer, got {data_len!r}")
        self.data_len = data_len
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def order(self) -> torch.Tensor:
        """This epoch's order as an int64 tensor."""
        if not self.shuffle:
            return torch.arange(self.data_len)
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.data_len, generator=generator)

    def __iter__(self) -> Iterator[int]:
        return iter(self.order().tolist())

    def __len__(self) -> int:
        return self.data_len
