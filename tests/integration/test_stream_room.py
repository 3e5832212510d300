"""Stream mode when the node has no room for a block (client/streaming/daemon_blocks.py): a real daemon
whose shm filesystem is full of other files (ShmFull) or whose budget is held nearly full by
another job's segments (BudgetExceeded). The rank asks again with backoff: it goes on once
room is made, or fails by its ``timeout=`` with a clear error naming the block and the
window; the daemon keeps serving, and the next job streams the file."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from h5serve.client import SharedH5Dataset, make_loader
from h5serve.errors import BudgetExceeded, ShmFull
from h5serve.order.stream_plan import segment_cost
from h5serve.segments.arena import ArenaLayout
from h5serve.wire.connection import DaemonClient
from h5serve.wire.runtime import arena_wanted

from ..helpers import Daemon, make_h5, running_daemon, tmpfs, wait_for, watch_memory

pytestmark = pytest.mark.timeout(300)

ROWS, SHAPE, BLOCK_ROWS = 2048, (256,), 128  # 16 blocks of 32 KiB of x (36 KiB in shared memory) and 1 KiB of y
WINDOW = "256KiB"  # 7 blocks of 33 KiB of rows
HOG_ROWS = 1248  # a global dataset of 1.2 MiB of x and 10 KiB of y: the budget below leaves less than a block
HOG_NEED = (4096 + HOG_ROWS * 1024) + (4096 + HOG_ROWS * 8)


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_h5(tmp_path_factory.mktemp("room") / "data.h5", rows=ROWS, row_shape=SHAPE)


def stream(h5: Path, d: Daemon, timeout: float | None) -> SharedH5Dataset:
    return SharedH5Dataset(h5, "x", "y", mode="stream", window=WINDOW, block_rows=BLOCK_ROWS, rank=0, world_size=1,
                           runtime_dir=d.runtime_dir, timeout=timeout, fallback="error")


def whole_epoch(ds: SharedH5Dataset, h5: Path) -> list[int]:
    """Every batch of an epoch checked against h5py's rows: the labels (row ids) in order."""
    with h5py.File(h5) as f:
        x = f["x"][:]
    labels: list[int] = []
    for xb, yb in make_loader(ds, 64, seed=1):
        assert np.array_equal(xb.numpy(), x[yb.numpy()])
        labels += yb.tolist()
    return labels


def check_node_serves(h5: Path, d: Daemon) -> None:
    """The daemon still runs and the next job streams every row from shared memory."""
    ds = stream(h5, d, None)
    try:
        assert ds.backend == "shm"
        assert sorted(whole_epoch(ds, h5)) == list(range(ROWS))
    finally:
        ds.close()
    with DaemonClient(d.runtime_dir) as client:
        status = client.status()
    assert status["memory"]["used"] <= status["memory"]["budget"]


@pytest.fixture()
def full_shm() -> Iterator[tuple[Daemon, Path]]:
    """A daemon on a 4 MiB tmpfs that a filler file leaves 16 KiB of (its budget is larger)."""
    with tmpfs("4m") as mnt, running_daemon("--max-memory", "16MiB", "--shm-dir", str(mnt)) as d:
        filler = mnt / "someone-elses-file"
        st = os.statvfs(mnt)
        with open(filler, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - 16 * 1024)
        yield d, filler
        filler.unlink(missing_ok=True)


def test_a_full_shm_fails_the_rank_by_its_timeout_and_the_node_stays_usable(h5: Path,
                                                                           full_shm: tuple[Daemon, Path]) -> None:
    d, filler = full_shm
    ds = stream(h5, d, 3.0)
    try:
        with pytest.raises(ShmFull, match=r"stream block \d+ \(rows \[\d+, \d+\) of 'x'\) found no room in the "
                                          r"daemon's shm filesystem .* asked again with backoff: the window is "
                                          r"7 blocks"):
            whole_epoch(ds, h5)
        assert ds.stream is not None and ds.stream.cache.budget_waits > 0  # it was asked again, not failed at once
    finally:
        ds.close()
    filler.unlink()
    check_node_serves(h5, d)
    assert not [n for n in os.listdir(filler.parent) if "tmp" in n]  # no failed load's temporary left


def run_epoch(ds: SharedH5Dataset, h5: Path, out: dict[str, Any]) -> None:
    try:
        out["labels"] = whole_epoch(ds, h5)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        out["error"] = exc


def test_a_full_shm_is_waited_out_once_room_is_made(h5: Path, full_shm: tuple[Daemon, Path]) -> None:
    d, filler = full_shm
    ds = stream(h5, d, 120.0)
    out: dict[str, Any] = {}
    thread = threading.Thread(target=run_epoch, args=(ds, h5, out), daemon=True)
    try:
        thread.start()
        assert wait_for(lambda: ds.stream is not None and ds.stream.cache.budget_waits > 0 or not thread.is_alive(),
                        60)
        assert thread.is_alive(), out  # waiting for room, not failed
        filler.unlink()  # room: the block is loaded when asked again
        thread.join(150)
        assert not thread.is_alive() and "error" not in out, out
        assert sorted(out["labels"]) == list(range(ROWS))
    finally:
        thread.join(150)
        ds.close()


def test_a_budget_held_full_by_another_job_fails_the_rank_by_its_timeout(h5: Path, tmp_path: Path) -> None:
    hog_file = make_h5(tmp_path / "hog.h5", rows=HOG_ROWS, row_shape=(1024,))
    with running_daemon("--max-memory", str(HOG_NEED + 16 * 1024)) as d:
        hog = SharedH5Dataset(hog_file, "x", "y", mode="global", rank=0, world_size=1, runtime_dir=d.runtime_dir,
                              fallback="error", auto_stream=False)
        try:
            assert hog.backend == "shm"  # held: its segments cannot be evicted for the stream's blocks
            ds = stream(h5, d, 3.0)
            try:
                with pytest.raises(BudgetExceeded, match=r"stream block \d+ .* found no room in the daemon's budget "
                                                         r"of 1.3 MiB .* held by other ranks or jobs"):
                    whole_epoch(ds, h5)
            finally:
                ds.close()
        finally:
            hog.close()
        check_node_serves(h5, d)  # the other job gone, its segments are evicted for the blocks


def test_a_rank_waiting_for_room_maps_no_block(h5: Path, tmp_path: Path) -> None:
    """Room for one block (both keys) beside another job's segments: the rank maps a block,
    copies its rows, and waits for room for the next one while mapping none, so the next one
    takes the room of the last and the epoch goes on a block at a time. A view of the last block
    it had copied rows from kept that block mapped, and leased, while it waited: it waited for
    itself until its ``timeout=`` failed it with BudgetExceeded. With the stream arena
    (unless H5SERVE_ARENA=0) a block is a slot of each key's arena, whose header and table
    the budget counts too: room for those and one slot each."""
    hog_file = make_h5(tmp_path / "hog.h5", rows=HOG_ROWS, row_shape=(1024,))
    block = segment_cost(BLOCK_ROWS * SHAPE[0]) + segment_cost(BLOCK_ROWS * 8)  # x and y, as the budget counts them
    if arena_wanted():
        arenas = (ArenaLayout(ROWS // BLOCK_ROWS, BLOCK_ROWS, SHAPE[0], "|u1", SHAPE),
                  ArenaLayout(ROWS // BLOCK_ROWS, BLOCK_ROWS, 8, "<i8", ()))
        block = sum(lay.data_offset + lay.slot_bytes for lay in arenas)
    budget = segment_cost(HOG_ROWS * 1024) + segment_cost(HOG_ROWS * 8) + block + 4096  # less than a second block
    with running_daemon("--max-memory", str(budget)) as d:
        hog = SharedH5Dataset(hog_file, "x", "y", mode="global", rank=0, world_size=1, runtime_dir=d.runtime_dir,
                              fallback="error", auto_stream=False)
        try:
            assert hog.backend == "shm"
            ds = stream(h5, d, 30.0)
            try:
                assert sorted(whole_epoch(ds, h5)) == list(range(ROWS))
                assert ds.stream is not None and ds.stream.cache.budget_waits > 0  # it waited for room each block
            finally:
                ds.close()
        finally:
            hog.close()


def test_tiny_stream_blocks_never_take_more_than_the_budget_in_shared_memory(tmp_path: Path) -> None:
    """Finding 7: 1,200 one-row blocks of one byte are 4,097-byte segments, which tmpfs holds in
    two pages each; the budget counted 4,097 bytes a block and the daemon's files took twice
    its 4 MiB (8,184 KiB). Every segment now costs its pages: the window holds the blocks the
    budget holds pages for, the daemon's files in /dev/shm never take more than the budget (nor
    does its count), and the epoch has every row."""
    budget = 4 << 20
    path = tmp_path / "tiny.h5"
    x = (np.arange(1200) * 7 % 251).astype(np.uint8)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x, chunks=(1,))
    with running_daemon("--max-memory", str(budget)) as d, watch_memory(d) as peaks:
        ds = SharedH5Dataset(path, "x", mode="stream", block_rows=1, rank=0, world_size=1, runtime_dir=d.runtime_dir,
                             timeout=120, fallback="error")
        try:
            assert ds.backend == "shm" and ds.stream is not None
            got: list[int] = []
            for xb in make_loader(ds, 64, seed=1):
                got += xb.tolist()
            assert sorted(got) == sorted(x.tolist())
            config = ds.stream.config
        finally:
            ds.close()
    assert peaks.allocated > budget // 2, vars(peaks)  # the window filled the budget: what is measured happened
    assert peaks.allocated <= budget and peaks.used <= budget, vars(peaks)
    page = mmap.PAGESIZE  # what tmpfs allocates a file's memory in
    assert (config.block_cost, config.capacity) == (2 * page, budget // (2 * page))  # the window counts pages too
