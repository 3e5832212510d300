"""Stream mode's default window (``window=None``) without a process group: the ranks of a node,
separate processes with no collective between them, must compute the same window (the order
depends on it). Without a daemon it is a quarter of the node's memory (physical, or the
cgroup's limit) shared by the node's ranks, never what is free at the moment: two ranks that
start before and after another process takes 512 MiB get the same; with a daemon, what its
budget holds. In a process group, a rank without a daemon reads the blocks of one with; a
rank's DataLoader workers share the default window without a daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from h5serve.client.backends.files import FileHandles
from h5serve.client.streaming.backend import StreamConfig, default_window, node_memory
from h5serve.client.streaming.blockcache import BlockCache
from h5serve.hdf5.source import inspect_dataset
from h5serve.order.stream_order import BlockLayout

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


AGREE = """
import datetime, json, sys
import torch.distributed as dist
from h5serve.client import SharedH5Dataset
rank = int(sys.argv[3])
dist.init_process_group("gloo", init_method="file://" + sys.argv[4], rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
ds = SharedH5Dataset(sys.argv[1], "x", "y", mode="stream", runtime_dir=sys.argv[2])
c = ds.stream.config
print(json.dumps({"backend": ds.backend, "block_rows": c.layout.block_rows, "capacity": c.capacity}))
ds.close()
dist.destroy_process_group()
"""


def test_ranks_with_and_without_a_daemon_in_a_group_read_the_same_blocks(tmp_path: Path) -> None:
    """A job whose rank 0 reached a daemon and rank 1 did not (a node whose daemon was down):
    with window=None both fit their blocks to the smallest memory for the window of any rank and
    take the smallest capacity, so they read the same blocks in the same order (blocks fitted to
    each rank's own would deal different rows to each: some twice, some never)."""
    h5 = make_h5(tmp_path / "data.h5", rows=4096, row_shape=(1024,))  # 4 MiB of x in 64-row chunks
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with running_daemon("--max-memory", "1MiB") as d:
        dirs = [str(d.runtime_dir), str(tmp_path / "no-daemon")]
        procs = [subprocess.Popen([sys.executable, "-c", AGREE, str(h5), dirs[r], str(r), str(tmp_path / "store")],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        try:
            outs = [p.communicate(timeout=120) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert [g.pop("backend") for g in got] == ["shm", "lazy"]
    assert got[0] == got[1]
    assert got[0]["block_rows"] < 4096 and got[0]["capacity"] >= 1  # fitted to the daemon's budget, not the node's


class CacheShare(torch.utils.data.Dataset):
    """What each DataLoader worker's block cache may hold, after it served a row."""

    def __init__(self, cache: BlockCache) -> None:
        self.cache = cache

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        self.cache.gather(np.array([i * 100], dtype=np.int64))
        return self.cache.capacity, self.cache.limit, len(self.cache.held)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_share_the_default_window_without_a_daemon(tmp_path: Path, context: str) -> None:
    """The block cache of a window the rank's workers share (``worker_room``: window=None without
    a daemon) holds only its share in each of them, whatever the start method: 2 workers of a
    6-block window hold 3 blocks each, not 6 (what the rank alone holds)."""
    h5 = make_h5(tmp_path / "data.h5", rows=1000, row_shape=(4,))
    with h5py.File(h5) as f:
        info = inspect_dataset(f, "x")
    layout = BlockLayout(1000, 64)
    block = 64 * 4
    handles = FileHandles((str(h5),), {})
    cache = BlockCache([info], [info.dtype], layout, 6, handles, None, 6 * block, worker_room=6)
    assert (cache.capacity, cache.limit) == (6, 6 * block)  # in the rank's own process: the whole window
    loader = torch.utils.data.DataLoader(CacheShare(cache), batch_size=None, num_workers=2,
                                         multiprocessing_context=context)
    got = [tuple(map(int, r)) for r in loader]
    assert {(capacity, limit) for capacity, limit, _ in got} == {(3, 3 * block)}
    assert all(1 <= held <= 3 for _, _, held in got)
    shared = StreamConfig(layout, block, 6, 6 * block, worker_room=6)
    assert shared.capacity_for(2) == 3  # what make_loader sizes the sampler's window by
    handles.close()
