"""The predecessor's documented examples run with only the import line changed."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from h5serve.client import (
    EpochShuffleSampler,
    H5LazyDataset,
    RankMemCachedH5Dataset,
    SharedH5Dataset,
    balanced_contiguous_shard,
    h5_worker_init_fn,
    interleaved_indices,
)

from ..helpers import Daemon


def all_x(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f["x"][...]


def test_h5lazy_basic_usage(h5file: Path) -> None:
    dataset = H5LazyDataset(path=str(h5file), x_key="x", y_key="y", x_dtype=np.float32, y_dtype=np.int64)
    dataloader = DataLoader(dataset, batch_size=32, shuffle=True, num_workers=2, worker_init_fn=h5_worker_init_fn,
                            timeout=60)
    want = all_x(h5file).astype(np.float32)
    seen = []
    for inputs, targets in dataloader:
        assert inputs.dtype == torch.float32 and targets.dtype == torch.int64
        assert np.array_equal(inputs.numpy(), want[targets.numpy()])
        seen.extend(targets.tolist())
    assert sorted(seen) == list(range(len(dataset))) == list(range(1000))


def test_h5lazy_with_transforms_and_input_only(h5file: Path) -> None:
    dataset = H5LazyDataset(
        path=str(h5file), x_key="x", y_key="y",
        transform=lambda x: (x.astype(np.float32) / 255.0).transpose(1, 2, 0),  # numpy in, as in the seed
        target_transform=lambda y: torch.tensor(y, dtype=torch.long),
    )
    x, y = dataset[10]
    assert x.shape == (4, 4, 3) and y.item() == 10
    batch = next(iter(DataLoader(dataset, batch_size=8, num_workers=2, worker_init_fn=h5_worker_init_fn, timeout=60)))
    assert batch[0].shape == (8, 4, 4, 3) and batch[1].tolist() == list(range(8))
    features = H5LazyDataset(path=str(h5file), x_key="x", y_key=None, x_dtype=np.float32)
    rows = torch.cat(list(DataLoader(features, batch_size=64, shuffle=False, num_workers=2, timeout=60)))
    assert np.array_equal(rows.numpy(), all_x(h5file).astype(np.float32))
    features.close()
    assert features[3].shape == (3, 4, 4)  # reopens after close()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("with_daemon", [False, True])
def test_rank_cached_basic_example(h5file: Path, monkeypatch: pytest.MonkeyPatch, no_daemon_env: Path,
                                   with_daemon: bool) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    d = Daemon().start() if with_daemon else None
    try:
        if d is not None:
            monkeypatch.setenv("H5SERVE_RUNTIME_DIR", str(d.runtime_dir))
        notes: list[str] = []
        dataset = RankMemCachedH5Dataset(path=str(h5file), x_key="x", y_key="y", mode="contiguous",
                                         pin_host_memory=True, log_fn=notes.append)
        assert dataset.backend == ("shm" if with_daemon else "memory") and notes
        sampler = EpochShuffleSampler(data_len=len(dataset), seed=42, shuffle=True)
        dataloader = DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=2, pin_memory=False, timeout=60)
        start, end = balanced_contiguous_shard(1000, 2, 1)
        want = all_x(h5file).astype(np.float32)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            seen = []
            for inputs, targets in dataloader:
                assert inputs.dtype == torch.float32  # the seed's default dtype_x
                assert np.array_equal(inputs.numpy(), want[targets.numpy()])
                seen.extend(targets.tolist())
            assert sorted(seen) == list(range(start, end))
    finally:
        if d is not None:
            d.stop()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_rank_cached_interleave_input_only_and_share_memory(h5file: Path, no_daemon_env: Path) -> None:
    pg_file = no_daemon_env / "pg"
    dist.init_process_group("gloo", init_method=f"file://{pg_file}", rank=0, world_size=1)
    try:
        dataset = RankMemCachedH5Dataset(path=str(h5file), x_key="x", y_key="y", mode="interleave",
                                         dtype_x=np.float32, dtype_y=np.int64, share_memory=True, log_fn=lambda _: None)
        assert (dataset.rank, dataset.world_size) == (0, 1)  # from the process group
        assert np.array_equal(dataset.indices, interleaved_indices(1000, 1, 0))
        features = RankMemCachedH5Dataset(path=str(h5file), x_key="x", y_key=None, mode="contiguous",
                                          dtype_x=np.float32, log_fn=lambda _: None)
        sampler = EpochShuffleSampler(data_len=len(features), shuffle=False)
        out = torch.cat(list(DataLoader(features, batch_size=64, sampler=sampler, num_workers=2, timeout=60)))
        assert np.array_equal(out.numpy(), all_x(h5file).astype(np.float32))
    finally:
        dist.destroy_process_group()


def test_epoch_shuffle_sampler() -> None:
    a, b = EpochShuffleSampler(100, seed=42), EpochShuffleSampler(100, seed=42)
    assert list(a) == list(b) and sorted(a) == list(range(100)) and len(a) == 100
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first and sorted(a) == list(range(100))
    assert list(EpochShuffleSampler(5, shuffle=False)) == [0, 1, 2, 3, 4]
    assert list(EpochShuffleSampler(0)) == []


def test_shared_dataset_readme_example(h5file: Path, shared_daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("H5SERVE_RUNTIME_DIR", str(shared_daemon.runtime_dir))
    ds = SharedH5Dataset(str(h5file), x_key="x", y_key="y", mode="contiguous")
    sampler = EpochShuffleSampler(len(ds), seed=42)
    loader = DataLoader(ds, batch_size=256, sampler=sampler, num_workers=2, timeout=60)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        assert sorted(torch.cat([y for _, y in loader]).tolist()) == list(range(1000))
    assert ds.backend == "shm"
