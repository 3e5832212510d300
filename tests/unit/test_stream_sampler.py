"""Stream mode in one process: StreamSampler (resume, another number of local ranks) and
SharedH5Dataset(mode="stream") reading whole blocks into a window it never exceeds, with
h5py's bytes, bad input named, and a file changed under it detected."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from h5serve.client import SharedH5Dataset, StreamSampler, make_loader
from h5serve.client.samplers.node import NodePlace
from h5serve.errors import ConfigError, SourceChanged
from h5serve.order.stream_order import BlockLayout, node_epoch

from ..helpers import make_h5

ROWS, SHAPE, CHUNK = 10_001, (16,), 64
LAYOUT = BlockLayout(ROWS, 128)


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_h5(tmp_path_factory.mktemp("stream") / "data.h5", rows=ROWS, row_shape=SHAPE)


def _rows(sampler: StreamSampler) -> list[np.ndarray]:
    return [b.rows for b in sampler]


def _sampler(local_rank: int = 0, local: int = 2, node: int = 0, nodes: int = 1, capacity: int = 12) -> StreamSampler:
    return StreamSampler(LAYOUT, 50, NodePlace(local_rank, local, node, nodes), capacity, seed=5)


def test_ranks_of_nodes_see_every_row_once_in_equal_batches() -> None:
    for nodes, local in ((1, 2), (2, 2), (3, 1)):
        batches = [_rows(_sampler(r, local, n, nodes)) for n in range(nodes) for r in range(local)]
        assert len({len(b) for b in batches}) == 1
        rows = np.concatenate([np.concatenate(b) for b in batches])
        assert set(rows.tolist()) == set(range(ROWS))  # padding repeats a few, none is missing


def test_alive_blocks_cover_each_batch_and_fit_the_window() -> None:
    s = _sampler()
    for batch in s:
        assert set((batch.rows // LAYOUT.block_rows).tolist()) <= set(batch.alive.tolist())
        assert len(batch.alive) <= s.capacity


@pytest.mark.parametrize("new_local", [2, 3, 1])
def test_resume_mid_epoch_gives_the_rest(new_local: int) -> None:
    old = [_sampler(r, 2) for r in range(2)]
    for s in old:
        s.set_epoch(3)
    whole = [np.concatenate(_rows(s)) for s in old]
    consumed = 50 * 20
    states = [s.state_dict(consumed=consumed) for s in old]
    if new_local == 3:  # 3 ranks' batches need more room besides the saved window of 9 blocks
        with pytest.raises(ConfigError, match=r"window of 9 blocks, but this job's window holds 12 blocks"):
            _sampler(0, 3).load_state_dict(states[0])
    new = [_sampler(r, new_local, capacity=13) for r in range(new_local)]
    for r, s in enumerate(new):
        s.load_state_dict(states[min(r, 1)])
    rest = [np.concatenate(_rows(s)) for s in new]
    assert len({len(r) for r in rest}) == 1
    if new_local == 2:  # the same layout: exactly the same remaining order
        assert all(np.array_equal(w[consumed:], r) for w, r in zip(whole, rest))
    served = set(np.concatenate([w[:consumed] for w in whole]).tolist()) | set(np.concatenate(rest).tolist())
    assert served == set(range(ROWS))
    later = _sampler(0, new_local, capacity=13)
    later.window = new[0].window  # the resumed job keeps the saved window for its later epochs
    new[0].set_epoch(4)
    later.set_epoch(4)
    assert np.array_equal(np.concatenate(_rows(new[0])), np.concatenate(_rows(later)))  # later epochs whole


@pytest.mark.parametrize("new_local", [2, 1])
def test_a_state_saved_before_stratified_draws_resumes_on_its_own_rows(new_local: int) -> None:
    """A checkpoint of h5serve before the state said ``run`` was drawn with uniform keys: its
    epoch goes on in that order (the next epochs in the new one), every row still once."""
    old = [_sampler(r, 2) for r in range(2)]
    for s in old:
        s.set_epoch(3)
    states = [s.state_dict(consumed=50 * 20) for s in old]
    assert states[0]["run"] == 2
    for state in states:
        del state["run"]
    before = node_epoch(LAYOUT, seed=5, epoch=3, num_nodes=1, node=0, window=old[0].window, local_world_size=2,
                        batch_size=50, run=0)
    new = [_sampler(r, new_local, capacity=13) for r in range(new_local)]
    for r, s in enumerate(new):
        s.load_state_dict(states[r])
    rest = [np.concatenate(_rows(s)) for s in new]
    if new_local == 2:
        assert np.array_equal(rest[0], before.rank_rows(0)[50 * 20 :])
    served = set(before.sequence[: 2 * 50 * 20].tolist()) | set(np.concatenate(rest).tolist())
    assert served == set(range(ROWS))
    assert new[0].state_dict()["run"] == 0  # saved again mid-epoch: still that order
    new[0].set_epoch(4)
    assert new[0].state_dict()["run"] == new_local
    bad = dict(states[0], run="2")
    with pytest.raises(ConfigError, match=r"run='2'"):
        _sampler(0, 2).load_state_dict(bad)


def test_resume_with_another_number_of_nodes_needs_next_epoch() -> None:
    state = _sampler(0, 2, 0, 1).state_dict(consumed=100)
    s = _sampler(0, 2, 0, 2)
    with pytest.raises(ConfigError, match=r"num_nodes=1 \(this job: 2\).*next_epoch=True"):
        s.load_state_dict(state)
    s.load_state_dict(state, next_epoch=True)
    assert s.epoch == 1 and len(s) == len(_sampler(0, 2, 0, 2))


def test_dataset_gathers_h5py_bytes_within_the_window(h5: Path) -> None:
    block_bytes = 128 * (16 + 8)
    ds = SharedH5Dataset(h5, "x", "y", mode="stream", window=12 * block_bytes, block_rows=128, rank=0, world_size=1)
    with h5py.File(h5) as f:
        x = f["x"][:]
    try:
        assert ds.stream is not None and ds.stream.config.capacity == 12 and len(ds) == ROWS
        loader = make_loader(ds, 50, seed=1)
        assert isinstance(loader.batch_sampler, StreamSampler)
        seen = []
        for xb, yb in loader:
            assert np.array_equal(xb.numpy(), x[yb.numpy()])
            assert len(ds.stream.cache.held) <= 12
            seen += yb.tolist()
        assert sorted(seen) == list(range(ROWS))
        assert ds.stream.cache.peak <= 12 and ds.stream.cache.reads == LAYOUT.n_blocks  # each block read once
    finally:
        ds.close()


def test_keys_and_dtypes(h5: Path) -> None:
    ds = SharedH5Dataset(h5, keys={"img": "x", "label": "y"}, dtypes={"img": "float32"}, mode="stream",
                         window="1MiB", rank=0, world_size=1)
    try:
        batch = next(iter(make_loader(ds, 32, seed=0)))
        assert batch["img"].dtype == torch.float32 and batch["label"].dtype == torch.int64
        with h5py.File(h5) as f:
            assert np.array_equal(batch["img"].numpy(), f["x"][:][batch["label"].numpy()].astype(np.float32))
    finally:
        ds.close()


def test_plain_indices_stay_within_the_window(h5: Path) -> None:
    """Another sampler's indices (no alive blocks): least recently used blocks go, still
    within the window, even for a batch spread over more blocks than it holds."""
    ds = SharedH5Dataset(h5, "x", "y", mode="stream", window=3 * 128 * 24, block_rows=128, rank=0, world_size=1)
    try:
        ds.__getitems__(list(range(0, ROWS, 97)))
        assert ds.stream is not None and ds.stream.cache.peak <= 3
    finally:
        ds.close()


def test_bad_input_names_the_numbers(h5: Path) -> None:
    with pytest.raises(ConfigError, match=r"block_rows=100 is not a whole number of chunks.*multiples of 64"):
        SharedH5Dataset(h5, "x", "y", mode="stream", block_rows=100)
    with pytest.raises(ConfigError, match=r"window=1000 is 1000 B, smaller than one block \(128 rows x 24 bytes"):
        SharedH5Dataset(h5, "x", "y", mode="stream", window=1000, block_rows=128)
    with pytest.raises(ConfigError, match="window and block_rows are for mode='stream' only"):
        SharedH5Dataset(h5, "x", "y", mode="global", window="1GiB")
    ds = SharedH5Dataset(h5, "x", "y", mode="stream", window=3 * 128 * 24, block_rows=128, rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match=r"window holds 3 blocks of 128 rows.*200 x 1 = 200 rows"):
            make_loader(ds, 200)
    finally:
        ds.close()


def test_a_file_changed_during_an_epoch_is_detected(tmp_path: Path) -> None:
    path = make_h5(tmp_path / "cut.h5", rows=ROWS, row_shape=SHAPE)
    ds = SharedH5Dataset(path, "x", "y", mode="stream", window=2 * 128 * 24, block_rows=128, rank=0, world_size=1)
    try:
        ds.__getitems__([0])
        os.truncate(path, os.path.getsize(path) * 9 // 10)
        with pytest.raises(SourceChanged, match="changed while this process was reading it"):
            ds.__getitems__([9000])
    finally:
        ds.close()
