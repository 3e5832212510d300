"""Automatic stream mode (client/streaming/automatic.py): a global dataset 4x the real daemon's
--max-memory is served in stream mode from shared memory, with one warning naming the numbers,
on 2 DDP ranks under torchrun (every row once per epoch, h5py's bytes, the daemon's memory
never over its budget) and on one rank; ``auto_stream=False`` keeps the lazy fallback; no
daemon keeps the lazy fallback; data that fits stays global; ``h5serve inspect`` recommends
stream with the same window and block, and not when the data fits."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.client import SharedH5Dataset, make_loader
from h5serve.util.units import allocated_bytes, format_bytes
from h5serve.wire.connection import DaemonClient
from h5serve.wire.runtime import arena_wanted

from ..helpers import (
    Daemon,
    h5serve_cli,
    make_h5,
    running_daemon,
    short_tmpdir,
    tmpfs,
    torchrun_two_ranks,
    watch_memory,
)

pytestmark = pytest.mark.timeout(300)

JOB = Path(__file__).resolve().parents[1] / "jobs" / "auto_stream_job.py"
ROWS, SHAPE = 8193, (1024,)  # 8 MiB of x (chunks of 64 rows), 64 KiB of y
BUDGET = 2 * 1024 * 1024  # the data is 4x the daemon's budget
BATCH = 64


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_h5(tmp_path_factory.mktemp("autostream") / "data.h5", rows=ROWS, row_shape=SHAPE)


def daemon(budget: int = BUDGET) -> AbstractContextManager[Daemon]:
    return running_daemon("--max-memory", str(budget), "--loaders", "2")


@contextmanager
def runtime_env(runtime_dir: Path) -> Iterator[None]:
    old = os.environ.get("H5SERVE_RUNTIME_DIR")
    os.environ["H5SERVE_RUNTIME_DIR"] = str(runtime_dir)
    try:
        yield
    finally:
        if old is None:
            del os.environ["H5SERVE_RUNTIME_DIR"]
        else:
            os.environ["H5SERVE_RUNTIME_DIR"] = old


def need_bytes() -> int:  # rows of x and y, a header page each, each segment in whole pages
    return allocated_bytes(4096 + ROWS * 1024) + allocated_bytes(4096 + ROWS * 8)


def check_warning(texts: list[str]) -> None:
    """One warning, with the need, the budget, the order and how to silence it."""
    assert len(texts) == 1, texts
    text = texts[0]
    for said in (f"needs {format_bytes(need_bytes())}", f"budget of {format_bytes(BUDGET)}", "block-shuffled",
                 "mode='stream'", "--max-memory", "auto_stream=False", "not reading rows lazily"):
        assert said in text, (said, text)


def open_global(h5: Path, **kwargs: object) -> tuple[SharedH5Dataset, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = SharedH5Dataset(h5, "x", "y", mode="global", rank=0, world_size=1, **kwargs)
    return ds, [w for w in caught if issubclass(w.category, RuntimeWarning)]


def epoch_rows(ds: SharedH5Dataset, x_all: np.ndarray, epoch: int = 0, workers: int = 0,
               context: str | None = None) -> list[int]:
    loader = make_loader(ds, BATCH, seed=3, num_workers=workers, multiprocessing_context=context)
    loader.batch_sampler.set_epoch(epoch)
    rows: list[int] = []
    for x, y in loader:
        assert np.array_equal(x.numpy(), x_all[y.numpy()])
        rows += y.tolist()
    return rows


def test_ddp_global_over_budget_is_streamed_from_shared_memory(h5: Path, tmp_path: Path) -> None:
    with daemon() as d, watch_memory(d) as memory:
        reports = torchrun_two_ranks(JOB, [str(h5), str(tmp_path / "out")], tmp_path / "out", d.runtime_dir, 280)
    for r in reports:
        check_warning([text for kind, text in r["warnings"] if kind == "RuntimeWarning"])
        assert (r["mode"], r["requested_mode"], r["backend"], r["sampler"]) == ("stream", "global", "shm",
                                                                                 "StreamSampler")
        assert r["len"] == ROWS and r["plan"]["budget"] == BUDGET and r["plan"]["need"] == need_bytes()
        assert r["plan"]["window"] <= BUDGET and r["plan"]["capacity"] >= 8
        assert r["plan"]["whole"] == [False, True]  # y (64 KiB) held whole, as mode="stream" with a daemon does
    assert reports[0]["plan"] == reports[1]["plan"]  # the ranks agreed
    for epoch in range(2):  # every row once per epoch across the ranks (padding: less than a batch each)
        per_rank = [r["epochs"][epoch] for r in reports]
        rows = per_rank[0] + per_rank[1]
        assert set(rows) == set(range(ROWS)) and len(rows) - ROWS < 2 * BATCH
        assert len(per_rank[0]) == len(per_rank[1])
    assert reports[0]["epochs"][0] != reports[0]["epochs"][1]  # shuffled anew each epoch
    assert memory.samples > 5 and 0 < memory.used <= BUDGET and memory.allocated <= BUDGET, vars(memory)


def test_one_rank_streams_and_auto_stream_false_keeps_lazy_reads(h5: Path) -> None:
    with h5py.File(h5) as f:
        x_all = f["x"][:]
    with daemon() as d, runtime_env(d.runtime_dir):
        ds, caught = open_global(h5)
        try:
            check_warning([str(w.message) for w in caught])
            assert (ds.mode, ds.requested_mode, ds.backend) == ("stream", "global", "shm")
            assert ds.stream is not None and ds.stream.config.capacity == ds.auto_streamed.capacity
            rows = epoch_rows(ds, x_all)
            assert sorted(rows) == list(range(ROWS))
            assert rows[:BATCH] != list(range(BATCH))  # not file order
            plan = ds.auto_streamed
            assert plan.whole == (False, True)  # the labels' room came out of the window: both within the budget
            assert plan.window + ROWS * 8 + 4096 <= BUDGET
            with DaemonClient(d.runtime_dir) as client:
                status = client.status()
            segments = status["segments"]
            labels = [s for s in segments if s["key"] == "y"]
            assert len(labels) == 1 and labels[0]["mode"] == "global" and labels[0]["whole_file"], labels
            in_arena = arena_wanted()  # (unless H5SERVE_ARENA=0) x's blocks in an arena
            assert {s["key"] for s in segments if s["mode"] == "stream"} == (set() if in_arena else {"x"})
            assert status["arenas"]["arenas"] == int(in_arena)
            for workers, context in ((2, "fork"), (1, "spawn")):  # workers map the labels' segment and blocks too
                assert epoch_rows(ds, x_all, workers=workers, context=context) == rows, context
        finally:
            ds.close()
        with warnings.catch_warnings(record=True) as node_caught:
            warnings.simplefilter("always")
            node = SharedH5Dataset(h5, "x", "y", mode="node", rank=0, world_size=1)
        try:
            check_warning([str(w.message) for w in node_caught if issubclass(w.category, RuntimeWarning)])
            assert "not the node permutation" in str(node_caught[0].message)
            assert (node.mode, node.requested_mode, node.backend) == ("stream", "node", "shm")
            assert sorted(epoch_rows(node, x_all, epoch=1)) == list(range(ROWS))
        finally:
            node.close()
        lazy, caught = open_global(h5, auto_stream=False)
        try:
            assert (lazy.mode, lazy.backend, lazy.auto_streamed) == ("global", "lazy", None)
            (warning,) = caught
            assert "lazily through h5py" in str(warning.message) and "streaming" not in str(warning.message)
            assert sorted(epoch_rows(lazy, x_all)) == list(range(ROWS))
        finally:
            lazy.close()


def test_no_daemon_or_data_that_fits_stays_global(h5: Path) -> None:
    nowhere = short_tmpdir("h5s-none-")
    with runtime_env(nowhere):
        ds, caught = open_global(h5)
        try:
            assert (ds.mode, ds.backend) == ("global", "lazy")  # no budget known: today's fallback
            (warning,) = caught
            assert "lazily through h5py" in str(warning.message)
        finally:
            ds.close()
    with daemon(4 * need_bytes()) as d, runtime_env(d.runtime_dir):
        ds, caught = open_global(h5)
        try:
            assert (ds.mode, ds.backend, caught) == ("global", "shm", [])
        finally:
            ds.close()


def test_the_window_does_not_follow_what_is_free_in_shm_at_the_moment(h5: Path) -> None:
    """Two jobs on a node, before and after another user's file takes most of the daemon's shm
    filesystem: the same window, block and so order (the budget, or the filesystem's size; never
    its free space of the moment)."""
    with tmpfs("16m") as shm, daemon_on(shm) as d, runtime_env(d.runtime_dir):
        first, caught = open_global(h5)
        first.close()
        check_warning([str(w.message) for w in caught])
        plan = first.auto_streamed
        assert plan is not None and plan.limit == plan.budget == BUDGET
        filler = shm / "another-users-file"
        filler.write_bytes(bytes(15 << 20))  # 1 MiB left free: less than the budget of 2 MiB
        try:
            second, _ = open_global(h5)
            second.close()
        finally:
            filler.unlink()
        assert second.auto_streamed == plan


@contextmanager
def daemon_on(shm: Path) -> Iterator[Daemon]:
    """A daemon of BUDGET whose shm dir is ``shm``."""
    with running_daemon("--max-memory", str(BUDGET), "--shm-dir", str(shm), "--loaders", "2") as d:
        yield d


def inspect_json(h5: Path, *args: str) -> dict:
    result = h5serve_cli("inspect", str(h5), "--key", "x", "--key", "y", "--json", *args,
                         env={**os.environ, "H5SERVE_RUNTIME_DIR": str(short_tmpdir("h5s-none-"))})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_inspect_recommends_stream_with_the_window_auto_mode_uses(h5: Path) -> None:
    report = inspect_json(h5, "--max-memory", str(BUDGET))
    stream = report["stream"]
    assert report["recommended_mode"] == "stream"
    assert stream["window"] <= BUDGET and stream["capacity"] * stream["block_cost"] <= BUDGET
    assert stream["block_rows"] % 64 == 0 and stream["blocks"] == -(-ROWS // stream["block_rows"])
    assert stream["block_bytes"] == stream["block_rows"] * (1024 + 8)
    (advice,) = [a["text"] for a in report["advice"] if a["code"] == "stream"]
    assert stream["whole"] == [False, True] and stream["whole_bytes"] == allocated_bytes(ROWS * 8 + 4096)  # y beside it
    assert stream["capacity"] * stream["block_cost"] + stream["whole_bytes"] <= BUDGET
    assert "mode='stream') with a daemon of this budget picks that window and block, and holds y whole" in advice
    with daemon() as d, runtime_env(d.runtime_dir):  # what automatic stream mode serves: the same window
        ds, _ = open_global(h5)
        try:
            plan = ds.auto_streamed
            assert plan is not None and (plan.window, plan.block_rows) == (stream["window"], stream["block_rows"])
        finally:
            ds.close()
    text = h5serve_cli("inspect", str(h5), "--key", "x", "--key", "y", "--max-memory", str(BUDGET)).stdout
    assert "recommended: mode 'stream', window" in text and "NO: streamed" in text
    assert "y held whole beside it" in text
    fits = inspect_json(h5, "--max-memory", str(4 * need_bytes()))
    assert fits["recommended_mode"] == "global" and fits["stream"] is None
    assert "stream" not in [a["code"] for a in fits["advice"]]
