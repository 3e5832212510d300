"""Stream mode from a real daemon holds small keys whole (client/streaming/daemon_blocks.py, ``whole_keys``):
with the default window, labels that take at most 1/16 of the budget are one global segment,
loaded once and held by the job, and only the images go block by block; h5py's bytes for every
row, every row once, the same batches in forked and spawned DataLoader workers, the daemon's
memory never over its budget. An asked window keeps every key in blocks."""

from __future__ import annotations

import threading
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.client import SharedH5Dataset, make_loader
from h5serve.wire.connection import DaemonClient
from h5serve.wire.runtime import arena_wanted

from ..helpers import make_h5, running_daemon

pytestmark = pytest.mark.timeout(240)

ROWS, SHAPE, BLOCK_ROWS, BATCH = 8193, (1024,), 128, 32  # 8 MiB of x in 65 blocks, 64 KiB of y
BUDGET = 2 * 1024 * 1024  # a quarter of the data; y's 64 KiB (and its header page) is under 1/16 of it


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_h5(tmp_path_factory.mktemp("whole") / "data.h5", rows=ROWS, row_shape=SHAPE)


def _epoch(ds: SharedH5Dataset, h5: Path, workers: int = 0, context: str | None = None) -> list[np.ndarray]:
    loader = make_loader(ds, BATCH, seed=3, num_workers=workers, multiprocessing_context=context)
    with h5py.File(h5) as f:
        x = f["x"][...]
    labels = []
    for xb, yb in loader:
        y = yb.numpy()
        np.testing.assert_array_equal(xb.numpy(), x[y])  # h5py's bytes, each image with its own label
        labels.append(y)
    return labels


def _segments(runtime_dir: Path) -> list[dict]:
    with DaemonClient(runtime_dir) as client:
        return client.status()["segments"]


def _arenas(runtime_dir: Path) -> dict[str, int]:
    """The daemon's stream arenas (unless H5SERVE_ARENA=0): their count and slot loads."""
    with DaemonClient(runtime_dir) as client:
        return client.status()["arenas"]


def test_labels_are_held_whole_and_only_images_stream(h5: Path) -> None:
    used = {"max": 0}
    stop = threading.Event()
    with running_daemon("--max-memory", str(BUDGET), "--loaders", "2") as d:
        def sample() -> None:
            with DaemonClient(d.runtime_dir) as client:
                while not stop.is_set():
                    used["max"] = max(used["max"], client.ping()["used"])
                    stop.wait(0.02)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            ds = SharedH5Dataset(h5, "x", "y", mode="stream", block_rows=BLOCK_ROWS, rank=0, world_size=1,
                                 runtime_dir=d.runtime_dir, fallback="error")
            try:
                assert ds.backend == "shm"
                first = _epoch(ds, h5)
                rows = np.concatenate(first)
                assert sorted(rows.tolist()) == list(range(ROWS))  # every row once
                segments = _segments(d.runtime_dir)
                labels = [s for s in segments if s["key"] == "y"]
                assert len(labels) == 1 and labels[0]["mode"] == "global" and labels[0]["whole_file"], labels
                if arena_wanted():  # x's blocks are slots of one arena
                    arenas = _arenas(d.runtime_dir)
                    assert not [s for s in segments if s["mode"] == "stream"], segments
                    assert arenas["arenas"] == 1 and arenas["loads"] >= 65, arenas  # x: block by block
                else:
                    assert {s["key"] for s in segments if s["mode"] == "stream"} == {"x"}
                    assert ds.stream.cache.attaches >= 65  # x: block by block (65 blocks)
                for workers, context in ((2, "fork"), (1, "spawn")):
                    got = _epoch(ds, h5, workers, context)
                    assert [b.tolist() for b in got] == [b.tolist() for b in first], context
            finally:
                ds.close()
        finally:
            stop.set()
            thread.join(10)
    assert 0 < used["max"] <= BUDGET


def test_an_asked_window_keeps_every_key_in_blocks(h5: Path) -> None:
    with running_daemon("--max-memory", str(BUDGET), "--loaders", "2") as d:
        ds = SharedH5Dataset(h5, "x", "y", mode="stream", block_rows=BLOCK_ROWS, window="1MiB", rank=0,
                             world_size=1, runtime_dir=d.runtime_dir, fallback="error")
        try:
            batches = _epoch(ds, h5)
            assert sorted(np.concatenate(batches).tolist()) == list(range(ROWS))
            if arena_wanted():  # each key's blocks are slots of its own arena
                assert not _segments(d.runtime_dir) and _arenas(d.runtime_dir)["arenas"] == 2
            else:
                assert {(s["key"], s["mode"]) for s in _segments(d.runtime_dir)} == {("x", "stream"), ("y", "stream")}
        finally:
            ds.close()
        # the same order as with no daemon at all, which reads whole blocks through h5py
        lazy = SharedH5Dataset(h5, "x", "y", mode="stream", block_rows=BLOCK_ROWS, window="1MiB", rank=0,
                               world_size=1, runtime_dir=d.runtime_dir / "none")
        try:
            assert [b.tolist() for b in _epoch(lazy, h5)] == [b.tolist() for b in batches]
        finally:
            lazy.close()
