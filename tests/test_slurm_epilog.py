"""deploy/slurm/epilog.sh against real daemons on real runtime dirs under /run/h5serve.

The epilog is what frees a node's shared memory when a job ends, including when the job's
daemon was killed or hangs: then it removes the segments by name, re-deriving the naming
scheme of h5serve.segments in shell. These tests catch the two drifting apart. They need
root (the epilog runs as root and works in /run/h5serve), as slurmd runs it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from h5serve.client import SharedH5Dataset

from .helpers import h5serve_cli, make_h5, short_workdir, wait_for

EPILOG = Path(__file__).resolve().parent.parent / "deploy" / "slurm" / "epilog.sh"
RUN_ROOT = Path("/run/h5serve")

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0 or not os.access("/run", os.W_OK),
                       reason="the epilog runs as root and works in /run/h5serve"),
]


class Job:
    """A job's daemon on /run/h5serve/<job id>, holding one segment."""

    def __init__(self, job_id: int, data: Path) -> None:
        self.id = job_id
        self.runtime_dir = RUN_ROOT / str(job_id)
        self.env = {**os.environ, "H5SERVE_RUNTIME_DIR": str(self.runtime_dir)}
        started = h5serve_cli("start", env=self.env)
        assert started.returncode == 0, started.stderr
        self.pid = int((self.runtime_dir / "h5serve.pid").read_text())
        SharedH5Dataset(data, "x", rank=0, world_size=1, runtime_dir=self.runtime_dir, fallback="error").close()
        self.segments = [Path("/dev/shm") / s["name"] for s in self.status()["segments"]]
        assert self.segments and all(p.exists() for p in self.segments)

    def status(self) -> dict:
        done = h5serve_cli("status", "--json", env=self.env)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().split(") ", 1)[1][0] != "Z"
        except (ProcessLookupError, OSError):
            return False

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)  # the daemon leads its own process group
        except (ProcessLookupError, PermissionError):
            pass
        assert wait_for(lambda: not self.alive(), 10)

    def cleanup(self) -> None:
        if self.alive():
            self.kill()
        for p in self.segments:
            p.unlink(missing_ok=True)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


@pytest.fixture
def workdir() -> Iterator[Path]:
    with short_workdir("h5s-epi-") as where:
        yield where


@pytest.fixture
def jobs(workdir: Path) -> Iterator[list[Job]]:
    data = make_h5(workdir / "data.h5")
    base = 4_000_000_000 + os.getpid() * 10  # job ids nobody else uses on this machine
    started: list[Job] = []
    try:
        for i in range(2):
            started.append(Job(base + i, data))
        yield started
    finally:
        for job in started:
            job.cleanup()


def run_epilog(job: Job, workdir: Path) -> subprocess.CompletedProcess[str]:
    """As slurmd runs it: root, a bare PATH, the job's id and uid in the environment; the
    site config names the h5serve command (here: this interpreter's)."""
    wrapper = workdir / "h5serve"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m h5serve "$@"\n')
    wrapper.chmod(0o755)
    config = workdir / "h5serve-slurm"
    config.write_text(f"H5SERVE_BIN={wrapper}\nPATH={Path(sys.executable).parent}:$PATH\n")
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": str(job.id), "SLURM_JOB_UID": str(os.getuid()),
           "H5SERVE_SLURM_CONFIG": str(config), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    return subprocess.run(["bash", str(EPILOG)], env=env, capture_output=True, text=True, timeout=90)


def test_epilog_stops_a_live_daemon(jobs: list[Job], workdir: Path) -> None:
    job, other = jobs
    done = run_epilog(job, workdir)
    assert done.returncode == 0, done.stderr
    assert wait_for(lambda: not job.alive(), 10)
    assert not any(p.exists() for p in job.segments)  # unlinked by the daemon on stop
    assert not job.runtime_dir.exists()
    assert other.alive() and all(p.exists() for p in other.segments)  # another job's daemon is untouched


def test_epilog_removes_a_killed_daemons_segments(jobs: list[Job], workdir: Path) -> None:
    """A daemon killed -9 unlinks nothing: the epilog finds its segments by name (uid and the
    hash of the job's runtime dir) and removes exactly those."""
    job, other = jobs
    job.kill()
    assert all(p.exists() for p in job.segments)
    done = run_epilog(job, workdir)
    assert done.returncode == 0, done.stderr
    assert not any(p.exists() for p in job.segments)
    assert not job.runtime_dir.exists()
    assert other.alive() and all(p.exists() for p in other.segments)
    other.kill()  # and when that job ends too, its own epilog finds its own segments
    assert run_epilog(other, workdir).returncode == 0
    assert not any(p.exists() for p in other.segments)
