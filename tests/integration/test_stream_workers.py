"""Stream mode served by a real daemon with the default window (``window=None``: what the
daemon's budget holds) and make_loader's DataLoader workers, under torchrun (2 gloo ranks, a DDP
step per batch): 0, 2 and 8 workers a rank read every row once per epoch in the same order,
h5py's bytes, the daemon's memory never over its budget, and no rank waits out its ``timeout=``.

A worker runs batches ahead of the one its rank trains on (``workers x prefetch_factor`` of
them), so a node's processes hold blocks of several steps at once, more than the default
window leaves room for when a block starts about every step. Idle workers that had run ahead
kept those blocks mapped while the worker of the batch the ranks waited for found no room for
its own, and their next batches come only after it: every rank waited until that worker's
``timeout=`` failed it with BudgetExceeded (client/streaming/daemon_blocks.py says what a worker keeps)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from ..helpers import running_daemon, torchrun_two_ranks, watch_memory

pytestmark = pytest.mark.timeout(600)

JOB = Path(__file__).resolve().parents[1] / "jobs" / "stream_job.py"
ROWS, ROW_BYTES, CHUNK = 4096, 16384, 16  # 64 MiB of x: 4x the budget, rows of 16 KiB in chunks of 16
BUDGET = 16 << 20  # the default window: blocks of about 2 MiB, one started about every step of 2 x 64 rows
LOADERS = ["make:0", "make:2", "make:8"]
WAIT_S = 60  # a rank that finds no room for a block this long fails (BudgetExceeded): a stall fails the job


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("workers") / "data.h5"
    with h5py.File(path, "w") as f:
        x = f.create_dataset("x", (ROWS, ROW_BYTES), dtype="uint8", chunks=(CHUNK, ROW_BYTES))
        for start in range(0, ROWS, 512):
            rows = np.arange(start, start + 512)[:, None]
            x[start : start + 512] = ((rows + np.arange(ROW_BYTES)) % 251).astype(np.uint8)
        f.create_dataset("y", data=np.arange(ROWS, dtype=np.int64))
    return path


def test_the_default_window_never_stalls_with_workers(h5: Path, tmp_path: Path) -> None:
    args = [str(h5), str(tmp_path / "out"), "--window", "default", "--block-rows", "0", "--batch-size", "64",
            "--epochs", "2", "--loaders", ",".join(LOADERS), "--resume-at", "0", "--timeout", str(WAIT_S),
            "--collective-timeout", "300"]
    with running_daemon("--max-memory", str(BUDGET)) as d, watch_memory(d) as memory:
        reports = torchrun_two_ranks(JOB, args, tmp_path / "out", d.runtime_dir, 560)
    assert all(r["backend"] == "shm" and r["len"] == ROWS for r in reports)  # (the job checks h5py's bytes)
    for name in LOADERS:
        for epoch in range(2):
            per_rank = [r["runs"][name][epoch] for r in reports]
            assert len(per_rank[0]) == len(per_rank[1])
            rows = [row for batches in per_rank for batch in batches for row in batch]
            assert set(rows) == set(range(ROWS)) and len(rows) - ROWS < 2 * 64
    for r in reports:  # the workers change nothing in the order
        assert r["runs"]["make:2"] == r["runs"]["make:0"] == r["runs"]["make:8"]
    assert memory.used > BUDGET // 2, vars(memory)  # the default window filled the budget: the case happened
    assert memory.used <= BUDGET and memory.allocated <= BUDGET, vars(memory)
