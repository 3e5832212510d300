"""Stream mode end to end: a real DDP job under torchrun (2 gloo ranks) reads a file through a
window of a few blocks: every row once per epoch across the ranks, h5py's bytes, equal batch
counts (the all-reduce of every batch would hang otherwise), the block cache never over the
window, DataLoader workers forked and spawned, a mid-epoch checkpoint resumes the same rest;
and torchdata's StatefulDataLoader resumes it too."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

from h5serve.client import SharedH5Dataset, make_loader

from ..helpers import make_h5, torchrun_two_ranks

pytestmark = pytest.mark.timeout(300)

JOB = Path(__file__).resolve().parents[1] / "jobs" / "stream_job.py"
ROWS, SHAPE = 6001, (32,)  # 24 blocks of 256 rows (32 + 8 bytes a row: 10 KiB a block)
LOADERS = ["make:0", "make:2", "make:1:spawn"]


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_h5(tmp_path_factory.mktemp("stream") / "data.h5", rows=ROWS, row_shape=SHAPE)


def test_ddp_job_streams_every_row_once_through_the_window(h5: Path, tmp_path: Path) -> None:
    reports = torchrun_two_ranks(JOB, [str(h5), str(tmp_path / "out"), "--loaders", ",".join(LOADERS)],
                                 tmp_path / "out", tmp_path / "runtime", 280)
    assert all(r["backend"] == "lazy" and r["len"] == ROWS for r in reports)
    for name in LOADERS:
        for epoch in range(2):
            batches = [r["runs"][name][epoch] for r in reports]
            assert len(batches[0]) == len(batches[1])  # equal batch counts (or the job would have hung)
            rows = [row for b in batches for batch in b for row in batch]
            assert set(rows) == set(range(ROWS))  # every row, padding repeats at most a batch's worth
            assert len(rows) - ROWS < 2 * 64
        assert reports[0]["runs"][name][0] != reports[0]["runs"][name][1]  # reshuffled per epoch
    # workers gather the same batches as the main process
    for r in reports:
        assert r["runs"]["make:2"] == r["runs"]["make:0"] == r["runs"]["make:1:spawn"]
    for r in reports:  # the block cache never held more than the window, and read each block once an epoch
        assert r["peak_blocks"] * r["block_bytes"] <= r["window_bytes"]
        assert r["peak_blocks"] <= r["capacity"] < 24
        assert r["reads"] <= 2 * 24 + r["capacity"]
    for r in reports:  # a mid-epoch checkpoint gives the same rest of the epoch
        assert r["rest"] == r["whole"][7:]


stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed")


def _loader(path: Path, workers: int) -> Any:
    ds = SharedH5Dataset(path, "x", "y", mode="stream", window="96KiB", block_rows=256, rank=1, world_size=2,
                         local_rank=1, local_world_size=2, node_rank=0, num_nodes=1)
    kwargs = {"multiprocessing_context": "fork"} if workers else {}
    return make_loader(ds, 32, seed=7, num_workers=workers, loader_class=stateful.StatefulDataLoader, **kwargs)


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_mid_epoch(h5: Path, workers: int) -> None:
    reference = _loader(h5, workers)
    reference.batch_sampler.set_epoch(1)
    want = [y.tolist() for _, y in reference]
    loader = _loader(h5, workers)
    loader.batch_sampler.set_epoch(1)
    it = iter(loader)
    got = [next(it)[1].tolist() for _ in range(9)]
    buffer = io.BytesIO()
    torch.save(loader.state_dict(), buffer)
    del it, loader
    buffer.seek(0)
    resumed = _loader(h5, workers)
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    got += [y.tolist() for _, y in resumed]
    assert got == want
