"""LoaderStats: how fast batches arrive and how long training waits for them.

In the spirit of the predecessor's DataLoaderPerformanceMonitor, but cheap enough to leave on
(two clock reads and a walk over the batch's tensors per batch; no psutil, no sampling of CPU
or memory): wrap the loader, iterate the wrapper, read ``get_stats()`` when you like.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["LoaderStats", "LoaderSnapshot"]


@dataclass(frozen=True)
class LoaderSnapshot:
    """Totals since the wrapper was made (or ``reset``)."""

    batches: int
    samples: int
    bytes: int  # tensor bytes delivered
    wall_s: float  # since the first batch was asked for
    wait_s: float  # inside the loader's ``__next__``: time training waited for data

    @property
    def batches_per_s(self) -> float:
        return self.batches / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def wait_per_batch_s(self) -> float:
        return self.wait_s / self.batches if self.batches else 0.0

    @property
    def wait_fraction(self) -> float:
        """Share of the wall time spent waiting for data: near 0, the input pipeline keeps up."""
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "batches_per_s": self.batches_per_s, "samples_per_s": self.samples_per_s,
                "bytes_per_s": self.bytes_per_s, "wait_per_batch_s": self.wait_per_batch_s,
                "wait_fraction": self.wait_fraction}


def _measure(batch: Any) -> tuple[int, int]:
    """(samples, bytes) of a batch: tensors anywhere in tuples, lists and dicts."""
    if isinstance(batch, torch.Tensor):
        return (batch.shape[0] if batch.dim() else 1), batch.numel() * batch.element_size()
    if isinstance(batch, (tuple, list)):
        parts = [_measure(item) for item in batch]
    elif isinstance(batch, dict):
        parts = [_measure(item) for item in batch.values()]
    else:
        return 0, 0
    parts = [p for p in parts if p != (0, 0)]
    return (parts[0][0] if parts else 0), sum(p[1] for p in parts)


class LoaderStats:
    """Wraps an iterable of batches (a DataLoader); iterate it instead of the loader::

        stats = LoaderStats(loader)
        for x, y in stats:
            ...
        print(stats.get_stats())   # batches_per_s, wait_per_batch_s, bytes, ...

    Each ``iter()`` iterates the loader again (a new epoch); totals accumulate until
    ``reset()``. ``len()`` is the loader's.
    """

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.reset()

    def reset(self) -> None:
        self._batches = self._samples = self._bytes = 0
        self._wait = 0.0
        self._wall = 0.0
        self._running_since: float | None = None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        clock = time.perf_counter
        t0 = clock()
        self._running_since = t0
        iterator = iter(self.loader)
        try:
            while True:
                asked = clock()
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
                got = clock()
                self._wait += got - asked
                samples, nbytes = _measure(batch)
                self._batches += 1
                self._samples += samples
                self._bytes += nbytes
                yield batch
        finally:
            self._wall += clock() - t0
            self._running_since = None

    def snapshot(self) -> LoaderSnapshot:
        """Totals so far (including the epoch in progress)."""
        wall = self._wall
        if self._running_since is not None:
            wall += time.perf_counter() - self._running_since
        return LoaderSnapshot(self._batches, self._samples, self._bytes, wall, self._wait)

    def get_stats(self) -> dict[str, float]:
        """``snapshot().as_dict()``: the predecessor monitor's method name."""
        return self.snapshot().as_dict()
