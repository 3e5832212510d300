"""Stream mode over every kind of data h5serve serves: many files (a glob pattern and a list;
blocks laid out per file, a block never spans two), compressed chunks, variable-length numeric
rows and strings, fixed-length byte strings, several keys. With and without a real daemon:
h5py's bytes, every row once per epoch, the same order from both backends; with a daemon
every block is a segment of the one file that holds it. A DDP job under torchrun (2 gloo
ranks) with DataLoader workers forked and spawned streams the files from the daemon."""

from __future__ import annotations

import glob
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from h5serve.client import SharedH5Dataset, make_loader
from h5serve.wire.connection import DaemonClient

from ..helpers import Daemon, running_daemon, torchrun_two_ranks

pytestmark = pytest.mark.timeout(300)

JOB = Path(__file__).resolve().parents[1] / "jobs" / "stream_kinds_job.py"
KEYS = ["x", "y", "v", "s", "fs"]
FILE_ROWS = [300, 77, 800, 41, 200]  # blocks of 64 rows leave short blocks of 44, 13, 41 and 8 rows
TOTAL = sum(FILE_ROWS)
BLOCK_ROWS = 64
WINDOW = "48KiB"  # 8 blocks of ~6 KiB (x 32 B, y 8 B, v ~24 B, s ~20 B, fs 10 B a row): of 25 blocks
BUDGET = "2MiB"  # every block costs 5 header pages in shared memory: 8 x ~26 KiB


def write_part(path: Path, start: int, rows: int, chunk: int) -> None:
    """Rows ``start .. start + rows - 1`` of the set: y the global row id, the rest derived from it."""
    g = np.arange(start, start + rows)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=(g[:, None] * 8 + np.arange(8)).astype(np.float32), chunks=(chunk, 8),
                         compression="gzip", shuffle=True)
        f.create_dataset("y", data=g.astype(np.int64), chunks=(chunk,))
        v = f.create_dataset("v", (rows,), dtype=h5py.vlen_dtype(np.float32), chunks=(chunk,), compression="gzip")
        s = f.create_dataset("s", (rows,), dtype=h5py.string_dtype(), chunks=(chunk,))
        f.create_dataset("fs", data=np.array([b"row%d" % i for i in g], dtype="S10"), chunks=(chunk,))
        for i, row in enumerate(g.tolist()):
            v[i] = np.arange(row % 9, dtype=np.float32) + row
            s[i] = "zeile-" + "é" * (row % 4) + str(row)


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("kinds")
    start = 0
    for i, rows in enumerate(FILE_ROWS):
        write_part(where / f"part_{i}.h5", start, rows, 32 if i == 2 else 16)  # one file chunked otherwise
        start += rows
    return where


def h5py_rows(paths: list[str]) -> dict[str, list[Any]]:
    rows: dict[str, list[Any]] = {key: [] for key in KEYS}
    for path in paths:
        with h5py.File(path) as f:
            for key in KEYS:
                rows[key].extend(f[key].asstr()[:] if key == "s" else f[key][:])
    return rows


def epoch(ds: SharedH5Dataset, want: dict[str, list[Any]], seed: int = 5, workers: int = 0,
          **kwargs: Any) -> list[list[int]]:
    """One epoch of make_loader's batches, each checked against h5py's rows: the y of each."""
    batches = []
    for x, y, v, s, fs in make_loader(ds, 32, seed=seed, num_workers=workers, **kwargs):
        ids = y.tolist()
        assert np.array_equal(x.numpy(), np.stack([want["x"][g] for g in ids]))
        assert all(np.array_equal(row.numpy(), want["v"][g]) for row, g in zip(v, ids))
        assert list(s) == [want["s"][g] for g in ids] and list(fs) == [want["fs"][g] for g in ids]
        batches.append(ids)
    return batches


def sources(parts: Path) -> dict[str, Any]:
    files = sorted(glob.glob(str(parts / "part_*.h5")))
    return {"one-file": files[2], "pattern": str(parts / "part_*.h5"), "list": files}


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    with running_daemon("--max-memory", BUDGET, "--loaders", "2") as d:
        yield d


def _open(path: Any, runtime_dir: Path, **kwargs: Any) -> SharedH5Dataset:
    return SharedH5Dataset(path, keys=KEYS, mode="stream", window=WINDOW, block_rows=BLOCK_ROWS, rank=0,
                           world_size=1, runtime_dir=runtime_dir, **kwargs)


@pytest.mark.parametrize("source", ["one-file", "pattern", "list"])
def test_every_kind_streams_as_h5py_reads_it_with_and_without_a_daemon(parts: Path, daemon: Daemon, tmp_path: Path,
                                                                       source: str) -> None:
    path = sources(parts)[source]
    paths = path if source == "list" else sorted(glob.glob(path))
    want = h5py_rows(paths)
    total = len(want["y"])
    first = int(want["y"][0])
    orders = {}
    for backend, runtime_dir in (("lazy", tmp_path / "no-daemon"), ("shm", daemon.runtime_dir)):
        ds = _open(path, runtime_dir, fallback="lazy" if backend == "lazy" else "error")
        try:
            assert ds.backend == backend and len(ds) == total and ds.total_rows == total
            layout = ds.stream.config.layout
            assert layout.n_blocks > ds.stream.config.capacity  # the window holds a part of the data
            runs = [epoch(ds, {k: [None] * first + v for k, v in want.items()}, seed=5) for _ in range(2)]
            assert runs[0] == runs[1]  # the same epoch twice: the same order
            rows = [g for batch in runs[0] for g in batch]
            assert set(rows) == set(range(first, first + total)) and len(rows) - total < 32
            orders[backend] = runs[0]
            if len(paths) > 1:  # blocks laid out per file: none spans two
                starts = np.cumsum([0, *FILE_ROWS])
                for block in range(layout.n_blocks):
                    a, b = layout.span(block)
                    assert np.searchsorted(starts, a, "right") == np.searchsorted(starts, b - 1, "right")
        finally:
            ds.close()
    assert orders["lazy"] == orders["shm"]  # the same order with or without a daemon


def test_blocks_of_many_files_are_segments_of_the_file_that_holds_them(parts: Path, daemon: Daemon) -> None:
    files = sources(parts)["list"]
    ds = _open(files, daemon.runtime_dir, fallback="error")
    try:
        epoch(ds, h5py_rows(files))
        with DaemonClient(daemon.runtime_dir) as client:
            status = client.status()
        assert status["memory"]["used"] <= status["memory"]["budget"]
        counts = dict(zip(files, FILE_ROWS))
        blocks = [s for s in status["segments"] if s["file"] in counts and s["mode"] in ("stream", "global")]
        assert blocks and {s["key"] for s in blocks} == set(KEYS)
        for s in blocks:  # one file's rows, within that file, never another file's
            assert s["rows"] <= BLOCK_ROWS and s["rows"] <= counts[s["file"]]
            if s["mode"] == "stream":
                a, b = (int(n) for n in s["selection"].split(":")[:2])
                assert 0 <= a < b <= counts[s["file"]] and b - a == s["rows"]
        assert status["counters"]["load_errors"] == 0
    finally:
        ds.close()


def test_dataloader_workers_gather_what_the_main_process_does(parts: Path, daemon: Daemon) -> None:
    """Forked and spawned workers, each mapping (or reading) its own blocks: the same batches."""
    files = sources(parts)["list"]
    want = h5py_rows(files)
    ds = _open(files, daemon.runtime_dir, fallback="error")
    try:
        main = epoch(ds, want)
        assert epoch(ds, want, workers=2, multiprocessing_context="fork") == main
        assert epoch(ds, want, workers=1, multiprocessing_context="spawn") == main
    finally:
        ds.close()


def test_ddp_job_streams_many_files_of_every_kind(parts: Path, daemon: Daemon, tmp_path: Path) -> None:
    pattern = sources(parts)["pattern"]
    args = [pattern, str(tmp_path / "shm"), "--window", WINDOW, "--block-rows", str(BLOCK_ROWS)]
    reports = torchrun_two_ranks(JOB, args, tmp_path / "shm", daemon.runtime_dir, 280)
    assert all(r["backend"] == "shm" and r["len"] == TOTAL and r["files"] == len(FILE_ROWS) for r in reports)
    for name in ("make:0", "make:2", "make:1:spawn"):
        for e in range(2):
            per_rank = [r["runs"][name][e] for r in reports]
            assert len(per_rank[0]) == len(per_rank[1])  # equal batch counts (or the job would have hung)
            rows = [g for batches in per_rank for batch in batches for g in batch]
            assert set(rows) == set(range(TOTAL)) and len(rows) - TOTAL < 2 * 32
        assert reports[0]["runs"][name][0] != reports[0]["runs"][name][1]  # reshuffled per epoch
    for r in reports:
        assert r["runs"]["make:2"] == r["runs"]["make:0"] == r["runs"]["make:1:spawn"]
    # without a daemon: the same rows in the same order on each rank
    args[1] = str(tmp_path / "lazy")
    alone = torchrun_two_ranks(JOB, [*args, "--loaders", "make:0"], tmp_path / "lazy", tmp_path / "no-daemon", 200)
    assert all(r["backend"] == "lazy" for r in alone)
    assert [r["runs"]["make:0"] for r in alone] == [r["runs"]["make:0"] for r in reports]


def test_global_mode_over_the_budget_streams_many_files_of_every_kind(parts: Path) -> None:
    """Automatic stream mode (client/streaming/automatic.py) for many files with variable-length rows:
    the daemon refuses the whole set for room, so it is streamed, with one warning, from
    shared memory; every row once, h5py's bytes."""
    files = sources(parts)["list"]
    want = h5py_rows(files)
    # 164 KiB in five segments (in whole pages); a block of 32 rows, a segment per key, takes 40 KiB: the window
    # holds 4 of them, as many as a batch of 32 rows needs
    with running_daemon("--max-memory", "160KiB") as d:
        with pytest.warns(RuntimeWarning, match=r"needs .* of shared memory, more than the daemon's budget of 160.0 "
                                                r"KiB: streaming it instead \(mode='stream': blocks of 32 rows"):
            ds = SharedH5Dataset(files, keys=KEYS, mode="global", rank=0, world_size=1, runtime_dir=d.runtime_dir)
        try:
            assert ds.mode == "stream" and ds.requested_mode == "global" and ds.backend == "shm"
            assert ds.auto_streamed is not None and ds.auto_streamed.need > 160 * 1024
            rows = [g for batch in epoch(ds, want) for g in batch]
            assert set(rows) == set(range(TOTAL)) and len(rows) - TOTAL < 32
            with DaemonClient(d.runtime_dir) as client:
                memory = client.status()["memory"]
            assert memory["used"] <= memory["budget"]
        finally:
            ds.close()


@pytest.mark.parametrize("ragged", ["list", "pad"])
def test_variable_length_x_through_make_loader_workers(parts: Path, daemon: Daemon, ragged: str) -> None:
    """x of variable-length rows with y (make_loader's worker ring holds fixed-size columns
    only: ragged batches cross as they are) from forked workers: what the main process gathers.
    Before the fix every worker failed ('RaggedColumn' object has no attribute 'numpy')."""
    files = sources(parts)["list"]
    want = h5py_rows(files)
    ds = SharedH5Dataset(files, "v", "y", mode="stream", window=WINDOW, block_rows=BLOCK_ROWS, rank=0, world_size=1,
                         runtime_dir=daemon.runtime_dir, fallback="error", ragged=ragged)
    try:
        def rows(workers: int) -> list[tuple[list[int], list[list[float]]]]:
            out = []
            kwargs = {"multiprocessing_context": "fork"} if workers else {}
            for v, y in make_loader(ds, 32, seed=2, num_workers=workers, **kwargs):
                values = [r.tolist() for r in v] if ragged == "list" else [
                    row[:n].tolist() for row, n in zip(v.values, v.lengths.tolist())]
                assert values == [want["v"][g].tolist() for g in y.tolist()]
                out.append((y.tolist(), values))
            return out

        assert rows(2) == rows(0)
    finally:
        ds.close()


def test_inspect_recommends_stream_for_variable_length_rows(parts: Path, tmp_path: Path) -> None:
    """``h5serve inspect`` counts variable-length rows (an offset and their mean values a row),
    once refused as not servable, and recommends the window and block stream mode then uses."""
    from h5serve.cli.inspect import inspect_file

    path = sources(parts)["one-file"]
    report = inspect_file(path, ["v", "y"], max_memory=24 * 1024)  # the two keys take ~34 KiB
    assert all(not d.problem for d in report.datasets)
    assert report.recommended_mode == "stream" and report.stream is not None
    w = report.stream
    ds = SharedH5Dataset(path, "v", "y", mode="stream", window=w.window, block_rows=w.block_rows, rank=0,
                         world_size=1, runtime_dir=tmp_path / "no-daemon")
    try:
        assert ds.stream is not None and ds.stream.config.capacity == w.capacity
        assert ds.stream.config.block_bytes == w.block_bytes
    finally:
        ds.close()
