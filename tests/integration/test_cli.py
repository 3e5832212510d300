"""The command line against real daemons: start/stop/status/preload, the pidfile lock, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from h5serve.client import SharedH5Dataset
from h5serve.util.units import allocated_bytes, format_bytes

from ..helpers import Daemon, h5serve_cli, make_h5, wait_for


def test_start_is_idempotent_and_second_daemon_cannot_steal_socket(daemon: Daemon) -> None:
    again = h5serve_cli("start", env=daemon.env)
    assert again.returncode == 0 and f"pid {daemon.pid}" in again.stdout
    foreground = h5serve_cli("start", "--foreground", env=daemon.env, timeout=30)
    assert foreground.returncode == 0 and "already serves" in foreground.stderr
    assert daemon.status()["pid"] == daemon.pid  # the first daemon still owns the socket


def test_status_exit_codes_and_json(daemon: Daemon, h5file: Path) -> None:
    human = h5serve_cli("status", env=daemon.env)
    assert human.returncode == 0 and "no segments" in human.stdout
    budget = format_bytes(daemon.status()["memory"]["budget"])
    assert f"window=None streams through a window of the budget, {budget}" in human.stdout
    held = SharedH5Dataset(h5file, "x", "y", rank=1, world_size=2, runtime_dir=daemon.runtime_dir)
    again = SharedH5Dataset(h5file, "x", rank=1, world_size=2, runtime_dir=daemon.runtime_dir)
    info = daemon.status()
    assert info["schema_version"] == 1
    assert {s["key"]: s["holders"] for s in info["segments"]} == {"x": 2, "y": 1}  # one lease per attach
    again.close()
    assert {s["key"]: s["holders"] for s in daemon.status()["segments"]} == {"x": 1, "y": 1}
    held.close()
    rows = {(s["key"], s["rank"], s["world_size"], s["mode"], s["dtype"], s["state"]) for s in info["segments"]}
    assert rows == {("x", 1, 2, "contiguous", "uint8", "ready"), ("y", 1, 2, "contiguous", "int64", "ready")}
    # the budget counts each segment's pages in tmpfs, the files' sizes are shown beside them
    assert all(s["charged"] == allocated_bytes(s["bytes"]) for s in info["segments"])
    assert info["memory"]["used"] == sum(s["charged"] for s in info["segments"]) > 0
    assert info["memory"]["segment_bytes"] == sum(s["bytes"] for s in info["segments"])
    table = h5serve_cli("status", env=daemon.env).stdout
    assert "x" in table and "1/2" in table and "ready" in table
    assert "holders" in table and "age" in table
    assert h5serve_cli("stop", env=daemon.env).returncode == 0
    stopped = h5serve_cli("status", "--json", env=daemon.env)
    assert stopped.returncode == 3 and json.loads(stopped.stdout)["running"] is False
    assert h5serve_cli("status", env=daemon.env).returncode == 3
    assert h5serve_cli("stop", env=daemon.env).returncode == 0  # not running is fine


def test_stop_unlinks_segments(daemon: Daemon, h5file: Path) -> None:
    SharedH5Dataset(h5file, "x", rank=0, world_size=1, runtime_dir=daemon.runtime_dir).close()
    assert len(daemon.segment_files()) == 1
    assert h5serve_cli("stop", env=daemon.env).returncode == 0
    assert daemon.segment_files() == [] and not (daemon.runtime_dir / "h5serve.sock").exists()


def test_sigterm_is_a_graceful_stop(daemon: Daemon, h5file: Path) -> None:
    SharedH5Dataset(h5file, "x", rank=0, world_size=1, runtime_dir=daemon.runtime_dir).close()
    os.kill(daemon.pid, signal.SIGTERM)
    assert wait_for(lambda: not daemon.alive(), 20)
    assert daemon.segment_files() == []


def test_preload_then_attach(daemon: Daemon, h5file: Path) -> None:
    done = h5serve_cli("preload", str(h5file), "--x-key", "x", "--y-key", "y", "--world-size", "4",
                       "--ranks", "0-1,3", "--mode", "interleave", "--dtype-x", "float32", env=daemon.env)
    assert done.returncode == 0, done.stderr
    segments = daemon.status()["segments"]
    assert sorted({s["rank"] for s in segments}) == [0, 1, 3] and len(segments) == 6
    loads = daemon.status()["counters"]["loads"]
    ds = SharedH5Dataset(h5file, "x", "y", mode="interleave", rank=3, world_size=4, dtype_x=np.float32,
                         runtime_dir=daemon.runtime_dir)
    assert ds.backend == "shm" and daemon.status()["counters"]["loads"] == loads


@pytest.mark.parametrize(
    "args,match",
    [
        (["--ranks", "0-9"], "ranks must be in"),
        (["--ranks", "a-b"], "not a list"),
        (["--world-size", "0"], "--world-size must be >= 1"),
    ],
)
def test_preload_bad_arguments(daemon: Daemon, h5file: Path, args: list[str], match: str) -> None:
    base = ["preload", str(h5file), "--x-key", "x", "--world-size", "2"]
    done = h5serve_cli(*base, *args, env=daemon.env)
    assert done.returncode == 1 and match in done.stderr


def test_preload_missing_key_is_exit_1(daemon: Daemon, h5file: Path) -> None:
    done = h5serve_cli("preload", str(h5file), "--x-key", "nope", "--world-size", "1", env=daemon.env)
    assert done.returncode == 1 and "datasets there" in done.stderr


def test_bad_max_memory_is_refused_before_starting(tmp_path: Path) -> None:
    d = Daemon("--max-memory", "lots")
    try:
        done = h5serve_cli("start", "--max-memory", "lots", env=d.env)
        assert done.returncode == 1 and "not a size" in done.stderr
        assert not (d.runtime_dir / "h5serve.sock").exists()
    finally:
        d.stop()


@pytest.mark.parametrize("args,match,code", [
    (["--loaders", "0"], "argument --loaders: must be at least 1", 2),
    (["--loaders", "two"], "argument --loaders: takes a whole number", 2),
    (["--metrics-port", "70000"], "--metrics-port must be in", 1),
    (["--max-memory", "12 parsecs"], "not a size", 1),
    (["--log-level", "chatty"], "argument --log-level: invalid choice: 'CHATTY'", 2),
    (["--idle-exit", "-1"], "argument --idle-exit: must be a number of seconds >= 0 (0: never), got '-1'", 2),
    (["--idle-exit", "10m"], "argument --idle-exit: takes a number of seconds (0: never), got '10m'", 2),
    (["--idle-exit", "nan"], "argument --idle-exit: must be a number of seconds >= 0", 2),
])
def test_bad_start_options_are_refused_before_starting(args: list[str], match: str, code: int) -> None:
    """Exit 2: argparse refused the value (bad usage); 1: h5serve did (the message says what to do)."""
    d = Daemon()
    try:
        done = h5serve_cli("start", *args, env=d.env)
        assert done.returncode == code and match in done.stderr
        assert not (d.runtime_dir / "h5serve.sock").exists()
    finally:
        d.stop()


def test_log_level_in_any_case(h5file: Path) -> None:
    d = Daemon("--log-level", "debug")
    try:
        d.start()
        SharedH5Dataset(h5file, "x", rank=0, world_size=1, runtime_dir=d.runtime_dir, fallback="error").close()
        assert " DEBUG load of " in (d.runtime_dir / "h5serve.log").read_text()
    finally:
        d.stop()


def test_too_long_runtime_dir_is_a_clear_error(tmp_path: Path) -> None:
    done = h5serve_cli("status", "--runtime-dir", "/tmp/" + "d" * 120)
    assert done.returncode == 1 and "too long" in done.stderr


def test_foreground_daemon_under_a_supervisor(tmp_path: Path, h5file: Path) -> None:
    d = Daemon()
    process = subprocess.Popen([sys.executable, "-m", "h5serve", "start", "--foreground"], env=d.env,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: h5serve_cli("status", env=d.env).returncode == 0, 30)
        ds = SharedH5Dataset(h5file, "y", rank=0, world_size=1, runtime_dir=d.runtime_dir)
        assert ds.backend == "shm" and ds[7].item() == 7
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        assert "loaded" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        d.stop()


def test_restart_after_kill_adopts_complete_segments(tmp_path: Path) -> None:
    path = make_h5(tmp_path / "adopt.h5")
    d = Daemon().start()
    try:
        SharedH5Dataset(path, "x", rank=0, world_size=1, runtime_dir=d.runtime_dir).close()
        before = d.segment_files()
        os.kill(d.pid, signal.SIGKILL)
        assert wait_for(lambda: not d.alive(), 10)
        d.start()
        info = d.status()
        assert info["counters"]["adopted"] == 1 and d.segment_files() == before
        ds = SharedH5Dataset(path, "x", rank=0, world_size=1, runtime_dir=d.runtime_dir)
        assert ds.backend == "shm" and d.status()["counters"].get("loads", 0) == 0
    finally:
        d.stop()


def test_preload_plan_loads_exactly_this_nodes_ranks(daemon: Daemon, h5file: Path) -> None:
    env = {**daemon.env, "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "2(x2)",
           "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_NTASKS": "4"}
    plan = h5serve_cli("plan", "--json", env=env)
    assert plan.returncode == 0 and json.loads(plan.stdout) == {"node_rank": 1, "ranks": [2, 3], "world_size": 4}
    done = h5serve_cli("preload", str(h5file), "--x-key", "x", "--plan", env=env)
    assert done.returncode == 0, done.stderr
    assert sorted((s["rank"], s["world_size"]) for s in daemon.status()["segments"]) == [(2, 4), (3, 4)]
    both = h5serve_cli("preload", str(h5file), "--x-key", "x", "--plan", "--ranks", "0", env=env)
    assert both.returncode == 1 and "pass one of them" in both.stderr
    alone = h5serve_cli("preload", str(h5file), "--x-key", "x", env=daemon.env)
    assert alone.returncode == 1 and "needs --world-size" in alone.stderr


def test_preload_node_mode_loads_the_nodes_block_once(daemon: Daemon, h5file: Path) -> None:
    """`preload --mode node --plan` in a SLURM prolog loads one block, the union of this node's
    ranks' shards; the job's node-mode datasets on that node then attach without a load."""
    env = {**daemon.env, "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "2(x2)",
           "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_NTASKS": "4"}
    done = h5serve_cli("preload", str(h5file), "--x-key", "x", "--y-key", "y", "--plan", "--mode", "node", env=env)
    assert done.returncode == 0, done.stderr
    segments = daemon.status()["segments"]
    assert len(segments) == 2 and {(s["rank"], s["world_size"]) for s in segments} == {(2, 4)}
    loads = daemon.status()["counters"]["loads"]
    for local in range(2):
        ds = SharedH5Dataset(h5file, "x", "y", mode="node", rank=2 + local, world_size=4, local_rank=local,
                             local_world_size=2, node_rank=1, num_nodes=2, runtime_dir=daemon.runtime_dir)
        assert ds.backend == "shm" and len(ds) == sum(ds.shard_sizes()[2:])  # ranks 2 and 3's rows
        ds.close()
    assert daemon.status()["counters"]["loads"] == loads
    gap = h5serve_cli("preload", str(h5file), "--x-key", "x", "--world-size", "4", "--ranks", "0,2", "--mode",
                      "node", env=daemon.env)
    assert gap.returncode == 1 and "consecutive" in gap.stderr


def test_concurrent_starts_give_one_daemon_and_both_succeed() -> None:
    d = Daemon()
    try:
        starts = [subprocess.Popen([sys.executable, "-m", "h5serve", "start"], env=d.env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for _ in range(3)]
        try:
            results = [(p.wait(timeout=60), p.stderr.read()) for p in starts]
        finally:
            for p in starts:
                if p.poll() is None:
                    p.kill()
        assert all(code == 0 for code, _ in results), results
        d.pid = int((d.runtime_dir / "h5serve.pid").read_text())
        assert d.status()["pid"] == d.pid
    finally:
        d.stop()
