"""mode="node" and NodeShuffleSampler: a node's rows (the union of its ranks' contiguous
shards) in one segment per node, permuted per epoch from (seed, epoch, node) and dealt to the
node's ranks with equal counts on every rank of every node; resume; a real 2-rank DDP job."""

from __future__ import annotations

from itertools import chain
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from h5serve.client import NodePlace, NodeShuffleSampler, SharedH5Dataset, make_loader
from h5serve.errors import ConfigError
from h5serve.order.sharding import NODE, Selection, node_selection, shard_sizes

from ..helpers import Daemon, make_h5
from .test_global_mode import run_job, segments_of

pytestmark = pytest.mark.timeout(240)


def flat(batches) -> list[int]:
    return [int(i) for i in chain.from_iterable(batches)]


def node_samplers(total: int, nodes: int, local: int, batch: int, *, seed: int = 0, drop_last: bool = False,
                  shuffle: bool = True) -> list[list[NodeShuffleSampler]]:
    """Every rank's sampler of a uniform layout (nodes x local), node by node."""
    world = nodes * local
    sizes = shard_sizes(total, world)
    out = []
    for node in range(nodes):
        rows = len(node_selection(world, range(node * local, (node + 1) * local)).rows(total))
        out.append([NodeShuffleSampler(rows, batch, NodePlace(lr, local, node, nodes), sizes, seed=seed,
                                       shuffle=shuffle, drop_last=drop_last) for lr in range(local)])
    return out


# --------------------------------------------------------------------------- selections and sampler


def test_node_selection_is_the_union_of_contiguous_shards() -> None:
    for total, world, ranks in ((10, 4, (0, 1)), (10, 4, (2, 3)), (513, 6, (3, 4, 5)), (7, 3, (0, 1, 2))):
        sel = node_selection(world, ranks)
        union = np.concatenate([Selection("contiguous", world, r).indices(total) for r in ranks])
        np.testing.assert_array_equal(sel.indices(total), union)
        assert sel.rows(total).step == 1 and sel.sizes(total) == shard_sizes(total, world)
    with pytest.raises(ConfigError, match="consecutive.*distribution=block"):
        node_selection(4, (0, 2))
    with pytest.raises(ConfigError, match="span"):
        Selection("contiguous", 4, 0, 2)
    with pytest.raises(ConfigError, match="past the last rank"):
        Selection(NODE, 4, 3, 2)


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 400), nodes=st.integers(1, 4), local=st.integers(1, 4), batch=st.integers(1, 40),
       seed=st.integers(0, 2**31), epoch=st.integers(0, 5), drop_last=st.booleans())
def test_every_rank_gets_equal_counts_across_nodes(total: int, nodes: int, local: int, batch: int, seed: int,
                                                   epoch: int, drop_last: bool) -> None:
    world = nodes * local
    if total < world or (drop_last and total // world < batch):
        return
    samplers = node_samplers(total, nodes, local, batch, seed=seed, drop_last=drop_last)
    counts, batch_sizes = set(), set()
    for node in samplers:
        dealt = []
        for s in node:
            s.set_epoch(epoch)
            batches = [b.tolist() for b in s]
            counts.add(len(flat(batches)))
            batch_sizes.add(tuple(map(len, batches)))
            assert len(s) == len(batches)
            dealt += flat(batches)
        rows = node[0].data_len
        assert set(dealt) <= set(range(rows))
        if not drop_last:
            assert set(dealt) == set(range(rows))  # every row of the node dealt
        else:
            assert len(dealt) == len(set(dealt))  # nothing twice
        if not drop_last and rows % local == 0 and total % world == 0:
            assert sorted(dealt) == list(range(rows))  # each exactly once
    assert len(counts) == 1 and len(batch_sizes) == 1  # every rank of every node alike


def test_permutation_differs_per_epoch_and_node() -> None:
    (a0, a1), (b0, b1) = node_samplers(1000, 2, 2, 50, seed=3)
    orders = {}
    for epoch in range(3):
        for s in (a0, b0):
            s.set_epoch(epoch)
        orders[epoch] = (a0.node_order().tolist(), b0.node_order().tolist())
    assert orders[0][0] != orders[1][0] != orders[2][0]
    assert orders[0][0] != orders[0][1]  # each node its own permutation
    again = node_samplers(1000, 2, 2, 50, seed=3)[0][0]
    assert again.node_order().tolist() == orders[0][0]  # deterministic from (seed, epoch, node)


@settings(max_examples=30, deadline=None)
@given(total=st.integers(8, 300), local=st.integers(1, 3), batch=st.integers(1, 30), cut=st.floats(0, 1),
       epoch=st.integers(0, 3))
def test_resume_is_exact_with_the_same_layout(total: int, local: int, batch: int, cut: float, epoch: int) -> None:
    s = node_samplers(total, 2, local, batch, seed=7)[1][local - 1]
    s.set_epoch(epoch)
    full = [b.tolist() for b in s]
    done = int(cut * len(full))
    state = s.state_dict(consumed=sum(map(len, full[:done])))
    assert state["consumed_global"] == state["consumed"] * 2 * local
    fresh = node_samplers(total, 2, local, batch, seed=0)[1][local - 1]
    fresh.load_state_dict(state)
    assert len(fresh) == len(full) - done
    assert [b.tolist() for b in fresh] == full[done:]
    fresh.set_epoch(epoch + 1)
    s.set_epoch(epoch + 1)
    assert [b.tolist() for b in fresh] == [b.tolist() for b in s]


def test_resume_with_another_layout_needs_the_next_epoch() -> None:
    s = node_samplers(400, 2, 2, 16, seed=1)[0][1]
    s.set_epoch(4)
    next(iter(s))
    state = s.state_dict()
    other = node_samplers(400, 1, 4, 16)[0][1]
    with pytest.raises(ConfigError, match="next_epoch=True"):
        other.load_state_dict(state)
    other.load_state_dict(state, next_epoch=True)
    assert other.epoch == 5 and other.seed == 1 and len(other) == 7  # ceil(100 / 16), from the start
    with pytest.raises(ConfigError, match="same file"):
        node_samplers(401, 2, 2, 16)[0][0].load_state_dict(state, next_epoch=True)


# --------------------------------------------------------------------------- a real daemon


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_h5(tmp_path_factory.mktemp("node") / "train.h5", rows=1000)


def open_node(path: Path, runtime_dir: Path, node: int, local: int, **kwargs) -> SharedH5Dataset:
    """Local rank ``local`` of 2 on node ``node`` of 2 (explicit layout)."""
    return SharedH5Dataset(path, "x", "y", mode=NODE, local_rank=local, local_world_size=2, node_rank=node,
                           num_nodes=2, runtime_dir=runtime_dir, **kwargs)


def test_a_nodes_ranks_share_one_segment(daemon: Daemon, data_file: Path) -> None:
    a0, a1 = (open_node(data_file, daemon.runtime_dir, 0, r, fallback="error") for r in range(2))
    assert (a0.rank, a1.rank, a0.world_size) == (0, 1, 4) and a0.backend == a1.backend == "shm"
    assert len(a0) == 500 and a0.shard_sizes() == [250] * 4
    np.testing.assert_array_equal(a0.indices, np.arange(500))
    np.testing.assert_array_equal(a1.indices, a0.indices)
    held = segments_of(daemon, data_file)
    loads = daemon.status()["counters"]["loads"]
    assert len(held) == 2 and all(s["selection"] == "0:500:1" and s["holders"] == 2 for s in held)
    assert [s.name for s in a0._backend.segments] == [s.name for s in a1._backend.segments]
    b0 = open_node(data_file, daemon.runtime_dir, 1, 0, fallback="error")
    np.testing.assert_array_equal(b0.indices, np.arange(500, 1000))
    assert daemon.status()["counters"]["loads"] == loads + 2  # node 1: its own block
    assert sorted(s["selection"] for s in segments_of(daemon, data_file)) == ["0:500:1"] * 2 + ["500:1000:1"] * 2
    assert torch.equal(b0.__getitems__(list(range(500))).y, torch.arange(500, 1000).to(b0[0][1].dtype))
    loader = make_loader(b0, 64, seed=2)
    assert isinstance(loader.batch_sampler, NodeShuffleSampler) and len(loader) == 4  # ceil(250 / 64)
    with pytest.raises(ConfigError, match="DistributedSampler"):
        make_loader(b0, 64, sampler=DistributedSampler(b0, num_replicas=4, rank=2))
    for ds in (a0, a1, b0):
        ds.close()


def test_lazy_fallback_gives_identical_samples(daemon: Daemon, data_file: Path, no_daemon_env: Path) -> None:
    shm = open_node(data_file, daemon.runtime_dir, 1, 1, fallback="error")
    with pytest.warns(RuntimeWarning, match="lazily"):
        lazy = open_node(data_file, no_daemon_env, 1, 1)
    assert (shm.backend, lazy.backend) == ("shm", "lazy")
    np.testing.assert_array_equal(shm.indices, lazy.indices)
    for workers in (0, 2):
        a, b = make_loader(shm, 96, seed=5, num_workers=workers), make_loader(lazy, 96, seed=5, num_workers=workers)
        for epoch in (0, 1):
            a.batch_sampler.set_epoch(epoch)
            b.batch_sampler.set_epoch(epoch)
            pairs = list(zip(a, b))
            assert len(pairs) == 3  # ceil(250 / 96)
            for (xa, ya), (xb, yb) in pairs:
                assert torch.equal(xa, xb) and torch.equal(ya, yb)
        del a, b
    shm.close()
    lazy.close()


def test_layout_args_are_for_node_mode_only(data_file: Path, no_daemon_env: Path) -> None:
    with pytest.raises(ConfigError, match="mode='node' only"):
        SharedH5Dataset(data_file, "x", mode="contiguous", local_world_size=2, runtime_dir=no_daemon_env)


@pytest.mark.slow
@pytest.mark.timeout(260)
def test_ddp_job_in_node_mode_sees_every_row_once_per_epoch(tmp_path: Path, daemon: Daemon,
                                                            data_file: Path) -> None:
    """2 gloo ranks on one node, node mode, 1000 rows, batch 64: make_loader (0 and 2 workers)
    deals the node's rows so both ranks together see every row once per epoch, equal batches."""
    reports = run_job(data_file, tmp_path / "out", daemon.runtime_dir, extra=["--mode", "node",
                                                                              "--samplers", "make:0,make:2"])
    assert [r["backend"] for r in reports] == ["shm", "shm"] and [r["len"] for r in reports] == [1000, 1000]
    segments = segments_of(daemon, data_file)
    assert {s["selection"] for s in segments} == {"0:1000:1"}  # one node: its block is every row, once
    runs = reports[0]["runs"]
    for name in runs:
        for epoch in range(2):
            batches = [r["runs"][name][epoch] for r in reports]
            assert [len(b) for b in batches[0]] == [len(b) for b in batches[1]] == [64] * 7 + [52]
            assert sorted(flat(batches[0] + batches[1])) == list(range(1000))
        assert runs[name][0] != runs[name][1]
    for report in reports:
        assert report["runs"]["make:0"] == report["runs"]["make:2"]
