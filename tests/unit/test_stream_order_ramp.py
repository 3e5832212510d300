"""The window's ramp seen through StreamSampler (h5serve/order/stream_order.py, client/streaming/sampler.py):
the first batch needs two blocks, and the blocks asked for ahead never go deeper than a full
window's prefetch while the window ramps up (deeper prefetches, not yet held, were evicted by
the daemon's LRU before their use and loaded twice); when the node's blocks all fit, every one
is asked for at once, as before."""

from __future__ import annotations

import numpy as np

from h5serve.client import StreamSampler
from h5serve.client.samplers.node import NodePlace
from h5serve.order.stream_order import BlockLayout

LAYOUT = BlockLayout(64_000, 500)  # 128 blocks


def _batches(capacity: int) -> tuple[StreamSampler, list]:
    sampler = StreamSampler(LAYOUT, 50, NodePlace(0, 2, 0, 1), capacity, seed=3)
    return sampler, list(sampler)


def test_the_first_batch_needs_two_blocks_and_the_prefetch_stays_a_full_windows() -> None:
    sampler, batches = _batches(40)
    w = sampler.window
    assert 1 < w < LAYOUT.n_blocks
    first = batches[0]
    assert len(first.alive) == 2
    assert set(LAYOUT.block_of(first.rows).tolist()) <= set(first.alive.tolist())
    for batch in batches:
        assert len(batch.ahead) <= max(sampler.capacity - max(len(batch.alive), w), 0)
        assert len(batch.alive) + len(batch.ahead) <= sampler.capacity
    # the ramp: the window holds fewer blocks at the start than once it is full
    held = [len(b.alive) for b in batches]
    assert held[0] == 2 and max(held) >= w - 1


def test_every_block_is_asked_for_at_once_when_the_node_holds_them_all() -> None:
    sampler, batches = _batches(LAYOUT.n_blocks)
    assert sampler.window == LAYOUT.n_blocks
    first = batches[0]
    assert len(first.alive) + len(first.ahead) == LAYOUT.n_blocks
    assert np.array_equal(np.sort(np.concatenate([first.alive, first.ahead])), np.arange(LAYOUT.n_blocks))
