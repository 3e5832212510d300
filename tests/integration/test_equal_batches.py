"""Every rank gets the same number of batches per epoch from make_loader (h5serve/order/equalise.py):
the pure function, the samplers, make_loader over real datasets, and a real 2-rank DDP job
that hung before (513 rows, batch 256: rank 0 had 2 batches, rank 1 one)."""

from __future__ import annotations

from itertools import chain
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from h5serve.client import EpochBatchSampler, EpochShuffleSampler, SharedH5Dataset, make_loader
from h5serve.errors import ConfigError
from h5serve.order.equalise import EpochSize, equal_epoch_size
from h5serve.order.sharding import MODES, Selection, shard_sizes

from ..helpers import Daemon, make_h5, torchrun_two_ranks

pytestmark = pytest.mark.timeout(240)

JOB = Path(__file__).resolve().parent.parent / "jobs" / "equal_batches_job.py"


def flat(batches: list[list[int]]) -> list[int]:
    return list(chain.from_iterable(batches))


# --------------------------------------------------------------------------- the pure function


@pytest.mark.parametrize(
    "sizes, batch, drop_last, expected",
    [
        ([257, 256], 256, False, EpochSize(257, 2)),  # the hang: rank 1 pads one sample
        ([257, 256], 256, True, EpochSize(256, 1)),
        ([334, 333, 333], 32, False, EpochSize(334, 11)),
        ([334, 333, 333], 32, True, EpochSize(320, 10)),
        ([5], 2, False, EpochSize(5, 3)),
        ([5], 5, True, EpochSize(5, 1)),
        ([0, 0], 4, False, EpochSize(0, 0)),  # nothing anywhere: no batch anywhere, no hang
        ([3, 7, 5], 4, False, EpochSize(7, 2)),  # any sizes (the seam for other sampling modes)
        ([3, 7, 5], 3, True, EpochSize(3, 1)),
    ],
)
def test_equal_epoch_size_known_values(sizes: list[int], batch: int, drop_last: bool, expected: EpochSize) -> None:
    assert equal_epoch_size(sizes, batch, drop_last) == expected


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 60), min_size=1, max_size=8), batch=st.integers(1, 70),
       drop_last=st.booleans(), seed=st.integers(0, 2**31))
def test_any_shard_sizes_pad_with_their_own_order(sizes: list[int], batch: int, drop_last: bool, seed: int) -> None:
    """Shards of any sizes (other sampling modes will have more than one row of difference):
    a small shard wraps around its own order as often as it takes, every rank the same batches."""
    if drop_last and min(sizes) < batch:
        with pytest.raises(ConfigError, match="no batch"):
            equal_epoch_size(sizes, batch, drop_last)
        return
    want = equal_epoch_size(sizes, batch, drop_last)
    assert want.samples == (min(sizes) // batch * batch if drop_last else max(sizes))
    assert want.batches == -(-want.samples // batch)
    shapes = set()
    for n in sizes:
        got = list(EpochBatchSampler(EpochShuffleSampler(n, seed=seed), batch, drop_last, shard_sizes=sizes))
        shapes.add(tuple(len(b) for b in got))
        base = unpadded_order(n, seed, 0)
        assert torch.equal(torch.cat(got), base[torch.arange(want.samples) % n])
    assert len(shapes) == 1


@pytest.mark.parametrize(
    "sizes, batch, drop_last, match",
    [
        ([129, 128, 128, 128], 256, True, (r"rank 1's shard has 128 rows, fewer than batch_size 256 .*"
                                           r"4 ranks hold 128 to 129 rows.*at most 128, drop_last=False")),
        ([0, 0], 1, True, "rank 0's shard has 0 rows"),
        ([1, 1, 1, 0], 8, False, r"rank 3 has no rows.*other ranks' 1 batches.*fewer ranks"),
        ([], 8, False, "at least one"),
        ([4, -1], 8, False, "non-negative"),
        ([4], 0, False, "batch_size must be a positive integer"),
    ],
)
def test_equal_epoch_size_refuses_what_leaves_a_rank_without_batches(sizes, batch, drop_last, match) -> None:
    with pytest.raises(ConfigError, match=match):
        equal_epoch_size(sizes, batch, drop_last)


@given(total=st.integers(0, 5000), world=st.integers(1, 40), mode=st.sampled_from(MODES))
def test_shard_sizes_are_every_ranks_count(total: int, world: int, mode: str) -> None:
    sizes = shard_sizes(total, world, mode)
    assert sizes == [Selection(mode, world, r).count(total) for r in range(world)]
    assert sizes == Selection(mode, world, world - 1).sizes(total) and sum(sizes) == total


# --------------------------------------------------------------------------- the samplers


def rank_batches(total: int, world: int, rank: int, mode: str, batch: int, drop_last: bool, seed: int,
                 epoch: int, shuffle: bool = True) -> tuple[EpochBatchSampler, list[torch.Tensor]]:
    n = Selection(mode, world, rank).count(total)
    batches = EpochBatchSampler(EpochShuffleSampler(n, seed=seed, shuffle=shuffle), batch, drop_last,
                                shard_sizes=shard_sizes(total, world, mode))
    batches.set_epoch(epoch)
    return batches, list(batches)


def unpadded_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    plain = EpochShuffleSampler(n, seed=seed, shuffle=shuffle)
    plain.set_epoch(epoch)
    return plain.order()


@settings(max_examples=300, deadline=None)
@given(total=st.integers(0, 700), world=st.integers(1, 9), batch=st.integers(1, 300), drop_last=st.booleans(),
       mode=st.sampled_from(MODES), seed=st.integers(0, 2**31), epoch=st.integers(0, 20), shuffle=st.booleans())
def test_every_rank_gets_the_same_batches(total: int, world: int, batch: int, drop_last: bool, mode: str,
                                          seed: int, epoch: int, shuffle: bool) -> None:
    sizes = shard_sizes(total, world, mode)
    if (drop_last and min(sizes) < batch) or (not drop_last and min(sizes) == 0 < max(sizes)):
        with pytest.raises(ConfigError, match="no batch|no rows"):
            rank_batches(total, world, world - 1, mode, batch, drop_last, seed, epoch)
        return
    want = equal_epoch_size(sizes, batch, drop_last)
    shapes = set()
    for rank in range(world):
        sampler, got = rank_batches(total, world, rank, mode, batch, drop_last, seed, epoch, shuffle)
        assert len(got) == len(sampler) == want.batches
        shapes.add(tuple(len(b) for b in got))
        n = sizes[rank]
        order = torch.cat(got) if got else torch.empty(0, dtype=torch.int64)
        base = unpadded_order(n, seed, epoch, shuffle)
        assert len(order) == want.samples
        # padding repeats the rank's own order from its start; drop_last cuts it
        assert torch.equal(order, base[torch.arange(want.samples) % max(n, 1)] if n else base)
        if drop_last:
            assert want.samples == min(sizes) // batch * batch and all(len(b) == batch for b in got)
        else:  # every row of the shard once, then the repeats
            assert want.samples == max(sizes) and sorted(order[:n].tolist()) == list(range(n))
    assert len(shapes) == 1  # batch k has the same size on every rank


@settings(max_examples=150, deadline=None)
@given(total=st.integers(1, 400), world=st.integers(1, 6), batch=st.integers(1, 40), drop_last=st.booleans(),
       mode=st.sampled_from(MODES), seed=st.integers(0, 2**31), epoch=st.integers(0, 9), cut=st.floats(0, 1))
def test_resume_mid_epoch_continues_the_padded_order(total: int, world: int, batch: int, drop_last: bool,
                                                     mode: str, seed: int, epoch: int, cut: float) -> None:
    sizes = shard_sizes(total, world, mode)
    if min(sizes) == 0 or (drop_last and min(sizes) < batch):
        return
    rank = world - 1  # the smallest shard: the one that pads
    first, full = rank_batches(total, world, rank, mode, batch, drop_last, seed, epoch)
    steps = int(cut * len(full))
    consumed = sum(len(b) for b in full[:steps])  # may lie in the padded tail
    state = first.state_dict(consumed=consumed)
    again, _ = rank_batches(total, world, rank, mode, batch, drop_last, 0, 0)
    again.load_state_dict(state)
    assert len(again) == len(full) - steps
    rest = list(again)
    assert [b.tolist() for b in full[:steps] + rest] == [b.tolist() for b in full]
    assert [b.tolist() for b in again] == [b.tolist() for b in full]  # the resume applies once


def test_plain_sampler_keeps_the_predecessor_epoch() -> None:
    """Alone, EpochShuffleSampler is the predecessor's: one epoch is the shard, unpadded, so a
    plain DataLoader gives 2 batches to a 257-row shard and 1 to a 256-row one (why make_loader
    equalises)."""
    a, b = EpochShuffleSampler(257, seed=3), EpochShuffleSampler(256, seed=3)
    assert len(a) == len(list(a)) == 257 and a.epoch_length == 257 and len(list(b)) == 256
    g = torch.Generator()
    g.manual_seed(3)
    assert torch.equal(a.order(), torch.randperm(257, generator=g))
    assert len(DataLoader(range(257), batch_size=256, sampler=a)) == 2
    assert len(DataLoader(range(256), batch_size=256, sampler=b)) == 1


def test_batch_sampler_refuses_mismatched_shards_and_shared_samplers() -> None:
    with pytest.raises(ConfigError, match="covers 10 samples, but no rank's shard has that many"):
        EpochBatchSampler(EpochShuffleSampler(10), 4, shard_sizes=[12, 11])
    shared = EpochShuffleSampler(11)
    EpochBatchSampler(shared, 4, shard_sizes=[12, 11])
    EpochBatchSampler(shared, 4, shard_sizes=[12, 11])  # the same equalisation again is fine
    with pytest.raises(ConfigError, match="already yields 12 samples per epoch, this loader needs 8"):
        EpochBatchSampler(shared, 4, drop_last=True, shard_sizes=[12, 11])
    with pytest.raises(ConfigError, match="cannot be padded"):
        EpochShuffleSampler(0, epoch_length=3)


def test_state_beyond_the_epoch_is_refused() -> None:
    sampler = EpochShuffleSampler(11, epoch_length=12)
    state = sampler.state_dict(consumed=12)  # the whole padded epoch
    assert state["consumed"] == 12
    with pytest.raises(ConfigError, match=r"consumed must be in \[0, 12\]"):
        sampler.state_dict(consumed=13)
    cut = EpochShuffleSampler(11, epoch_length=8)
    with pytest.raises(ConfigError, match=r"outside \[0, 8\].*batch size, drop_last and world size"):
        cut.load_state_dict(state)


# --------------------------------------------------------------------------- make_loader


@pytest.fixture(scope="module")
def rows513(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_h5(tmp_path_factory.mktemp("eq") / "train.h5", rows=513)


def shard_loaders(path: Path, daemon: Daemon, mode: str, world: int = 2, **kwargs) -> list:
    datasets = [SharedH5Dataset(path, "x", "y", mode=mode, rank=r, world_size=world, fallback="error",
                                runtime_dir=daemon.runtime_dir) for r in range(world)]
    return [(ds, make_loader(ds, **kwargs)) for ds in datasets]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("drop_last", [False, True])
def test_make_loader_513_rows_two_ranks(rows513: Path, shared_daemon: Daemon, mode: str, drop_last: bool) -> None:
    loaders = shard_loaders(rows513, shared_daemon, mode, batch_size=256, seed=4, drop_last=drop_last)
    assert [len(ds) for ds, _ in loaders] == [257, 256]
    for epoch in (0, 1):
        per_rank = []
        for ds, loader in loaders:
            loader.batch_sampler.set_epoch(epoch)
            labels = [y.tolist() for _, y in loader]
            assert len(labels) == len(loader) == (1 if drop_last else 2)
            assert set(flat(labels)) <= set(ds.indices.tolist())  # only the rank's own rows
            per_rank.append(labels)
        assert [len(b) for b in per_rank[0]] == [len(b) for b in per_rank[1]]
        rows = [y for labels in per_rank for y in flat(labels)]
        if drop_last:
            assert [len(b) for b in per_rank[0]] == [256] and len(set(rows)) == 512
        else:  # every row once, and rank 1's first sample of the epoch once more at its end
            assert sorted(set(rows)) == list(range(513)) and len(rows) == 514
            assert per_rank[1][-1] == [per_rank[1][0][0]]
    for ds, _ in loaders:
        ds.close()


def test_make_loader_too_small_for_drop_last(rows513: Path, shared_daemon: Daemon) -> None:
    ds = SharedH5Dataset(rows513, "x", "y", rank=0, world_size=4, fallback="error",
                         runtime_dir=shared_daemon.runtime_dir)
    try:
        assert ds.shard_sizes() == [129, 128, 128, 128]
        with pytest.raises(ConfigError, match=r"drop_last=True leaves no batch.*128 rows, fewer than batch_size 256"):
            make_loader(ds, 256, drop_last=True)
        assert len(make_loader(ds, 128, drop_last=True)) == 1
        assert len(make_loader(ds, 256)) == 1  # drop_last=False: every rank pads to 129 rows
    finally:
        ds.close()


def test_make_loader_resume_in_the_padded_tail_with_workers(rows513: Path, shared_daemon: Daemon) -> None:
    """Rank 1 (256 rows) pads to 257: 5 batches of 64 (the last one the repeated sample). A
    checkpoint taken with workers after 4 batches resumes, without workers, at the pad."""
    ds = SharedH5Dataset(rows513, "x", "y", rank=1, world_size=2, fallback="error",
                         runtime_dir=shared_daemon.runtime_dir)
    try:
        sampler = EpochShuffleSampler(len(ds), seed=8)
        loader = make_loader(ds, 64, sampler=sampler, num_workers=2, timeout=60)
        sampler.set_epoch(2)
        whole = [y.tolist() for _, y in loader]
        assert [len(b) for b in whole] == [64, 64, 64, 64, 1] and whole[-1] == [whole[0][0]]
        seen = []
        for step, (_, y) in enumerate(loader):
            seen.append(y.tolist())
            if step == 3:
                break
        state = sampler.state_dict(consumed=(step + 1) * 64)  # the workers prefetched more
        del loader
        resumed = make_loader(ds, 64, sampler=EpochShuffleSampler(len(ds), seed=0))
        resumed.batch_sampler.load_state_dict(state)
        assert seen + [y.tolist() for _, y in resumed] == whole
    finally:
        ds.close()


# --------------------------------------------------------------------------- a real DDP job


def run_job(path: Path, out: Path, runtime_dir: Path, configs: list[str], deadline: float = 150) -> list[dict]:
    """torchrun with 2 gloo ranks; killed (with everything it started) at ``deadline``."""
    return torchrun_two_ranks(JOB, [str(path), str(out), "--configs", ",".join(configs), "--collective-timeout", "60"],
                              out, runtime_dir, deadline)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("drop_last", [False, True])
def test_ddp_job_513_rows_finishes_every_epoch(tmp_path: Path, rows513: Path, shared_daemon: Daemon, mode: str,
                                               drop_last: bool) -> None:
    """2 ranks, 513 rows, batch 256, 2 epochs of DDP training: every rank runs the same batches
    and the job ends. One torchrun launch per (mode, drop_last) trains with 0 then 2 workers (a
    launch costs ~15 s here, so the two loaders take turns in it)."""
    configs = [f"{mode}:{int(drop_last)}:{workers}" for workers in (0, 2)]
    reports = run_job(rows513, tmp_path / "out", shared_daemon.runtime_dir, configs)
    assert [r["backends"] for r in reports] == [["shm"], ["shm"]]
    for config in configs:
        for epoch in range(2):
            batches = [r["runs"][config][epoch] for r in reports]
            assert [len(b) for b in batches[0]] == [len(b) for b in batches[1]] == ([256] if drop_last else [256, 1])
            for report, got in zip(reports, batches):
                assert set(flat(got)) <= set(report["indices"][mode])
            rows = flat(batches[0] + batches[1])
            assert len(set(rows)) == (512 if drop_last else 513)
        assert reports[0]["runs"][config][0] != reports[0]["runs"][config][1]  # reshuffled per epoch
