"""ShmDataLoader's own single-process iterator (make_loader, num_workers=0): each batch one call
on a view of the batch sampler's order. It must give exactly the batches torch's DataLoader
gives for the same sampler, in every mode, backend and drop_last, count them for checkpoints
alike, resume, switch to torch's path under a profiler mid-epoch, and keep torch's path
wherever a batch could differ (a dataset's own ``__getitems__``, a collate of one's own, an
order with indices outside the dataset)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from h5serve.client import EpochBatchSampler, EpochShuffleSampler, SharedH5Dataset, ShmDataLoader, collate, make_loader

from ..helpers import Daemon, make_h5, open_ds, rank_args

pytestmark = pytest.mark.timeout(240)

ROWS = 1001  # shards of 251 and 250 rows over 4 ranks: the equal-batches padding is in play
BATCH = 32
MODES = ("contiguous", "interleave", "global", "node")


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_h5(tmp_path_factory.mktemp("lean") / "data.h5", rows=ROWS, row_shape=(3, 4))


def own_path(loader: DataLoader) -> Any:
    """A new iterator over ``loader``, asserted to be ShmDataLoader's own path (its internals:
    otherwise these tests would compare torch's path with itself)."""
    it = iter(loader)
    assert it._fast, "make_loader's iterator did not take its own path"
    return it


def torchs(loader: DataLoader) -> DataLoader:
    """torch's DataLoader over ``loader``'s dataset and a batch sampler of its own, alike."""
    return DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, collate_fn=collate)


def same_batches(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        g, w = (g, w) if isinstance(g, (tuple, list)) else ((g,), (w,))
        assert len(g) == len(w)
        for a, b in zip(g, w):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)


def clone(batch: Any) -> Any:
    return tuple(t.clone() for t in batch) if isinstance(batch, tuple) else batch.clone()


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_same_batches_as_torchs_dataloader(h5: Path, where: dict, mode: str, drop_last: bool) -> None:
    ds = open_ds(h5, where, x_key="x", y_key="y", **rank_args(mode, 1))
    try:
        fast = make_loader(ds, BATCH, seed=7, drop_last=drop_last)
        twin = make_loader(ds, BATCH, seed=7, drop_last=drop_last)  # the same sampler, state of its own
        plain = torchs(twin)
        for epoch in (0, 1):
            fast.batch_sampler.set_epoch(epoch)
            twin.batch_sampler.set_epoch(epoch)
            got = [clone(b) for b in own_path(fast)]
            want = [clone(b) for b in plain]
            assert len(got) == len(fast) and all(len(x) == BATCH for x, _ in got[:-1])
            same_batches(got, want)
            assert fast.batch_sampler.state_dict() == twin.batch_sampler.state_dict()
    finally:
        ds.close()


@pytest.mark.parametrize("mode", MODES)
def test_resumes_mid_epoch(h5: Path, shared_daemon: Daemon, mode: str) -> None:
    where = {"runtime_dir": shared_daemon.runtime_dir, "fallback": "error"}
    ds = open_ds(h5, where, x_key="x", y_key="y", **rank_args(mode, 2))
    try:
        reference = make_loader(ds, BATCH, seed=5)
        reference.batch_sampler.set_epoch(3)
        want = [clone(b) for b in torchs(reference)]
        first = make_loader(ds, BATCH, seed=5)
        first.batch_sampler.set_epoch(3)
        it = own_path(first)
        head = [clone(next(it)) for _ in range(3)]
        state = first.batch_sampler.state_dict()  # counted as handed out: 3 batches
        assert state["consumed"] == 3 * BATCH
        resumed = make_loader(ds, BATCH, seed=5)
        resumed.batch_sampler.load_state_dict(state)
        assert len(resumed) == len(want) - 3
        same_batches(head + [clone(b) for b in own_path(resumed)], want)
    finally:
        ds.close()


def test_a_profiler_mid_epoch_records_those_batches(h5: Path, shared_daemon: Daemon) -> None:
    from torch.profiler import ProfilerActivity, profile

    ds = open_ds(h5, {"runtime_dir": shared_daemon.runtime_dir, "fallback": "error"}, x_key="x", y_key="y",
                 rank=0, world_size=2)
    try:
        loader = make_loader(ds, BATCH, seed=1)
        want = [clone(b) for b in torchs(make_loader(ds, BATCH, seed=1))]
        it = own_path(loader)
        got = [clone(next(it)) for _ in range(2)]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            got += [clone(next(it)) for _ in range(3)]
        got += [clone(b) for b in it]
        same_batches(got, want)
        records = [e for e in prof.events() if e.name.startswith("enumerate(DataLoader)")]
        assert len(records) == 3
    finally:
        ds.close()


@pytest.mark.parametrize("kind", ["x only", "keys list", "keys dict", "transforms", "float32 out"])
def test_other_layouts_take_the_own_path_alike(h5: Path, shared_daemon: Daemon, kind: str) -> None:
    where = {"runtime_dir": shared_daemon.runtime_dir, "fallback": "error"}
    kwargs: dict[str, Any] = {
        "x only": {"x_key": "x"},
        "keys list": {"keys": ["x", "y"]},
        "keys dict": {"keys": {"img": "x", "label": "y"}},
        "transforms": {"x_key": "x", "y_key": "y", "transform": lambda t: t.float() * 2},
        "float32 out": {"x_key": "x", "y_key": "y", "dtype_x": "float32"},
    }[kind]
    ds = open_ds(h5, where, rank=1, world_size=2, **kwargs)
    try:
        loader = make_loader(ds, BATCH, seed=2)
        got = list(own_path(loader))
        want = list(torchs(make_loader(ds, BATCH, seed=2)))
        assert len(got) == len(want) == len(loader)
        for g, w in zip(got, want):
            assert type(g) is type(w)
            if isinstance(g, dict):
                assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in g)
            else:
                same_batches([g], [w])
    finally:
        ds.close()


class CountingDataset(SharedH5Dataset):
    """A subclass with a ``__getitems__`` of its own: DataLoader must keep calling it."""

    calls = 0

    def __getitems__(self, indices: Any) -> Any:
        type(self).calls += 1
        return super().__getitems__(indices)


def test_torchs_path_where_a_batch_could_differ(h5: Path, shared_daemon: Daemon) -> None:
    where = {"runtime_dir": shared_daemon.runtime_dir, "fallback": "error"}
    ds = open_ds(h5, where, x_key="x", y_key="y", rank=0, world_size=1)
    own = CountingDataset(h5, "x", "y", rank=0, world_size=1, **where)
    try:
        loader = make_loader(own, BATCH)
        it = iter(loader)
        assert not it._fast
        assert sum(1 for _ in it) == len(loader) == CountingDataset.calls

        seen = []
        mine = ShmDataLoader(ds, batch_sampler=make_loader(ds, BATCH).batch_sampler,
                             collate_fn=lambda batch: seen.append(1) or collate(batch))
        assert not iter(mine)._fast and sum(1 for _ in mine) == len(mine) == len(seen)

        # an order reaching past the dataset: torch's path, which raises at the batch that does
        past = EpochBatchSampler(EpochShuffleSampler(len(ds) + 40, shuffle=False), BATCH)
        loader = ShmDataLoader(ds, batch_sampler=past, collate_fn=collate)
        it = iter(loader)
        assert not it._fast
        good = (len(ds) // BATCH) * BATCH  # batches wholly inside the dataset
        for _ in range(good // BATCH):
            next(it)
        with pytest.raises(IndexError):
            next(it)
    finally:
        ds.close()
        own.close()
