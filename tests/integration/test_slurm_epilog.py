"""deploy/slurm/prolog.sh and epilog.sh as slurmd runs them, against real jobs of real users.

slurmd runs both as root, with a bare environment (``PATH=/usr/bin:/bin`` and the job's
SLURM_* variables). Each job here is a throwaway user's: the prolog starts its daemon (through
the site config's H5SERVE_BIN, a Python any user can run) on /run/h5serve/<job id>, a client
of that user loads a segment, and the epilog must free the node: stop the daemon, remove its
segments (by name, re-deriving h5serve.segments' naming in shell, when the daemon was
killed) and its runtime dir. The job user is hostile too: everything in the runtime dir is
theirs to rewrite, and the epilog must never signal, follow or block on what they put there.
"""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from h5serve.client import SharedH5Dataset

from ..helpers import alive, make_h5, short_workdir, wait_for
from ..users import PortablePython, User, as_user, throwaway_user

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "slurm"
PROLOG, EPILOG = DEPLOY / "prolog.sh", DEPLOY / "epilog.sh"
RUN_ROOT = Path("/run/h5serve")
SHM = Path("/dev/shm")

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or not os.access("/run", os.W_OK),
                       reason="the prolog and epilog run as root and work in /run/h5serve"),
]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def job_user() -> Iterator[User]:
    with throwaway_user() as user:
        yield user


@pytest.fixture(scope="module")
def other_user() -> Iterator[User]:
    with throwaway_user() as user:
        yield user


@pytest.fixture
def workdir() -> Iterator[Path]:
    with short_workdir("h5s-epi-") as where:
        where.chmod(0o755)  # job users read the data file
        yield where


@pytest.fixture
def config(workdir: Path, py: PortablePython) -> Path:
    """The site config: root's, as the scripts require."""
    path = workdir / "h5serve-slurm"
    path.write_text(f"H5SERVE_BIN={py.h5serve_bin}\nH5SERVE_ALL_JOBS=yes\nH5SERVE_START_TIMEOUT=60\n")
    path.chmod(0o644)
    return path


@pytest.fixture
def data(workdir: Path) -> Path:
    path = make_h5(workdir / "data.h5")
    path.chmod(0o644)
    return path


def run_script(script: Path, job_id: int, user: User, config: Path,
               timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """As slurmd runs it: root, a bare PATH, the job's id, uid and user name."""
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": str(job_id), "SLURM_JOB_UID": str(user.uid),
           "SLURM_JOB_USER": user.name, "H5SERVE_SLURM_CONFIG": str(config)}
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=timeout, cwd="/",
                          check=False)


def process_uid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Uid:"))


def as_ok(user: User, fn) -> object:
    status, out = as_user(user, fn)
    assert status == "ok", out
    return out


class Job:
    """A job of ``user``: the prolog started its daemon, and a client loaded one segment."""

    def __init__(self, job_id: int, user: User, config: Path) -> None:
        self.id, self.user, self.config = job_id, user, config
        self.runtime_dir = RUN_ROOT / str(job_id)
        ns = hashlib.blake2b(str(self.runtime_dir).encode(), digest_size=4).hexdigest()
        self.prefix = f"h5serve-{user.uid}-{ns}-"
        self.pid = 0
        self.segments: list[Path] = []

    def start(self, data: Path) -> None:
        done = run_script(PROLOG, self.id, self.user, self.config)
        assert done.returncode == 0, done.stderr
        self.pid = int((self.runtime_dir / "h5serve.pid").read_text())
        runtime_dir = self.runtime_dir
        backend = as_ok(self.user, lambda: SharedH5Dataset(data, "x", rank=0, world_size=1, runtime_dir=runtime_dir,
                                                           fallback="error").backend)
        assert backend == "shm"
        self.segments = [SHM / n for n in os.listdir(SHM) if n.startswith(self.prefix)]
        assert self.segments

    def epilog(self, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return run_script(EPILOG, self.id, self.user, self.config, timeout)

    def alive(self) -> bool:
        return alive(self.pid)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        assert wait_for(lambda: not self.alive(), 10)

    def cleanup(self) -> None:
        if self.pid and self.alive():
            self.kill()
        for path in self.segments:
            path.unlink(missing_ok=True)
        subprocess.run(["rm", "-rf", "--one-file-system", str(self.runtime_dir)], timeout=60, check=False)


@pytest.fixture
def jobs(job_user: User, data: Path, config: Path) -> Iterator[list[Job]]:
    base = 4_000_000_000 + (os.getpid() % 100_000) * 10  # job ids nobody else uses on this machine
    started: list[Job] = []
    try:
        for i in range(2):
            started.append(Job(base + i, job_user, config))
            started[-1].start(data)
        yield started
    finally:
        for job in started:
            job.cleanup()


@pytest.fixture
def root_sleeper() -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(["sleep", "300"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def root_file(path: Path, content: bytes, mode: int = 0o600) -> tuple:
    path.write_bytes(content)
    path.chmod(mode)
    return fingerprint(path)


def fingerprint(path: Path) -> tuple:
    st = os.lstat(path)
    return st.st_ino, st.st_mode, st.st_uid, st.st_mtime_ns, path.read_bytes()


def assert_job_gone(job: Job) -> None:
    assert wait_for(lambda: not job.alive(), 10)
    assert not any(p.exists() for p in job.segments)
    assert not job.runtime_dir.exists()


# --------------------------------------------------------------------------- tests


def test_prolog_starts_the_daemon_as_the_job_user_once(jobs: list[Job]) -> None:
    job = jobs[0]
    st = os.lstat(job.runtime_dir)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == job.user.uid and stat.S_IMODE(st.st_mode) == 0o700
    assert process_uid(job.pid) == job.user.uid
    assert all(os.lstat(p).st_uid == job.user.uid for p in job.segments)
    again = run_script(PROLOG, job.id, job.user, job.config)  # idempotent: the same daemon
    assert again.returncode == 0 and int((job.runtime_dir / "h5serve.pid").read_text()) == job.pid


def test_epilog_stops_a_live_daemon(jobs: list[Job]) -> None:
    job, other = jobs
    done = job.epilog()
    assert done.returncode == 0, done.stderr
    assert_job_gone(job)
    assert other.alive() and all(p.exists() for p in other.segments)  # another job's daemon is untouched


def test_epilog_removes_a_killed_daemons_segments_and_nothing_else(jobs: list[Job], other_user: User) -> None:
    """A daemon killed -9 unlinks nothing: the epilog finds its segments by name (uid and the
    hash of the job's runtime dir) and removes exactly those, as the job user: another user's
    files under the same prefix and another job's segments stay."""
    job, other = jobs
    job.kill()
    assert all(p.exists() for p in job.segments)
    planted = [SHM / f"{job.prefix}planted", SHM / f"{job.prefix}planted-fifo"]

    def plant() -> None:
        planted[0].write_bytes(b"not yours")
        os.mkfifo(planted[1], 0o666)

    as_ok(other_user, plant)
    try:
        before = {p: os.lstat(p) for p in planted}
        done = job.epilog()
        assert done.returncode == 0, done.stderr
        assert not any(p.exists() for p in job.segments) and not job.runtime_dir.exists()
        assert {p: os.lstat(p) for p in planted} == before and planted[0].read_bytes() == b"not yours"
        assert other.alive() and all(p.exists() for p in other.segments)
        other.kill()  # and when that job ends too, its own epilog finds its own segments
        assert other.epilog().returncode == 0
        assert not any(p.exists() for p in other.segments)
    finally:
        for p in planted:
            p.unlink(missing_ok=True)


def test_pidfile_naming_a_root_process_never_gets_it_killed(jobs: list[Job], root_sleeper: subprocess.Popen) -> None:
    """The user stops their daemon (so `h5serve stop` fails and the epilog escalates to
    signals) and writes a root process's pid into the pidfile the daemon still locks."""
    job = jobs[0]
    pidfile, daemon = job.runtime_dir / "h5serve.pid", job.pid

    def rewrite() -> None:  # same inode: the daemon still holds its lock on it
        os.kill(daemon, signal.SIGSTOP)
        with open(pidfile, "r+") as f:
            f.truncate(0)
            f.write(f"{root_sleeper.pid}\n")

    as_ok(job.user, rewrite)
    done = job.epilog()
    assert done.returncode == 0, done.stderr
    assert root_sleeper.poll() is None and alive(root_sleeper.pid)
    assert_job_gone(job)


def test_fifo_pidfile_never_hangs_the_epilog(jobs: list[Job]) -> None:
    job = jobs[0]
    pidfile = job.runtime_dir / "h5serve.pid"

    def to_fifo() -> None:
        pidfile.unlink()
        os.mkfifo(pidfile, 0o600)

    as_ok(job.user, to_fifo)
    started = time.monotonic()
    done = job.epilog(timeout=100)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert elapsed < 75, f"the epilog took {elapsed:.0f}s"
    assert_job_gone(job)  # found by its command line and lock, stopped as the job user


def test_symlinks_in_the_runtime_dir_never_reach_root_files(jobs: list[Job], workdir: Path) -> None:
    job = jobs[0]
    secret_file = workdir / "root-only"
    secret_dir = workdir / "root-dir"
    secret_dir.mkdir(mode=0o755)
    inner = secret_dir / "keep"
    before = {secret_file: root_file(secret_file, b"root's secret\n"), inner: root_file(inner, b"keep me\n", 0o644)}
    dir_before = os.lstat(secret_dir)
    rt = job.runtime_dir

    def plant() -> None:
        for name, target in (("h5serve.pid", secret_file), ("h5serve.log", secret_file), ("h5serve.key", inner)):
            (rt / name).unlink(missing_ok=True)
            os.symlink(target, rt / name)
        os.symlink(secret_dir, rt / "dir-link")
        (rt / "sub").mkdir()
        os.symlink(secret_dir, rt / "sub" / "deeper")

    as_ok(job.user, plant)
    done = job.epilog()
    assert done.returncode == 0, done.stderr
    assert {p: fingerprint(p) for p in before} == before
    after = os.lstat(secret_dir)
    assert (after.st_ino, after.st_mode, after.st_uid) == (dir_before.st_ino, dir_before.st_mode, dir_before.st_uid)
    assert_job_gone(job)
