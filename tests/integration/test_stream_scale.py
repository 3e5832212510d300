"""Stream mode at scale, on a small case (client/streaming/daemon_blocks.py): the mappings and descriptors
a rank holds for its window stay bounded whatever the window's number of blocks. A window of
100,000s of small blocks (a node with a large budget and files of small chunks) would otherwise
reach ``vm.max_map_count`` (65,530 by default) or the descriptor limit. Here the cap is lowered
(``H5SERVE_MAX_MAPPED_BLOCKS``) so that a window of 1,024 blocks is far past it: the rank keeps
at most the cap mapped, the daemon keeps the window loaded, and every row comes once, right."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.client import SharedH5Dataset, make_loader
from h5serve.client.streaming.window_fit import MAX_MAPPED_ENV
from h5serve.wire.runtime import ARENA_ENV, arena_wanted

from ..helpers import running_daemon

pytestmark = pytest.mark.timeout(300)

ROWS, ROW_BYTES, BLOCK_ROWS = 8192, 1024, 8  # 1,024 blocks of 8 KiB of x, in chunks of a block
CAP = 48  # blocks a process may keep mapped in the capped runs
BATCH = 32  # rows a batch: its blocks are mapped together whatever the cap


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("scale") / "data.h5"
    x = (np.arange(ROWS * ROW_BYTES, dtype=np.int64).reshape(ROWS, ROW_BYTES) % 251).astype(np.uint8)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x, chunks=(BLOCK_ROWS, ROW_BYTES))
        f.create_dataset("y", data=np.arange(ROWS, dtype=np.int64))
    return path


def _maps() -> int:
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def epoch_peaks(h5: Path, runtime_dir: Path, window: str) -> tuple[int, int]:
    """One epoch of a stream over ``window`` from the daemon, every batch checked against h5py;
    the most mappings and descriptors this process held beyond what it held before."""
    with h5py.File(h5) as f:
        x = f["x"][:]
    ds = SharedH5Dataset(h5, "x", "y", mode="stream", window=window, block_rows=BLOCK_ROWS, rank=0, world_size=1,
                         runtime_dir=runtime_dir, fallback="error")
    maps0, fds0 = _maps(), _fds()
    peak_maps = peak_fds = 0
    seen: list[int] = []
    try:
        assert ds.backend == "shm"
        for xb, yb in make_loader(ds, BATCH, seed=3):
            assert np.array_equal(xb.numpy(), x[yb.numpy()])
            seen += yb.tolist()
            peak_maps, peak_fds = max(peak_maps, _maps() - maps0), max(peak_fds, _fds() - fds0)
    finally:
        ds.close()
    assert sorted(seen) == list(range(ROWS))
    return peak_maps, peak_fds


def test_a_segment_per_block_stays_under_the_mapping_cap(h5: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks in segments of their own (a shared daemon, variable-length rows, many files, or
    ``H5SERVE_ARENA=0`` as here): a rank keeps at most ``mappable_blocks`` mapped whatever the
    window, says so when the window holds more, and holds no descriptor per block."""
    monkeypatch.setenv(ARENA_ENV, "0")
    with running_daemon("--max-memory", "64MiB") as d:
        monkeypatch.setenv(MAX_MAPPED_ENV, str(CAP))
        past_cap = f"window holds 12[0-9] blocks but this process may keep only {CAP} mapped"
        with pytest.warns(RuntimeWarning, match=past_cap):
            small_maps, small_fds = epoch_peaks(h5, d.runtime_dir, "1MiB")  # 128 blocks: past the cap already
        with pytest.warns(RuntimeWarning, match="vm.max_map_count.*block_rows=.*window="):
            large_maps, large_fds = epoch_peaks(h5, d.runtime_dir, "8MiB")  # 1,024 blocks: the whole file
        monkeypatch.delenv(MAX_MAPPED_ENV)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # under the cap: no warning
            uncapped_maps, _ = epoch_peaks(h5, d.runtime_dir, "8MiB")
    # a placed block is a mapping per key (x, y) and splits each key's stitch's reservation once;
    # a batch's own blocks are mapped together, past the cap if they must
    bound = 2 * 2 * (CAP + BATCH) + 16
    assert small_maps <= bound and large_maps <= bound, (small_maps, large_maps)
    assert large_maps <= small_maps + 16, (small_maps, large_maps)
    # no descriptor per block: a slot's mapping holds its file and lease
    assert small_fds <= 8 and large_fds <= 8, (small_fds, large_fds)
    # the measure sees growth: the same window without the cap maps far more
    assert uncapped_maps > 4 * bound, uncapped_maps


def test_a_ranks_mappings_and_descriptors_do_not_grow_with_the_window(h5: Path) -> None:
    """A streamed key's blocks are slots of one arena, mapped once whatever the window, so there
    is no cap to keep and none to warn of; a window of 1,024 blocks maps and opens no more than
    one of 128."""
    if not arena_wanted():
        pytest.skip("H5SERVE_ARENA=0: blocks in segments of their own (the test above)")
    with running_daemon("--max-memory", "64MiB") as d, warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no past-the-cap warning: nothing to cap
        small_maps, small_fds = epoch_peaks(h5, d.runtime_dir, "1MiB")  # 128 blocks
        large_maps, large_fds = epoch_peaks(h5, d.runtime_dir, "8MiB")  # 1,024 blocks: the whole file
    assert small_maps <= 16 and large_maps <= 16, (small_maps, large_maps)  # x's and y's arena, a few of the client's
    assert small_fds <= 8 and large_fds <= 8, (small_fds, large_fds)
