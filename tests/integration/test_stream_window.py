"""Stream mode's default window (``window=None``) without a process group: the ranks of a node,
separate processes with no collective between them, must compute the same window (the order
depends on it). Without a daemon it is a quarter of the node's memory (physical, or the
cgroup's limit) shared by the node's ranks, never what is free at the moment: two ranks that
start before and after another process takes 512 MiB get the same; with a daemon, what its
budget holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from h5serve.client.stream import default_window, node_memory

from ..helpers import make_h5, running_daemon

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
RANK = """
import json, sys
from h5serve.client import SharedH5Dataset
ds = SharedH5Dataset(sys.argv[1], "x", "y", mode="stream", runtime_dir=sys.argv[2])
c = ds.stream.config
print(json.dumps({"backend": ds.backend, "window": c.window_bytes, "capacity": c.capacity, "block": c.block_bytes}))
"""


def rank(h5: Path, runtime_dir: Path, r: int) -> dict:
    """One rank of a 2-rank node started by hand (no torch.distributed), as a launcher would."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
           "LOCAL_WORLD_SIZE": "2"}
    out = subprocess.run([sys.executable, "-c", RANK, str(h5), str(runtime_dir)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_ranks_without_a_daemon_or_a_group_compute_the_same_default_window(tmp_path: Path) -> None:
    h5 = make_h5(tmp_path / "data.h5", rows=4096, row_shape=(64,))
    first = rank(h5, tmp_path / "no-daemon", 0)
    hog = bytearray(512 << 20)  # the memory available to the next rank is 512 MiB less
    hog[:: 4096] = b"x" * len(hog[:: 4096])
    second = rank(h5, tmp_path / "no-daemon", 1)
    del hog
    assert first["backend"] == second["backend"] == "lazy"
    assert first == {**second, "backend": first["backend"]}
    assert first["window"] == default_window(2) == int(node_memory() * 0.25) // 2


def test_ranks_with_a_daemon_take_what_its_budget_holds(tmp_path: Path) -> None:
    h5 = make_h5(tmp_path / "data.h5", rows=4096, row_shape=(1024,))  # 4 MiB of x: more than the budget
    with running_daemon("--max-memory", "1MiB") as d:
        reports = [rank(h5, d.runtime_dir, r) for r in range(2)]
    assert reports[0] == reports[1] and reports[0]["backend"] == "shm"
    held_whole = 4096 * 8 + 4096  # y, held whole: its rows and a header page (stream.whole_keys)
    assert reports[0]["window"] == (1 << 20) - held_whole
    assert 1 <= reports[0]["capacity"] < 4096 * 1024 // reports[0]["block"]
