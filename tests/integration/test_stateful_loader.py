"""torchdata's StatefulDataLoader checkpoints and restores h5serve's batch samplers: a
mid-epoch ``state_dict()`` taken with DataLoader workers prefetching, saved with torch.save,
loaded into a new loader over a new dataset, yields exactly the rest of that epoch, and the
epochs after it are whole. Real daemon, real /dev/shm segments, real worker processes."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

from h5serve.client import SharedH5Dataset, make_loader
from h5serve.errors import ConfigError

from ..helpers import Daemon, make_h5

stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed")
StatefulDataLoader = stateful.StatefulDataLoader

pytestmark = pytest.mark.timeout(180)

ROWS = 1001  # odd: shards differ by a row, so the equal-batches padding is in play
BATCH = 32
LAYOUTS: dict[str, dict[str, Any]] = {
    "contiguous": {"mode": "contiguous", "rank": 1, "world_size": 2},
    "global": {"mode": "global", "rank": 1, "world_size": 2},
    "node": {"mode": "node", "rank": 1, "world_size": 4, "local_rank": 1, "local_world_size": 2,
             "node_rank": 0, "num_nodes": 2},
}


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_h5(tmp_path_factory.mktemp("stateful") / "data.h5", rows=ROWS, row_shape=(4,))


def _loader(path: Path, daemon: Daemon, layout: str, workers: int) -> Any:
    ds = SharedH5Dataset(path, "x", "y", runtime_dir=daemon.runtime_dir, fallback="error", **LAYOUTS[layout])
    assert ds.backend == "shm"
    kwargs = {"multiprocessing_context": "fork"} if workers else {}
    return make_loader(ds, BATCH, seed=7, num_workers=workers, loader_class=StatefulDataLoader, **kwargs)


def _labels(batches: Any) -> list[list[int]]:
    return [y.tolist() for _, y in batches]


def _epoch(loader: Any, epoch: int) -> list[list[int]]:
    loader.batch_sampler.set_epoch(epoch)
    return _labels(loader)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mid_epoch_checkpoint_resumes_exactly(h5: Path, shared_daemon: Daemon, layout: str, workers: int) -> None:
    reference = _loader(h5, shared_daemon, layout, workers)
    want = {epoch: _epoch(reference, epoch) for epoch in (1, 2)}
    assert want[1] != want[2] and len(want[1]) > 5  # reshuffled per epoch, enough batches to cut

    first = _loader(h5, shared_daemon, layout, workers)
    first.batch_sampler.set_epoch(1)
    seen, it = [], iter(first)
    for _ in range(5):
        seen.append(next(it)[1].tolist())
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # as a training script checkpoints, workers still prefetching
    del it, first

    second = _loader(h5, shared_daemon, layout, workers)
    buffer.seek(0)
    second.load_state_dict(torch.load(buffer, weights_only=False))
    second.batch_sampler.set_epoch(1)  # a training loop calls it again for the resumed epoch: a no-op
    rest = _labels(second)
    assert seen + rest == want[1]
    assert _epoch(second, 2) == want[2]  # later epochs are whole


def test_make_loader_refuses_a_non_loader_class(h5: Path, shared_daemon: Daemon) -> None:
    ds = SharedH5Dataset(h5, "x", "y", runtime_dir=shared_daemon.runtime_dir, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="loader_class"):
        make_loader(ds, BATCH, loader_class=dict)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sampler_state_resumes_with_another_worker_count(h5: Path, shared_daemon: Daemon, layout: str) -> None:
    """Without torchdata: the batch sampler's own state_dict(consumed=...) from a loader with 2
    workers (which prefetch ahead) resumes exactly in a loader with none."""
    def plain(workers: int) -> Any:
        ds = SharedH5Dataset(h5, "x", "y", runtime_dir=shared_daemon.runtime_dir, fallback="error", **LAYOUTS[layout])
        kwargs = {"multiprocessing_context": "fork"} if workers else {}
        return make_loader(ds, BATCH, seed=7, num_workers=workers, **kwargs)

    with_workers = plain(2)
    want = _epoch(with_workers, 3)
    with_workers.batch_sampler.set_epoch(3)
    it = iter(with_workers)
    seen = [next(it)[1].tolist() for _ in range(4)]
    state = with_workers.batch_sampler.state_dict(consumed=4 * BATCH)  # the workers have handed out more
    del it
    without = plain(0)
    without.batch_sampler.load_state_dict(state)
    assert seen + _labels(without) == want


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sharded_mode_state_records_mode_and_world_size(h5: Path) -> None:
    """make_loader's batch sampler in a sharded mode records the mode and world size; a
    mid-epoch resume with another of either is refused (with the fix), next_epoch=True works."""
    def loader(mode: str, world: int) -> Any:
        ds = SharedH5Dataset(h5, "x", "y", runtime_dir="/nonexistent/h5serve", mode=mode, rank=0, world_size=world)
        return make_loader(ds, BATCH, seed=7)

    first = loader("contiguous", 2)
    first.batch_sampler.set_epoch(4)
    state = first.batch_sampler.state_dict(consumed=3 * BATCH)
    assert (state["mode"], state["world_size"], state["consumed_global"]) == ("contiguous", 2, 6 * BATCH)
    # interleave over 2 ranks has shards of the same size: only the recorded mode tells them apart
    for other, match in ((loader("interleave", 2), "mode='contiguous'"), (loader("contiguous", 3), "world_size=2")):
        with pytest.raises(ConfigError, match=f"{match}.*next_epoch=True"):
            other.batch_sampler.load_state_dict(state)
        other.batch_sampler.load_state_dict(state, next_epoch=True)
        fresh = loader(other.dataset.mode, other.dataset.world_size)
        assert _labels(other) == _epoch(fresh, 5)  # the next epoch, whole
    same = loader("contiguous", 2)
    same.batch_sampler.load_state_dict(state)
    assert _labels(same) == _epoch(loader("contiguous", 2), 4)[3:]
