"""`h5serve demo`, the README's first command: real torchrun jobs from a real daemon and the
predecessor's way, its three closing lines measured in the run, and nothing left behind
(daemon, segments, temp dir, jobs) whether it finishes or is interrupted."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from h5serve.segments import segment_prefix
from h5serve.wire.runtime import resolve_runtime

from ..helpers import alive, h5serve_cli, short_workdir, wait_for

ROWS = 4000
ROW_BYTES = 3 * 32 * 32


def _left_behind(workdir: Path, daemon_pid: int) -> list[str]:
    """What a demo whose temp dir was ``workdir`` left: the dir, its daemon, its segments,
    any process still running from the demo's files."""
    left = [str(workdir)] if workdir.exists() else []
    if daemon_pid and alive(daemon_pid):
        left.append(f"daemon pid {daemon_pid}")
    prefix = segment_prefix(resolve_runtime(workdir / "rt").namespace)
    left += [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(workdir).encode() in f.read() and alive(int(pid)):
                    left.append(f"process {pid}")
        except OSError:
            pass
    return left


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _size(value: str, unit: str) -> float:
    return float(value) * 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].index(unit)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_prints_the_three_measured_lines_and_leaves_nothing() -> None:
    with short_workdir("h5s-demo-") as tmp:
        env = {**os.environ, "TMPDIR": str(tmp)}
        done = h5serve_cli("demo", "--rows", str(ROWS), "--seconds", "0.3", "--steps", "3", env=env, timeout=280)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        out = done.stdout
        workdir = Path(re.search(r"sample file: (\S+)/train\.h5", out).group(1))
        daemon_pid = int(re.search(r"daemon started \(pid (\d+)\)", out).group(1))
        assert _left_behind(workdir, daemon_pid) == [] and os.listdir(tmp) == []

    ready = re.search(r"^ready: +first job ([\d.]+) s .*second job ([\d.]+) ms .*predecessor preload ([\d.]+) s: "
                      r"attach ([\d,]+)x faster", out, re.M)
    memory = re.search(r"^node memory: ([\d.]+) (\w+) \(one uint8 copy .*\) vs ([\d.]+) (\w+) \(a float32 copy in "
                       r"each rank\): ([\d.]+)x less", out, re.M)
    rate = re.search(r"^data rate: +([\d,]+) samples/s from shared memory vs ([\d,]+) from the predecessor's lazy "
                     r"per-item h5py reads: ([\d,]+)x", out, re.M)
    assert ready and memory and rate, out
    load_s, attach_ms, preload_s = (float(g) for g in ready.groups()[:3])
    assert load_s > 0 and attach_ms > 0 and preload_s > 0
    data = ROWS * ROW_BYTES
    shm, predecessor = _size(*memory.groups()[0:2]), _size(*memory.groups()[2:4])
    assert shm >= 0.95 * data  # the rows, once, in /dev/shm
    assert predecessor >= 2 * 4 * data * 0.9  # a float32 copy of every row in each of the 2 ranks
    assert _number(rate.group(1)) > 0 and _number(rate.group(2)) > 0

    # every rank of both jobs had every row (global mode); the same rows in the same order gave
    # the same loss in job 1 and job 2
    rows = [line.split() for line in out.splitlines() if re.match(r"^ +\d+ +(shm|predecessor) ", line)]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("0", "shm", str(ROWS)), ("1", "shm", str(ROWS))] * 2 + [("0", "predecessor", str(ROWS)),
                                                                  ("1", "predecessor", str(ROWS))]
    assert [r[-1] for r in rows[:2]] == [r[-1] for r in rows[2:4]], out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_interrupted_demo_stops_its_daemon_and_jobs_and_removes_its_dir() -> None:
    with short_workdir("h5s-demo-") as tmp:
        env = {**os.environ, "TMPDIR": str(tmp)}
        # SIGINT as a terminal delivers it: a suite started in the background of a shell without
        # job control inherits SIGINT ignored, and Python then installs no KeyboardInterrupt
        demo = subprocess.Popen([sys.executable, "-m", "h5serve", "demo", "--rows", str(ROWS)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            # interrupt while job 1 runs: the daemon is up and torchrun ranks are alive
            assert wait_for(lambda: any(tmp.glob("h5serve-demo-*/reports-*/output.txt")), timeout=120)
            workdir = next(tmp.glob("h5serve-demo-*"))
            daemon_pid = int((workdir / "rt" / "h5serve.pid").read_text())
            assert alive(daemon_pid)
            demo.send_signal(signal.SIGINT)
            output, _ = demo.communicate(timeout=90)
        finally:
            if demo.poll() is None:
                demo.kill()
                demo.wait()
        assert demo.returncode == 130, output[-3000:]
        assert wait_for(lambda: _left_behind(workdir, daemon_pid) == [], timeout=10), _left_behind(workdir, daemon_pid)
        assert os.listdir(tmp) == []


def test_demo_refuses_bad_sizes() -> None:
    done = h5serve_cli("demo", "--rows", "1")
    assert done.returncode == 1 and "--rows must be at least 2" in done.stderr and "Traceback" not in done.stderr
    done = h5serve_cli("demo", "--nproc", "0")
    assert done.returncode == 2 and "--nproc" in done.stderr
