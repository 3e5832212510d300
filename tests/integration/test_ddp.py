"""Real multi-process DDP: torchrun, gloo, DataLoader workers, with and without a daemon."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ..helpers import Daemon, make_h5, short_tmpdir

JOB = Path(__file__).resolve().parent.parent / "jobs" / "ddp_job.py"
pytestmark = pytest.mark.slow


def run_torchrun(path: Path, out: Path, runtime_dir: Path, mode: str, nproc: int = 2, *extra: str) -> list[dict]:
    out.mkdir()
    env = {**os.environ, "H5SERVE_RUNTIME_DIR": str(runtime_dir), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(JOB.parents[2])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(JOB), str(path), str(out), "--mode", mode, *extra]
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, output[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.parametrize("mode", ["contiguous", "interleave"])
def test_ddp_two_ranks_shm_then_lazy(tmp_path: Path, mode: str) -> None:
    rows = 1001  # uneven: rank 0 gets one extra row in contiguous mode
    path = make_h5(tmp_path / "train.h5", rows=rows)
    d = Daemon().start()
    try:
        shm = run_torchrun(path, tmp_path / "shm", d.runtime_dir, mode)
        assert len(d.segment_files()) == 4  # x and y for 2 ranks, loaded once
    finally:
        d.stop()
    assert [r["backend"] for r in shm] == ["shm", "shm"], [r["warnings"] for r in shm]
    for epoch in range(2):
        seen = shm[0]["epochs"][epoch] + shm[1]["epochs"][epoch]
        assert sorted(seen) == list(range(rows))  # every row exactly once per epoch across ranks
    for r in shm:
        assert r["epochs"][0] != r["epochs"][1] and sorted(r["epochs"][0]) == sorted(r["epochs"][1])
    if mode == "interleave":
        assert all(y % 2 == r["rank"] for r in shm for y in r["epochs"][0])

    nothing = short_tmpdir("h5s-none-")
    lazy = run_torchrun(path, tmp_path / "lazy", nothing, mode)
    assert [r["backend"] for r in lazy] == ["lazy", "lazy"]
    assert [r["epochs"] for r in lazy] == [r["epochs"] for r in shm]  # same rows, same order


def test_two_simulated_nodes_each_daemon_holds_only_its_ranks(tmp_path: Path) -> None:
    """Two daemons on separate runtime dirs stand for two nodes; a 4-rank gloo job whose ranks
    0-1 use node A and 2-3 node B (H5SERVE_RUNTIME_DIR per rank)."""
    rows = 803
    path = make_h5(tmp_path / "train.h5", rows=rows)
    a, b = Daemon(), Daemon()
    try:
        a.start()
        b.start()
        reports = run_torchrun(path, tmp_path / "multi", a.runtime_dir, "contiguous", 4,
                               "--node-runtime-dirs", f"{a.runtime_dir},{b.runtime_dir}", "--workers", "0")
        held = {name: sorted({(s["rank"], s["world_size"]) for s in d.status()["segments"]})
                for name, d in (("A", a), ("B", b))}
    finally:
        a.stop()
        b.stop()
    assert [r["backend"] for r in reports] == ["shm"] * 4
    assert held == {"A": [(0, 4), (1, 4)], "B": [(2, 4), (3, 4)]}
    for epoch in range(2):
        seen = [y for r in reports for y in r["epochs"][epoch]]
        assert sorted(seen) == list(range(rows))
