"""mode="global" and DistributedShuffleSampler: the row selection every mode maps to, one
segment per node shared by every world size, DistributedSampler's exact order as index
tensors, resume, and a real 2-rank DDP job covering every row once per epoch."""

from __future__ import annotations

import json
from itertools import chain, islice
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler

from h5serve.client import DistributedShuffleSampler, SharedH5Dataset, make_loader
from h5serve.client.samplers.shuffle import distributed_num_samples
from h5serve.errors import ConfigError
from h5serve.order.sharding import ALL_MODES, GLOBAL, RowRange, Selection, shard_sizes

from ..helpers import Daemon, h5serve_cli, make_h5, torchrun_two_ranks

pytestmark = pytest.mark.timeout(240)

JOB = Path(__file__).resolve().parent.parent / "jobs" / "global_job.py"


def flat(batches: list[list[int]]) -> list[int]:
    return list(chain.from_iterable(batches))


# --------------------------------------------------------------------------- row selections


@given(total=st.integers(0, 600), world=st.integers(1, 12), data=st.data())
def test_every_selection_is_one_canonical_range(total: int, world: int, data: st.DataObject) -> None:
    rank = data.draw(st.integers(0, world - 1))
    mode = data.draw(st.sampled_from(ALL_MODES))
    sel = Selection(mode, world, rank)
    rows = sel.rows(total)
    np.testing.assert_array_equal(rows.indices(), sel.indices(total))
    assert len(rows) == sel.count(total) and rows == RowRange.of(rows.start, len(rows), rows.step)
    if len(rows) <= 1:
        assert rows.step == 1  # one row (or none) is the same range in every mode
    # the same rows give the same range, whatever mode, world size and rank asked for them
    for other in (Selection("contiguous", 1, 0), Selection("interleave", 1, 0), Selection(GLOBAL, world, rank)):
        assert (other.rows(total) == rows) == np.array_equal(other.indices(total), sel.indices(total))


def test_global_sizes_and_indices() -> None:
    assert Selection(GLOBAL, 3, 2).rows(10) == RowRange(0, 10, 1) == Selection("contiguous", 1, 0).rows(10)
    assert shard_sizes(10, 3, GLOBAL) == [10, 10, 10]
    assert RowRange(0, 10).covers(10) and not RowRange(0, 9).covers(10)
    assert Selection("interleave", 4, 1).rows(10) == RowRange(1, 10, 4) and str(RowRange(1, 10, 4)) == "1:10:4"


# --------------------------------------------------------------------------- the sampler


def torch_indices(n: int, world: int, rank: int, seed: int, epoch: int, drop_last: bool, shuffle: bool) -> list[int]:
    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 700), world=st.integers(1, 9), batch=st.integers(1, 100), seed=st.integers(0, 2**31),
       epoch=st.integers(0, 30), drop_last=st.booleans(), shuffle=st.booleans(), data=st.data())
def test_sampler_is_distributed_sampler_index_for_index(n: int, world: int, batch: int, seed: int, epoch: int,
                                                        drop_last: bool, shuffle: bool, data: st.DataObject) -> None:
    rank = data.draw(st.integers(0, world - 1))
    sampler = DistributedShuffleSampler(n, batch, world, rank, seed=seed, drop_last=drop_last, shuffle=shuffle)
    sampler.set_epoch(epoch)
    batches = list(sampler)
    want = torch_indices(n, world, rank, seed, epoch, drop_last, shuffle)
    assert all(b.dtype == torch.int64 for b in batches) and len(batches) == len(sampler)
    assert [i for b in batches for i in b.tolist()] == want
    assert all(len(b) == batch for b in batches[:-1])
    # every rank: the same batches of the same sizes (no DDP hang)
    others = [DistributedShuffleSampler(n, batch, world, r, seed=seed, drop_last=drop_last) for r in range(world)]
    assert {tuple(len(b) for b in o) for o in others} == {tuple(len(b) for b in batches)}


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 500), world=st.integers(1, 6), batch=st.integers(1, 40), seed=st.integers(0, 2**31),
       drop_last=st.booleans())
def test_drop_last_batch_is_dataloader_drop_last(n: int, world: int, batch: int, seed: int, drop_last: bool) -> None:
    per_rank = (n // world) if drop_last else -(-n // world)
    if per_rank < batch:
        with pytest.raises(ConfigError, match="no batch"):
            DistributedShuffleSampler(n, batch, world, 0, seed=seed, drop_last=drop_last, drop_last_batch=True)
        return
    for rank in range(world):
        ours = DistributedShuffleSampler(n, batch, world, rank, seed=seed, drop_last=drop_last, drop_last_batch=True)
        plain = DataLoader(range(n), batch_size=batch, drop_last=True,
                           sampler=DistributedSampler(range(n), world, rank, seed=seed, drop_last=drop_last))
        assert [b.tolist() for b in ours] == [b.tolist() for b in plain]


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 400), world=st.integers(1, 5), batch=st.integers(1, 30), seed=st.integers(0, 2**31),
       epoch=st.integers(0, 9), cut=st.floats(0, 1), drop_last=st.booleans())
def test_resume_mid_epoch_same_world_size(n: int, world: int, batch: int, seed: int, epoch: int, cut: float,
                                          drop_last: bool) -> None:
    for rank in range(world):
        first = DistributedShuffleSampler(n, batch, world, rank, seed=seed, drop_last=drop_last)
        first.set_epoch(epoch)
        full = list(first)
        steps = int(cut * len(full))
        state = first.state_dict(consumed=sum(len(b) for b in full[:steps]))
        done = state["consumed"] == sum(len(b) for b in full)  # a finished epoch is all consumed
        assert state["consumed_global"] == (n if done else min(state["consumed"] * world, n))
        assert state["mode"] == "global"
        again = DistributedShuffleSampler(n, batch, world, rank, seed=0, drop_last=drop_last)
        again.load_state_dict(json.loads(json.dumps(state)))  # a checkpoint survives serialisation
        assert len(again) == len(full) - steps
        assert [b.tolist() for b in full[:steps] + list(again)] == [b.tolist() for b in full]
        assert [b.tolist() for b in again] == [b.tolist() for b in full]  # the resume applies once


def _consume(samplers: list[DistributedShuffleSampler], batches: int) -> tuple[list[int], dict]:
    """``batches`` batches from every rank (fewer if the epoch ends): the samples all ranks
    trained on and rank 0's checkpoint."""
    seen: list[int] = []
    for sampler in samplers:
        seen += flat([b.tolist() for b in islice(sampler, batches)])
    states = [s.state_dict() for s in samplers]  # what each has handed out: the same on every rank
    assert all(s == {**states[0], "consumed": s["consumed"]} for s in states)
    assert len({s["consumed"] for s in states}) == 1
    return seen, states[0]


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 300), worlds=st.lists(st.integers(1, 6), min_size=2, max_size=3),
       batch=st.integers(1, 20), seed=st.integers(0, 2**31), epoch=st.integers(0, 5),
       cuts=st.lists(st.integers(0, 8), min_size=2, max_size=2), drop_last=st.booleans(),
       drop_last_batch=st.booleans())
def test_elastic_resume_sees_the_rest_of_the_epoch_once(n: int, worlds: list[int], batch: int, seed: int,
                                                      epoch: int, cuts: list[int], drop_last: bool,
                                                      drop_last_batch: bool) -> None:
    """A job of W0 ranks stops after a few batches; jobs of other world sizes go on from its
    checkpoint (twice over): together they see the epoch's samples once, padding aside."""
    if drop_last_batch and any(distributed_num_samples(n, w, drop_last) < batch for w in worlds):
        return  # such a job is refused: no full batch on any rank (tested elsewhere)
    seen: list[int] = []
    state = None
    for i, world in enumerate(worlds):
        samplers = [DistributedShuffleSampler(n, batch, world, r, seed=0 if state else seed, drop_last=drop_last,
                                              drop_last_batch=drop_last_batch) for r in range(world)]
        for sampler in samplers:
            if state is None:
                sampler.set_epoch(epoch)
            else:
                sampler.load_state_dict(json.loads(json.dumps(state)))
        lengths = {len(s) for s in samplers}
        assert len(lengths) == 1  # every rank the same number of batches, after a resume too
        last = i == len(worlds) - 1
        part, state = _consume(samplers, 10**6 if last else cuts[i])
        seen += part
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    assert state["consumed_global"] == n and state["epoch"] == epoch
    # a sample seen twice is padding: each pass pads at most world_size - 1 positions
    assert len(seen) - len(set(seen)) <= (0 if drop_last else sum(w - 1 for w in worlds))
    assert set(seen) <= set(perm)
    missing = set(perm) - set(seen)
    if not drop_last and not drop_last_batch:
        assert not missing  # nothing of the epoch skipped
    else:  # only the tails a drop cut, never more than a batch per rank per job, or a world's remainder
        assert len(missing) < sum(w * batch + w for w in worlds)


def test_elastic_resume_continues_the_permutation() -> None:
    """Concretely: 2 ranks stop after 16 samples each (32 of the permutation); 3 ranks deal
    the permutation from position 32 on, DistributedSampler style."""
    state = DistributedShuffleSampler(100, 8, 2, 0, seed=1).state_dict(consumed=16)
    assert state["consumed_global"] == 32
    perm = torch.randperm(100, generator=torch.Generator().manual_seed(1)).tolist()
    rest = perm[32:] + perm[32:33]  # 68 left, padded to 69 for 3 ranks, as DistributedSampler pads
    for rank in range(3):
        sampler = DistributedShuffleSampler(100, 8, 3, rank)
        sampler.load_state_dict(state)
        assert len(sampler) == 3 and flat([b.tolist() for b in sampler]) == rest[rank::3]
        # the resume applies once: the epoch again is DistributedSampler's whole epoch for 3 ranks
        assert len(sampler) == 5
        assert flat([b.tolist() for b in sampler]) == torch_indices(100, 3, rank, 1, 0, False, True)


def test_resume_refuses_what_it_cannot_continue() -> None:
    state = DistributedShuffleSampler(100, 8, 2, 0, seed=1).state_dict(consumed=16)
    for bad in ({"consumed_global": 101}, {"consumed_global": -1}, {"offset": "3"}, {"consumed": 99}):
        with pytest.raises(ConfigError, match="consumed|offset"):
            DistributedShuffleSampler(100, 8, 2, 0).load_state_dict({**state, **bad})
    with pytest.raises(ConfigError, match="100 rows.*101"):
        DistributedShuffleSampler(101, 8, 2, 0).load_state_dict(state)
    with pytest.raises(ConfigError, match="keys"):
        DistributedShuffleSampler(100, 8, 2, 0).load_state_dict({"epoch": 1})
    other = DistributedShuffleSampler(100, 8, 4, 3)
    other.load_state_dict({**state, "epoch": 5}, next_epoch=True)  # any world size at an epoch boundary
    assert other.epoch == 6 and [b.tolist() for b in other] == [
        b.tolist() for b in torch.tensor(torch_indices(100, 4, 3, 1, 6, False, True)).split(8)]
    with pytest.raises(ConfigError, match="batch_size"):
        DistributedShuffleSampler(100, 0, 2, 0)
    with pytest.raises(ConfigError, match="rank"):
        DistributedShuffleSampler(100, 8, 2, 2)


# --------------------------------------------------------------------------- on a real daemon


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_h5(tmp_path_factory.mktemp("global") / "train.h5", rows=1000)


def open_global(path: Path, daemon: Daemon, world: int, rank: int, **kwargs) -> SharedH5Dataset:
    return SharedH5Dataset(path, "x", "y", mode=GLOBAL, rank=rank, world_size=world, runtime_dir=daemon.runtime_dir,
                           fallback="error", **kwargs)


def segments_of(daemon: Daemon, path: Path) -> list[dict]:
    return [s for s in daemon.status()["segments"] if s["file"] == str(path)]


def test_global_dataset_is_the_whole_file_once_per_node(daemon: Daemon, data_file: Path) -> None:
    a = open_global(data_file, daemon, world=2, rank=1)
    assert a.backend == "shm" and len(a) == a.total_rows == 1000
    np.testing.assert_array_equal(a.indices, np.arange(1000))
    assert a.shard_sizes() == [1000, 1000]
    loads = daemon.status()["counters"]["loads"]
    assert loads == 2  # x and y, once
    held = segments_of(daemon, data_file)
    assert sorted(s["key"] for s in held) == ["x", "y"]
    assert all(s["mode"] == GLOBAL and s["whole_file"] and s["selection"] == "0:1000:1" for s in held)
    table = h5serve_cli("status", env=daemon.env).stdout
    assert "global" in table and "all" in table

    # another job with another world size, and a world-size-1 job in any mode: the same segments
    b = open_global(data_file, daemon, world=3, rank=2)
    c = SharedH5Dataset(data_file, "x", "y", mode="contiguous", rank=0, world_size=1, runtime_dir=daemon.runtime_dir,
                        fallback="error")
    d = SharedH5Dataset(data_file, "x", mode="interleave", rank=0, world_size=1, runtime_dir=daemon.runtime_dir,
                        fallback="error")
    status = daemon.status()
    assert status["counters"]["loads"] == loads  # nothing loaded again
    held = segments_of(daemon, data_file)
    assert len(held) == 2 and {s["holders"] for s in held if s["key"] == "x"} == {4}
    assert held[0]["modes"] == ["contiguous", "global", "interleave"] or held[1]["modes"] == [
        "contiguous", "global", "interleave"]
    every = list(range(1000))
    for ds in (b, c, d):
        assert [s.name for s in ds._backend.segments][:1] == [s.name for s in a._backend.segments][:1]
    whole = a.__getitems__(every)
    xa, ya = whole.x, whole.y
    for ds in (b, c):
        got = ds.__getitems__(every)
        assert torch.equal(xa, got.x) and torch.equal(ya, got.y)
    assert torch.equal(d.__getitems__(every).x, xa)

    # a sharded job whose rows differ gets its own segment
    e = SharedH5Dataset(data_file, "x", mode="contiguous", rank=0, world_size=2, runtime_dir=daemon.runtime_dir,
                        fallback="error")
    assert daemon.status()["counters"]["loads"] == loads + 1 and torch.equal(e.__getitems__(range(500)).x, xa[:500])
    for ds in (a, b, c, d, e):
        ds.close()


def test_preload_global_then_any_world_size_attaches(daemon: Daemon, data_file: Path) -> None:
    done = h5serve_cli("preload", str(data_file), "--x-key", "x", "--y-key", "y", "--mode", "global",
                       env=daemon.env)
    assert done.returncode == 0, done.stderr
    loads = daemon.status()["counters"]["loads"]
    assert loads == 2 and all(s["whole_file"] for s in segments_of(daemon, data_file))
    for world in (1, 2, 5):
        open_global(data_file, daemon, world=world, rank=world - 1).close()
    assert daemon.status()["counters"]["loads"] == loads
    bad = h5serve_cli("preload", str(data_file), "--x-key", "x", "--mode", "global", "--ranks", "0", env=daemon.env)
    assert bad.returncode != 0 and "--ranks" in bad.stderr


def test_lazy_fallback_gives_identical_samples(daemon: Daemon, data_file: Path, no_daemon_env: Path) -> None:
    shm = open_global(data_file, daemon, world=2, rank=0)
    with pytest.warns(RuntimeWarning, match="lazily"):
        lazy = SharedH5Dataset(data_file, "x", "y", mode=GLOBAL, rank=0, world_size=2, runtime_dir=no_daemon_env)
    assert (shm.backend, lazy.backend) == ("shm", "lazy")
    np.testing.assert_array_equal(shm.indices, lazy.indices)
    for loader_a, loader_b in ((make_loader(shm, 96, seed=5), make_loader(lazy, 96, seed=5)),):
        for epoch in (0, 1):
            loader_a.batch_sampler.set_epoch(epoch)
            loader_b.batch_sampler.set_epoch(epoch)
            pairs = list(zip(loader_a, loader_b))
            assert len(pairs) == len(loader_a) == 6  # ceil(500 / 96)
            for (xa, ya), (xb, yb) in pairs:
                assert torch.equal(xa, xb) and torch.equal(ya, yb)
    shm.close()
    lazy.close()


def test_make_loader_on_global_is_distributed_sampler(daemon: Daemon, data_file: Path) -> None:
    """Both ranks of a 2-rank job, in one process: make_loader picks DistributedShuffleSampler
    with the dataset's world size and rank, so the ranks split every epoch between them."""
    datasets = [open_global(data_file, daemon, world=2, rank=r) for r in range(2)]
    loaders = [make_loader(ds, 64, seed=9) for ds in datasets]
    assert all(isinstance(loader.batch_sampler, DistributedShuffleSampler) for loader in loaders)
    for epoch in (0, 3):
        seen = []
        for rank, loader in enumerate(loaders):
            loader.batch_sampler.set_epoch(epoch)
            labels = [y.tolist() for _, y in loader]
            assert [len(b) for b in labels] == [64] * 7 + [52]
            assert flat(labels) == torch_indices(1000, 2, rank, 9, epoch, False, True)
            seen += flat(labels)
        assert sorted(seen) == list(range(1000))
    for ds in datasets:
        ds.close()


# --------------------------------------------------------------------------- a real DDP job


def run_job(path: Path, out: Path, runtime_dir: Path, deadline: float = 200,
            extra: list[str] | None = None) -> list[dict]:
    """torchrun with 2 gloo ranks; killed (with everything it started) at ``deadline``."""
    return torchrun_two_ranks(JOB, [str(path), str(out), *(extra or [])], out, runtime_dir, deadline)


@pytest.mark.slow
@pytest.mark.timeout(260)
def test_ddp_job_in_global_mode_sees_every_row_once_per_epoch(tmp_path: Path, daemon: Daemon,
                                                              data_file: Path) -> None:
    """2 gloo ranks, global mode, 1000 rows, batch 64, 2 epochs: make_loader (0 and 2 workers)
    and torch's DistributedSampler with a plain DataLoader each cover every row exactly once per
    epoch with equal batches on both ranks, and agree with each other sample for sample."""
    reports = run_job(data_file, tmp_path / "out", daemon.runtime_dir)
    assert [r["backend"] for r in reports] == ["shm", "shm"] and [r["len"] for r in reports] == [1000, 1000]
    assert reports[0]["indices"] == reports[1]["indices"] == list(range(1000))
    segments = segments_of(daemon, data_file)
    assert len(segments) == 2 and all(s["whole_file"] for s in segments)  # one copy for the node
    assert daemon.status()["counters"]["loads"] == 2
    runs = reports[0]["runs"]
    for name in runs:
        for epoch in range(2):
            batches = [r["runs"][name][epoch] for r in reports]
            assert [len(b) for b in batches[0]] == [len(b) for b in batches[1]] == [64] * 7 + [52]
            assert sorted(flat(batches[0] + batches[1])) == list(range(1000))  # every row exactly once
        assert runs[name][0] != runs[name][1]  # reshuffled per epoch
    for report in reports:  # h5serve's sampler is DistributedSampler's order, with or without workers
        assert report["runs"]["make:0"] == report["runs"]["make:2"] == report["runs"]["torch"]
