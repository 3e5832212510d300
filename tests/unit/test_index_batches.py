"""IndexBatches, one pass of a batch sampler: iterating hands out compact copies (what
DataLoader and its workers get), ``next_view`` views of the pass's order (what ShmDataLoader's
own iterator gathers with), both counted alike; ``within`` checks every index at once."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from h5serve.client.gather import IndexBatches, as_positions


@dataclass
class Counter:
    _yielded: int = 0


def _order(n: int = 10) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("end", [None, 7, 0])
def test_copies_and_views_are_the_same_batches_counted_alike(end: int | None) -> None:
    order = _order()
    want = order.numpy()[: len(order) if end is None else end]
    copies, views = Counter(), Counter()
    tensors = list(IndexBatches(copies, order, 3, end))
    batches = IndexBatches(views, order, 3, end)
    got_views = []
    while True:
        try:
            got_views.append(batches.next_view())
        except StopIteration:
            break
    with pytest.raises(StopIteration):  # and stays exhausted
        batches.next_view()
    assert [t.tolist() for t in tensors] == [v.tolist() for v in got_views]
    assert np.concatenate([want[:0], *got_views]).tolist() == want.tolist()
    assert [len(v) for v in got_views] == [min(3, len(want) - i) for i in range(0, len(want), 3)]
    assert copies._yielded == views._yielded == len(want)
    for t in tensors:  # compact int64 copies: as_positions takes them as they are
        assert t.dtype == torch.int64 and t.storage_offset() == 0
        assert t.untyped_storage().nbytes() == t.nbytes
        assert not np.shares_memory(t.numpy(), order.numpy())
        assert as_positions(t, 10) is t
    for v in got_views:
        assert v.dtype == np.int64 and np.shares_memory(v, batches.order)


def test_arrays_are_numpy_copies_and_counting_is_per_batch() -> None:
    counter = Counter()
    batches = IndexBatches(counter, _order(), 4, arrays=True)
    first = next(batches)
    assert isinstance(first, np.ndarray) and first.flags.owndata and counter._yielded == 4
    assert [len(b) for b in batches] == [4, 2] and counter._yielded == 10


def test_a_strided_order_is_made_contiguous_once() -> None:
    order = torch.arange(20)[1::2]
    batches = IndexBatches(Counter(), order, 4)
    assert batches.order.flags.c_contiguous and batches.order.tolist() == list(range(1, 20, 2))
    assert batches.next_view().tolist() == [1, 3, 5, 7]


def test_within_checks_every_index() -> None:
    assert IndexBatches(Counter(), torch.arange(10), 4).within(10)
    assert not IndexBatches(Counter(), torch.arange(10), 4).within(9)
    assert not IndexBatches(Counter(), torch.tensor([0, -1, 2]), 4).within(10)  # negatives are refused
    assert IndexBatches(Counter(), torch.arange(10), 4, end=0).within(0)  # an empty pass
    assert IndexBatches(Counter(), torch.arange(10), 4, end=5).within(5)  # only the pass counts
