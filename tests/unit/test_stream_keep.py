"""What a DataLoader worker keeps mapped between its batches (``StreamBatch.keep``,
client/streaming/sampler.py): only blocks alive at every step from the earliest batch the node's
loaders may still be gathering to the worker's next batch, so that an idle worker never holds a
block the batch every rank waits for has no room for; nothing once its loader has no batch left
for it; the order the same whatever the workers."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from h5serve.client import StreamSampler
from h5serve.client.samplers.node import NodePlace
from h5serve.client.streaming.batch import StreamBatch
from h5serve.errors import ConfigError
from h5serve.order.stream_order import BlockLayout

LAYOUT = BlockLayout(64_000, 200)  # 320 blocks; batches of 50 on 2 local ranks: a block starts about every other step


def _sampler(workers: int, factor: int = 2, capacity: int = 24) -> StreamSampler:
    return StreamSampler(LAYOUT, 50, NodePlace(0, 2, 0, 1), capacity, seed=3, workers=workers,
                         prefetch_factor=factor)


def _alive_through(alive: list[set[int]], first: int, last: int) -> set[int]:
    """The blocks alive at every step from ``first`` to ``last``; none past the epoch's end."""
    if last >= len(alive):
        return set()
    return set.intersection(*alive[first : last + 1])


@pytest.mark.parametrize(("workers", "factor"), [(1, 2), (2, 2), (8, 2), (4, 1)])
def test_a_worker_keeps_only_blocks_every_batch_it_may_wait_for_holds(workers: int, factor: int) -> None:
    batches = list(_sampler(workers, factor))
    alive = [set(b.alive.tolist()) for b in batches]
    behind = workers * factor + 1
    kept = 0
    for b, batch in enumerate(batches):
        assert batch.keep is not None
        keep = set(batch.keep.tolist())
        assert keep == _alive_through(alive, max(b - behind, 0), b + workers)
        kept += len(keep)
    assert kept > 0  # blocks live long enough here that workers keep some
    assert all(len(b.keep) == 0 for b in batches[-workers:])  # an idle worker at the epoch's end holds nothing


def test_without_workers_the_rank_keeps_its_window_and_the_order_is_the_same() -> None:
    alone = list(_sampler(0))
    assert all(b.keep is None for b in alone)
    for workers in (2, 8):
        batches = list(_sampler(workers))
        assert [b.rows.tolist() for b in batches] == [b.rows.tolist() for b in alone]
        assert all(np.array_equal(a.alive, b.alive) and np.array_equal(a.ahead, b.ahead)
                   and np.array_equal(a.done, b.done) for a, b in zip(alone, batches))


def test_a_resumed_pass_keeps_only_what_its_own_batches_hold() -> None:
    whole = _sampler(2)
    whole.set_epoch(1)
    batches = list(whole)
    state = whole.state_dict(consumed=50 * 40)
    resumed = _sampler(2)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert [b.rows.tolist() for b in rest] == [b.rows.tolist() for b in batches[40:]]
    alive = [set(b.alive.tolist()) for b in rest]
    for b, batch in enumerate(rest):
        assert set(batch.keep.tolist()) == _alive_through(alive, max(b - 5, 0), b + 2)


def test_keep_travels_with_the_batch_to_a_worker() -> None:
    batch = next(iter(_sampler(2)))
    again = pickle.loads(pickle.dumps(batch))
    assert isinstance(again, StreamBatch) and np.array_equal(again.keep, batch.keep)


@pytest.mark.parametrize("bad", [{"workers": -1}, {"workers": 1.5}, {"prefetch_factor": -2}])
def test_bad_workers_are_refused(bad: dict) -> None:
    with pytest.raises(ConfigError, match="must be an integer >= 0"):
        StreamSampler(LAYOUT, 50, NodePlace(0, 2, 0, 1), 24, **bad)
