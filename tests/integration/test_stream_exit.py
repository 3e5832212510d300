"""A stream dataset served by a real daemon and never closed never keeps its process from
exiting: freed by the garbage collector (held in a reference cycle, ``train()`` then
``gc.collect()``) or left alive until the interpreter exits, in the main process, with forked
and spawned DataLoader workers, for ``mode="stream"`` and for a ``mode="global"`` dataset the
daemon's budget streams automatically, and under torchrun (2 gloo ranks); a collected dataset
leaves no segment open (leased) or mapped, and the process talks to the daemon on. Each job
(tests/jobs/stream_exit_job.py) runs in a subprocess with a deadline and is killed past it: a job
that hangs holds its allocation forever."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..helpers import Daemon, make_h5, running_daemon, torchrun_two_ranks

pytestmark = pytest.mark.timeout(300)

TESTS = Path(__file__).resolve().parents[1]
JOB = TESTS / "jobs" / "stream_exit_job.py"
ROWS, SHAPE = 8193, (1024,)  # 8 MiB of x: 4x the daemon's budget
BUDGET = 2 * 1024 * 1024
DEADLINE_S = 120  # a job takes 3-15 s here; one that hangs never ends


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_h5(tmp_path_factory.mktemp("streamexit") / "data.h5", rows=ROWS, row_shape=SHAPE)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    with running_daemon("--max-memory", str(BUDGET), "--loaders", "2") as d:
        yield d


def run_job(h5: Path, d: Daemon, *args: str) -> dict:
    """The job's report; fails when it does not exit within DEADLINE_S (killed, with all it started)."""
    env = {**os.environ, "H5SERVE_RUNTIME_DIR": str(d.runtime_dir), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(TESTS.parent), "PYTHONWARNINGS": "always::ResourceWarning"}
    process = subprocess.Popen([sys.executable, str(JOB), str(h5), *args], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    hung = False
    try:
        output, _ = process.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        hung = True
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate(timeout=30)
    assert not hung, f"the job ({' '.join(args)}) did not exit within {DEADLINE_S} s:\n{output[-4000:]}"
    assert process.returncode == 0, output[-4000:]
    # nothing failed in a finalizer, and no socket was left to pyzmq to close (or to a child to close)
    assert "Exception ignored" not in output and "Unclosed" not in output, output[-4000:]
    lines = [line for line in output.splitlines() if line.startswith("{")]
    assert lines, output[-4000:]
    return json.loads(lines[-1])


CASES = [
    pytest.param("stream", "gc", 0, "fork", id="stream-gc"),
    pytest.param("stream", "exit", 0, "fork", id="stream-exit"),
    pytest.param("stream", "gc", 2, "fork", id="stream-gc-fork-workers"),
    pytest.param("stream", "gc", 2, "spawn", id="stream-gc-spawn-workers"),
    pytest.param("stream", "exit", 2, "fork", id="stream-exit-fork-workers"),
    pytest.param("stream", "exit", 2, "spawn", id="stream-exit-spawn-workers"),
    pytest.param("global", "gc", 0, "fork", id="auto-stream-gc"),
    pytest.param("global", "exit", 2, "fork", id="auto-stream-exit-fork-workers"),
]


@pytest.mark.parametrize(("mode", "end", "workers", "context"), CASES)
def test_unclosed_stream_dataset_never_keeps_its_process_from_exiting(
        h5: Path, daemon: Daemon, mode: str, end: str, workers: int, context: str) -> None:
    report = run_job(h5, daemon, "--mode", mode, "--end", end, "--workers", str(workers), "--context", context)
    assert (report["mode"], report["requested_mode"], report["backend"]) == ("stream", mode, "shm")
    assert report["batches"] == (12 if workers else 4)


def test_ddp_ranks_exit_after_their_unclosed_stream_dataset_is_collected(h5: Path, daemon: Daemon,
                                                                        tmp_path: Path) -> None:
    reports = torchrun_two_ranks(JOB, [str(h5), "--end", "gc", "--out", str(tmp_path / "out")], tmp_path / "out",
                                 daemon.runtime_dir, DEADLINE_S)
    for report in reports:
        assert (report["mode"], report["backend"], report["batches"]) == ("stream", "shm", 4)
