"""LoaderStats counts what a training loop received and how long it waited for it."""

from __future__ import annotations

import time

import pytest
import torch

from h5serve.client import LoaderStats

pytestmark = pytest.mark.timeout(60)


class SlowLoader:
    """Batches of (x, y) that each take ``delay`` seconds to produce."""

    def __init__(self, batches: int, delay: float) -> None:
        self.batches, self.delay = batches, delay

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        for i in range(self.batches):
            time.sleep(self.delay)
            yield torch.zeros(8, 3, dtype=torch.float32), torch.full((8,), i, dtype=torch.int64)


def test_counts_batches_samples_bytes_and_wait() -> None:
    stats = LoaderStats(SlowLoader(5, 0.02))
    assert len(stats) == 5
    labels = [int(y[0]) for _, y in stats]
    assert labels == [0, 1, 2, 3, 4]  # batches pass through unchanged, in order
    snap = stats.snapshot()
    assert (snap.batches, snap.samples, snap.bytes) == (5, 40, 5 * (8 * 3 * 4 + 8 * 8))
    assert snap.wait_s >= 5 * 0.02 and snap.wait_per_batch_s >= 0.02
    assert snap.wall_s >= snap.wait_s and 0 < snap.wait_fraction <= 1
    assert snap.samples_per_s == pytest.approx(40 / snap.wall_s)
    stats_dict = stats.get_stats()
    assert stats_dict["batches"] == 5 and stats_dict["bytes_per_s"] > 0


def test_training_time_is_not_waiting_and_epochs_accumulate() -> None:
    stats = LoaderStats(SlowLoader(3, 0.0))
    for _ in stats:
        time.sleep(0.03)  # the training step: not time spent waiting for data
    snap = stats.snapshot()
    assert snap.wall_s >= 0.09 and snap.wait_s < snap.wall_s / 2
    for _ in stats:  # a second epoch adds to the totals
        pass
    assert stats.snapshot().batches == 6
    stats.reset()
    assert stats.snapshot().batches == 0 and stats.snapshot().wall_s == 0


def test_snapshot_mid_epoch_includes_running_time() -> None:
    stats = LoaderStats(SlowLoader(4, 0.0))
    it = iter(stats)
    next(it)
    time.sleep(0.05)
    mid = stats.snapshot()
    assert mid.batches == 1 and mid.wall_s >= 0.05
    it.close()  # abandoning an epoch stops its clock
    wall = stats.snapshot().wall_s
    time.sleep(0.02)
    assert stats.snapshot().wall_s == wall


def test_batches_of_other_shapes() -> None:
    loader = [{"x": torch.ones(4, 2), "name": "a"}, [torch.ones(3)], "not a tensor"]
    stats = LoaderStats(loader)
    assert list(stats) == loader
    snap = stats.snapshot()
    assert snap.batches == 3 and snap.samples == 4 + 3 and snap.bytes == 4 * 2 * 4 + 3 * 4
