"""Stream mode with tiny blocks against the daemon's load queue (MAX_QUEUED_LOADS_PER_UID loads
of one user waiting for a loader; past it the daemon refuses with CapacityError): a window of
hundreds of one-chunk blocks, one process. A stream's own prefetch never fills the queue, and a
needed block the queue refuses (another job of the same user keeping it full) waits for a place
as it waits for room, then the epoch ends with every row; the daemon keeps serving."""

from __future__ import annotations

import threading
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.client import SharedH5Dataset, make_loader
from h5serve.errors import CapacityError
from h5serve.order.sharding import STREAM
from h5serve.wire.connection import DaemonClient
from h5serve.wire.protocol import Acquire
from h5serve.wire.runtime import arena_wanted

from ..helpers import running_daemon, wait_for

pytestmark = pytest.mark.timeout(300)

ROWS, ROW_BYTES, CHUNK = 4096, 2048, 8  # 512 blocks of one chunk (16 KiB), more than the queue's 256 loads
BUDGET = 32 << 20  # holds every block: the window is the whole file, and the first batch prefetches it
OTHER_ROWS = 8192  # another file's rows, of 2 x ROW_BYTES: 1,024 blocks, more than the budget holds


def tiny_file(path: Path, rows: int = ROWS, row_bytes: int = ROW_BYTES) -> Path:
    """x: ``rows`` of ``row_bytes`` in chunks of CHUNK rows; y: their row numbers."""
    with h5py.File(path, "w") as f:
        x = f.create_dataset("x", (rows, row_bytes), dtype=np.uint8, chunks=(CHUNK, row_bytes))
        for a in range(0, rows, 1024):
            x[a : a + 1024] = ((np.arange(a, min(a + 1024, rows))[:, None] + np.arange(row_bytes)) % 251)
        f.create_dataset("y", data=np.arange(rows, dtype=np.int64))
    return path


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_file(tmp_path_factory.mktemp("queue") / "tiny.h5")


def epoch(ds: SharedH5Dataset, h5: Path) -> None:
    """An epoch: every row once, h5py's bytes."""
    with h5py.File(h5) as f:
        x = f["x"][:]
    rows: list[int] = []
    for xb, yb in make_loader(ds, 64, seed=1):
        assert np.array_equal(xb.numpy(), x[yb.numpy()])
        rows += yb.tolist()
    assert sorted(rows) == list(range(ROWS))


def stream(h5: Path, runtime_dir: Path) -> SharedH5Dataset:
    return SharedH5Dataset(h5, "x", "y", mode="stream", block_rows=CHUNK, rank=0, world_size=1, runtime_dir=runtime_dir,
                           timeout=120, fallback="error")


def test_a_tiny_block_stream_prefetches_within_the_load_queue(h5: Path) -> None:
    """Its first batch asked for every block of the window at once and the daemon refused the
    257th: CapacityError failed the first batch."""
    with running_daemon("--max-memory", str(BUDGET)) as d:
        ds = stream(h5, d.runtime_dir)
        try:
            assert ds.backend == "shm" and ds.stream is not None
            assert ds.stream.config.capacity == ROWS // CHUNK  # the window holds every block
            epoch(ds, h5)
        finally:
            ds.close()
        with DaemonClient(d.runtime_dir) as client:
            status = client.status()
    counters = status["counters"]
    if arena_wanted():  # (unless H5SERVE_ARENA=0) x's blocks are slot loads of its arena
        assert counters["refusals"] == 0 and counters["loads"] == 1, counters  # y: one segment
        assert status["arenas"]["loads"] == ROWS // CHUNK, status["arenas"]
    else:
        assert counters["refusals"] == 0 and counters["loads"] == ROWS // CHUNK + 1, counters  # y: one segment


def test_a_needed_block_waits_for_a_place_in_a_full_load_queue(h5: Path, tmp_path: Path) -> None:
    """Another job of the same user keeps the queue full (as fast as it drains); the stream's needed
    blocks are refused (CapacityError) and asked again with backoff until the other job stops."""
    # more blocks than the budget holds: each of them asked for is a load (the oldest evicted for it)
    other = tiny_file(tmp_path / "other.h5", OTHER_ROWS, 2 * ROW_BYTES)
    stop, refused = threading.Event(), threading.Event()

    def fill(runtime_dir: Path) -> None:
        with DaemonClient(runtime_dir, timeout=30) as client:
            block = 0
            while not stop.is_set():
                a = block % (OTHER_ROWS // CHUNK) * CHUNK
                try:
                    client.request(Acquire(str(other), "x", 1, 0, STREAM, None, rows=(a, a + CHUNK)))
                except CapacityError:
                    refused.set()  # the queue is full: keep it so
                    continue
                block += 1

    with running_daemon("--max-memory", str(BUDGET), "--loaders", "1") as d:
        filler = threading.Thread(target=fill, args=(d.runtime_dir,), daemon=True)
        filler.start()
        ds = stream(h5, d.runtime_dir)
        result: dict[str, object] = {}

        def run() -> None:
            try:
                epoch(ds, h5)
            except Exception as exc:  # noqa: BLE001 - the test reads it
                result["error"] = exc

        reader = threading.Thread(target=run, daemon=True)
        try:
            assert wait_for(refused.is_set, 60)  # the queue is full
            reader.start()
            cache = ds.stream.cache if ds.stream is not None else None
            assert wait_for(lambda: cache is not None and cache.budget_waits > 0 or not reader.is_alive(), 60)
            assert "error" not in result, result  # refused, it waits (it used to fail at once)
            stop.set()  # the other job stops: the queue drains
            reader.join(150)
            assert not reader.is_alive() and "error" not in result, result
        finally:
            stop.set()
            filler.join(30)
            if reader.is_alive():
                reader.join(150)
            ds.close()
        with DaemonClient(d.runtime_dir) as client:
            status = client.status()
        assert status["memory"]["used"] <= status["memory"]["budget"]
