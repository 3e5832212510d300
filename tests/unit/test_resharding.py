"""A second sharding is refused with the fix: make_loader given torch's DistributedSampler for
a rank-sharded dataset, a DistributedSampler you build measuring one (``len(ds)``),
Accelerate's prepared DataLoader over one, and the real Lightning and Accelerate wrappers
iterating an h5serve sampler. (tests/integration/test_frameworks.py runs the frameworks' own
multi-process jobs.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.data import DistributedSampler

from h5serve.client import (
    DistributedShuffleSampler,
    EpochBatchSampler,
    EpochShuffleSampler,
    NodeShuffleSampler,
    SharedH5Dataset,
    make_loader,
)
from h5serve.client.samplers.node import NodePlace
from h5serve.errors import ConfigError

from ..helpers import make_h5

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_h5(tmp_path_factory.mktemp("reshard") / "d.h5", rows=101, row_shape=(2,))


def _lazy(h5: Path, **kwargs: object) -> SharedH5Dataset:
    return SharedH5Dataset(h5, "x", "y", runtime_dir="/nonexistent/h5serve", **kwargs)  # type: ignore[arg-type]


SHARDED = [("contiguous", "rank 1's shard"), ("interleave", "rank 1's shard"), ("node", "this node's rows")]


def _sharded(h5: Path, mode: str) -> SharedH5Dataset:
    layout = {"local_rank": 1, "local_world_size": 2, "node_rank": 0, "num_nodes": 2} if mode == "node" else {}
    return _lazy(h5, mode=mode, rank=1, world_size=4, **layout)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("mode,held", SHARDED)
def test_make_loader_refuses_a_distributed_sampler_for_a_sharded_dataset(h5: Path, mode: str, held: str) -> None:
    ds = _sharded(h5, mode)
    with pytest.raises(ConfigError, match=f"{held}.*DistributedSampler over 4 replicas.*without sampler="):
        make_loader(ds, 8, sampler=DistributedSampler(range(len(ds)), num_replicas=4, rank=1))  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("mode,held", SHARDED)
def test_a_distributed_sampler_of_your_own_over_a_sharded_dataset_is_refused(h5: Path, mode: str, held: str) -> None:
    """Caught in ``len(ds)`` from the caller's frame (resharding.py says why that check stays)."""
    ds = _sharded(h5, mode)
    with pytest.raises(ConfigError, match=f"{held}.*DistributedSampler over 4 replicas.*make_loader"):
        DistributedSampler(ds, num_replicas=4, rank=1)
    assert len(list(DistributedSampler(ds, num_replicas=1, rank=0))) == len(ds)  # one replica shards nothing
    assert len(ds) > 0  # and len() elsewhere is untouched


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_distributed_sampler_over_global_or_unsharded_datasets_works(h5: Path) -> None:
    whole = _lazy(h5, mode="global", rank=0, world_size=2)
    assert set(DistributedSampler(whole, 2, 0)) | set(DistributedSampler(whole, 2, 1)) == set(range(101))
    single = _lazy(h5, mode="contiguous", rank=0, world_size=1)
    assert len(list(DistributedSampler(single, 2, 0))) == 51


def _samplers() -> list[object]:
    place = NodePlace(0, 2, 0, 1)
    return [
        EpochShuffleSampler(50),
        EpochBatchSampler(EpochShuffleSampler(50), 8),
        DistributedShuffleSampler(101, 8, 2, 0),
        NodeShuffleSampler(101, 8, place, [51, 50]),
    ]


@pytest.mark.parametrize("index", range(4))
def test_accelerate_batch_sampler_shard_is_refused(index: int) -> None:
    data_loader = pytest.importorskip("accelerate.data_loader", reason="accelerate is not installed")
    sampler = _samplers()[index]
    shard = data_loader.BatchSamplerShard(sampler, num_processes=2, process_index=0)
    with pytest.raises(ConfigError, match=r"accelerator.prepare\(loader\).*prepare the model and optimizer only"):
        list(shard)
    assert len(list(iter(sampler))) > 0  # iterated by anything else, it still works


@pytest.mark.parametrize("index", range(4))
def test_lightning_sampler_wrapper_is_refused(index: int) -> None:
    distributed = pytest.importorskip("lightning.fabric.utilities.distributed", reason="lightning is not installed")
    wrapper = distributed.DistributedSamplerWrapper(_samplers()[index], num_replicas=2, rank=0, shuffle=False)
    with pytest.raises(ConfigError, match=r"Trainer\(use_distributed_sampler=False\)"):
        list(wrapper)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lightning_rebuilding_a_batch_sampler_around_its_sampler_is_refused(h5: Path) -> None:
    """Lightning (use_distributed_sampler=True) rebuilds a custom batch sampler as
    ``type(bs)(DistributedSampler(ds), batch_size=..., drop_last=...)``."""
    ds = _lazy(h5, mode="global", rank=0, world_size=2)
    for cls in (EpochBatchSampler, DistributedShuffleSampler, NodeShuffleSampler):
        with pytest.raises(ConfigError, match=r"use_distributed_sampler=False"):
            cls(DistributedSampler(ds, 2, 0), batch_size=8, drop_last=False)


def test_lightning_reaches_set_epoch_through_batch_sampler_sampler() -> None:
    """Lightning sets the epoch on ``loader.sampler`` and ``loader.batch_sampler.sampler``."""
    for sampler in _samplers()[1:]:
        first = [b.tolist() for b in sampler]
        sampler.sampler.set_epoch(1)
        assert [b.tolist() for b in sampler] != first


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("mode,held", [("contiguous", "only rank 0's shard"), ("interleave", "only rank 0's shard"),
                                       ("stream", "this node's blocks")])
def test_accelerate_sharding_a_plain_loader_over_a_shard_is_refused(h5: Path, mode: str, held: str) -> None:
    """prepare(DataLoader(ds, shuffle=True)) wraps torch's BatchSampler(RandomSampler(ds)): no
    h5serve sampler is iterated, and Accelerate's DataLoaderShard calls the dataset's set_epoch
    at the start of the pass (its sampler has none)."""
    from torch.utils.data import DataLoader

    data_loader = pytest.importorskip("accelerate.data_loader", reason="accelerate is not installed")
    ds = _lazy(h5, mode=mode, rank=0, world_size=2)
    prepared = data_loader.prepare_data_loader(DataLoader(ds, 8, shuffle=True), num_processes=2, process_index=0)
    with pytest.raises(ConfigError, match=rf"{held}.*set_epoch.*accelerator.prepare\(loader\)"):
        next(iter(prepared))
    whole = _lazy(h5, mode="global", rank=0, world_size=2)  # what prepare is for: nothing refused
    assert len(list(data_loader.prepare_data_loader(DataLoader(whole, 8, shuffle=True), num_processes=2,
                                                    process_index=0))) == 7
    alone = _lazy(h5, mode=mode, rank=0, world_size=1)  # one rank: nothing sharded, nothing refused
    assert len(list(data_loader.prepare_data_loader(DataLoader(alone, 8, shuffle=True), num_processes=1,
                                                    process_index=0))) == 13
