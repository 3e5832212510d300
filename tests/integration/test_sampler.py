"""EpochShuffleSampler: determinism and exact mid-epoch resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from h5serve.client import EpochShuffleSampler, SharedH5Dataset, collate
from h5serve.errors import ConfigError


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 300), seed=st.integers(0, 2**31), epoch=st.integers(0, 50), cut=st.floats(0, 1))
def test_resume_yields_exactly_the_rest(n: int, seed: int, epoch: int, cut: float) -> None:
    a = EpochShuffleSampler(n, seed=seed)
    a.set_epoch(epoch)
    full = list(a)
    consumed = int(cut * n)
    b = EpochShuffleSampler(n, seed=0)
    b.load_state_dict(a.state_dict(consumed=consumed))
    assert len(b) == n - consumed
    assert list(b) == full[consumed:]
    assert list(b) == full  # the resume applies once; the same epoch again is whole
    b.set_epoch(epoch + 1)
    c = EpochShuffleSampler(n, seed=seed)
    c.set_epoch(epoch + 1)
    assert list(b) == list(c)


def test_default_consumed_counts_handed_out_indices() -> None:
    s = EpochShuffleSampler(10, seed=1)
    it = iter(s)
    first = [next(it) for _ in range(4)]
    state = s.state_dict()
    assert state["consumed"] == 4 and state["epoch"] == 0
    t = EpochShuffleSampler(10, seed=1)
    t.load_state_dict(state)
    assert first + list(t) == list(EpochShuffleSampler(10, seed=1))


def test_resume_after_changing_num_workers(shared_daemon, h5file: Path) -> None:
    ds = SharedH5Dataset(h5file, "x", "y", rank=0, world_size=2, runtime_dir=shared_daemon.runtime_dir)
    sampler = EpochShuffleSampler(len(ds), seed=5)
    sampler.set_epoch(3)
    loader = DataLoader(ds, batch_size=32, sampler=sampler, num_workers=2, collate_fn=collate, timeout=60)
    seen = []
    for i, (_, y) in enumerate(loader):
        seen.append(y)
        if i == 6:
            break
    state = sampler.state_dict(consumed=7 * 32)  # workers prefetched more than we used
    resumed = EpochShuffleSampler(len(ds), seed=5)
    resumed.load_state_dict(state)
    rest = DataLoader(ds, batch_size=32, sampler=resumed, num_workers=0, collate_fn=collate)
    labels = torch.cat(seen + [y for _, y in rest]).tolist()
    sampler_again = EpochShuffleSampler(len(ds), seed=5)
    sampler_again.set_epoch(3)
    assert labels == ds.indices[sampler_again.order().numpy()].tolist()


@pytest.mark.parametrize(
    "state,match",
    [
        ({"data_len": 11, "seed": 0, "shuffle": True, "epoch": 0, "consumed": 0}, "shard of 11 samples"),
        ({"data_len": 10, "seed": 0, "shuffle": True, "epoch": 0, "consumed": 11}, "outside"),
        ({"seed": 0}, "must be a dict with keys"),
        ("nope", "must be a dict"),
    ],
)
def test_bad_state_is_a_clear_error(state, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        EpochShuffleSampler(10).load_state_dict(state)
    with pytest.raises(ConfigError, match="consumed must be"):
        EpochShuffleSampler(10).state_dict(consumed=-1)
