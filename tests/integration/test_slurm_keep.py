"""Kept daemons (H5SERVE_KEEP_S) of deploy/slurm/prolog.sh and epilog.sh against hostile users.

The scripts run as slurmd runs them (root, a bare PATH, the job's SLURM_* variables; see
test_slurm_epilog.py) for jobs of throwaway users. Each test is one way a user could make the
root scripts stall every prolog, stop another user's kept daemon, reap a daemon under a running
job or leave one running with nothing to stop it:

- a lock any user can take (every file under /run/h5serve the user can open, flocked);
- another user's job on a node with room (no --max-memory: the default budget rule);
- the bookkeeping of a kept daemon gone missing;
- a SIGSTOPped kept daemon when room must be made;
- `df` and `getent` failing (shims first on the scripts' PATH, in a private mount namespace);
- /run/h5serve full (a small tmpfs there, in a private mount namespace, filled by a user).

H5SERVE_TEST_SLURM_DIR=<dir> runs them against other copies of the scripts (the old ones: `git
show main:deploy/slurm/prolog.sh`, ...), which is how each was seen to fail before the rewrite.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import pickle
import resource
import signal
import subprocess
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ..helpers import alive, short_workdir, wait_for
from ..users import PortablePython, User, as_user, running_as, throwaway_user

DEPLOY = Path(os.environ.get("H5SERVE_TEST_SLURM_DIR") or Path(__file__).resolve().parents[2] / "deploy" / "slurm")
PROLOG, EPILOG, TASK_PROLOG = DEPLOY / "prolog.sh", DEPLOY / "epilog.sh", DEPLOY / "task_prolog.sh"
RUN_ROOT = Path("/run/h5serve")
_CLONE_NEWNS = 0x00020000
PROLOG_BOUND_S = 30.0  # a prolog facing a hostile user: far below any of its waits for a lock

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or not os.access("/run", os.W_OK),
                       reason="the prolog and epilog run as root and work in /run/h5serve"),
]


@pytest.fixture(scope="module")
def users() -> Iterator[tuple[User, User]]:
    with throwaway_user() as a, throwaway_user() as b:
        yield a, b


@pytest.fixture
def workdir() -> Iterator[Path]:
    with short_workdir("h5s-keep-") as where:
        where.chmod(0o755)
        yield where


class Site:
    """Site configs (root's, 0644) in ``workdir``, all logging to one file."""

    def __init__(self, workdir: Path, py: PortablePython) -> None:
        self.workdir, self.py = workdir, py
        self.log = workdir / "h5serve-slurm.log"

    def config(self, keep: int, opts: str = "") -> Path:
        path = self.workdir / f"site-{keep}-{abs(hash(opts))}"
        path.write_text(f"H5SERVE_BIN={self.py.h5serve_bin}\nH5SERVE_ALL_JOBS=yes\nH5SERVE_START_TIMEOUT=60\n"
                        f"H5SERVE_KEEP_S={keep}\nH5SERVE_OPTS=\"{opts}\"\nH5SERVE_LOG={self.log}\n")
        path.chmod(0o644)
        return path

    def logged(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


def kill_everything_of(uids: set[int]) -> None:
    """SIGKILL every process of these uids (their daemons, loaders, lock holders)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid in uids:
                    os.kill(int(entry), signal.SIGKILL)
            except OSError:
                continue


def old_timers() -> None:
    """The old epilog's detached `epilog.sh --timer` (root's), when the old scripts are tested."""
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--timer" in cmdline and any(arg.endswith(b"epilog.sh") for arg in cmdline):
            os.kill(int(entry), signal.SIGKILL)


@pytest.fixture
def site(workdir: Path, py: PortablePython, users: tuple[User, User]) -> Iterator[Site]:
    try:
        yield Site(workdir, py)
    finally:
        old_timers()
        uids = {u.uid for u in users}
        kill_everything_of(uids)
        for uid in uids:
            for path in (RUN_ROOT / f"user-{uid}", RUN_ROOT / ".holds" / str(uid), RUN_ROOT / ".keep" / str(uid)):
                subprocess.run(["rm", "-rf", "--one-file-system", str(path)], timeout=60, check=False)


class Jobs:
    """Job ids nobody else uses on this machine."""

    def __init__(self) -> None:
        self.next = 4_100_000_000 + (os.getpid() % 100_000) * 10

    def __call__(self) -> int:
        self.next += 1
        return self.next


@pytest.fixture
def job_ids() -> Jobs:
    return Jobs()


def run_script(script: Path, job_id: int, user: User, config: Path, *args: str,
               timeout: float = 150) -> tuple[float, str]:
    """As slurmd runs it: root, a bare PATH, the job's id, uid and user name. Returns how long
    it took and its log lines; a script still running at ``timeout`` fails the test."""
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": str(job_id), "SLURM_JOB_UID": str(user.uid),
           "SLURM_JOB_USER": user.name, "H5SERVE_SLURM_CONFIG": str(config)}
    started = time.monotonic()
    try:
        done = subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True,
                              timeout=timeout, cwd="/", check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{script.name} for job {job_id} still ran after {timeout}s")
    assert done.returncode == 0, done.stderr
    return time.monotonic() - started, done.stderr


def task_runtime_dir(job_id: int, user: User) -> str | None:
    """What the TaskProlog points the job's tasks at (as the job user), if anything."""
    done = subprocess.run(["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", "--",
                           "bash", str(TASK_PROLOG)], env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": str(job_id)},
                          capture_output=True, text=True, timeout=30, cwd="/", check=False)
    line = done.stdout.strip()
    return line.split("=", 1)[1] if line.startswith("export H5SERVE_RUNTIME_DIR=") else None


def kept_dir(user: User) -> Path:
    return RUN_ROOT / f"user-{user.uid}"


def kept_pid(user: User) -> int | None:
    """The pid of the user's kept daemon, if one runs (its pidfile, and that process of the user's)."""
    try:
        pid = int((kept_dir(user) / "h5serve.pid").read_text())
        return pid if alive(pid) and os.stat(f"/proc/{pid}").st_uid == user.uid else None
    except (OSError, ValueError):
        return None


def kept_idle(site: Site, jobs: Jobs, user: User, keep: int = 600) -> int:
    """One job of ``user`` ran (prolog, epilog): its kept daemon stays, idle. Returns its pid."""
    job, config = jobs(), site.config(keep)
    run_script(PROLOG, job, user, config)
    assert task_runtime_dir(job, user) == str(kept_dir(user)), site.logged()
    pid = kept_pid(user)
    assert pid, site.logged()
    run_script(EPILOG, job, user, config)
    assert kept_pid(user) == pid, f"the kept daemon went with its job\n{site.logged()}"
    return pid


def take_lock(fd: int, patience: float = 5.0) -> bool:
    """An exclusive flock on ``fd``, tried for ``patience`` seconds (root may hold it a moment)."""
    end = time.monotonic() + patience
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            if time.monotonic() > end:
                return False
            time.sleep(0.05)  # the attacker's pace


def says_idle(site: Site, user: User) -> bool:
    """The user's kept daemon reports itself idle, as the prolog asks (2 s unused, no hold)."""
    done = site.py.run("status", "--json", "--runtime-dir", str(kept_dir(user)), user=user, timeout=30)
    idle = json.loads(done.stdout)["idle_exit"] if done.returncode == 0 else None
    return bool(idle) and idle["idle_s"] >= 2 and not idle["holds"]


def in_mount_namespace(prepare: Callable[[], None], body: Callable[[], object], timeout: float = 240) -> None:
    """Run ``prepare`` (mounts) and then ``body`` in a forked child (root) with a private mount
    namespace, which the scripts and daemons it starts inherit; fail with the child's traceback."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            try:
                if ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWNS) != 0:  # os.unshare: Python 3.12
                    raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
                subprocess.run(["mount", "--make-rprivate", "/"], check=True, timeout=30)
                prepare()
                result: object = ("ok", body())
            except BaseException:  # noqa: BLE001 - reported, the parent fails the test
                result = ("error", traceback.format_exc())
            os.write(write, pickle.dumps(result))
        finally:
            os._exit(0)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as f:
            got = f.read()  # the child writes once, then exits; the test's timeout bounds it
        status, detail = pickle.loads(got) if got else ("error", "the child reported nothing")
        assert status == "ok", detail
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)


def shims(**commands: str) -> Callable[[], None]:
    """Commands first on the scripts' PATH (/usr/local/sbin, a tmpfs in the namespace)."""
    def prepare() -> None:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/usr/local/sbin"], check=True, timeout=30)
        for name, script in commands.items():
            path = Path("/usr/local/sbin") / name
            path.write_text(f"#!/bin/sh\n{script}\n")
            path.chmod(0o755)
    return prepare


# --------------------------------------------------------------------------- tests


def test_no_lock_a_user_can_take_stalls_a_prolog_or_epilog(site: Site, job_ids: Jobs,
                                                           users: tuple[User, User]) -> None:
    """User b flocks (exclusively: a read descriptor is enough) every file and directory under
    /run/h5serve it can open; user a's next job still gets its kept daemon, promptly."""
    a, b = users
    kept_idle(site, job_ids, a)
    ready = site.workdir / "locked"

    def hold_every_lock() -> None:
        held = []
        for where, dirs, files in os.walk(RUN_ROOT):
            for name in [*dirs, *files]:
                try:
                    fd = os.open(os.path.join(where, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                except OSError:
                    continue
                if take_lock(fd):
                    held.append(fd)
        os.write(os.open(ready, os.O_WRONLY | os.O_CREAT, 0o644), str(len(held)).encode())
        while True:
            signal.pause()

    ready.parent.chmod(0o777)
    with running_as(b, hold_every_lock):
        assert wait_for(ready.exists, 60)
        job, config = job_ids(), site.config(600)
        took, _ = run_script(PROLOG, job, a, config)
        assert took < PROLOG_BOUND_S, f"the prolog took {took:.0f}s while user b held locks\n{site.logged()}"
        assert task_runtime_dir(job, a) == str(kept_dir(a)) and kept_pid(a), site.logged()
        took, _ = run_script(EPILOG, job, a, config)
        assert took < PROLOG_BOUND_S, f"the epilog took {took:.0f}s while user b held locks"


def test_another_users_job_on_a_node_with_room_never_stops_a_kept_daemon(site: Site, job_ids: Jobs,
                                                                        users: tuple[User, User]) -> None:
    """No --max-memory (the daemon takes 80% of what is free), or one that fits: b's jobs start
    their daemons next to a's idle kept one, which stays."""
    a, b = users
    pid = kept_idle(site, job_ids, a)
    for opts in ("", "--max-memory 16M"):
        job, config = job_ids(), site.config(600, opts)
        run_script(PROLOG, job, b, config)
        assert task_runtime_dir(job, b) == str(kept_dir(b))
        run_script(EPILOG, job, b, config)
        assert kept_pid(a) == pid, f"b's job ({opts or 'no --max-memory'}) stopped a's kept daemon\n{site.logged()}"


def test_missing_bookkeeping_never_makes_a_kept_daemon_idle_forever(site: Site, job_ids: Jobs,
                                                                    users: tuple[User, User]) -> None:
    """Root's files about a's kept daemon (whatever the scripts keep: old idle-since, holds) are
    gone; it is still not taken for a daemon idle since 1970 by the next job of b's."""
    a, b = users
    pid = kept_idle(site, job_ids, a)
    for path in (RUN_ROOT / ".keep" / str(a.uid) / "idle-since", RUN_ROOT / ".holds" / str(a.uid)):
        subprocess.run(["rm", "-rf", "--one-file-system", str(path)], timeout=30, check=True)
    job, config = job_ids(), site.config(600)
    run_script(PROLOG, job, b, config)
    run_script(EPILOG, job, b, config)
    assert kept_pid(a) == pid, f"a's kept daemon was stopped\n{site.logged()}"


def test_a_sigstopped_kept_daemon_never_holds_up_a_prolog(site: Site, job_ids: Jobs,
                                                         users: tuple[User, User]) -> None:
    """a stops its own idle kept daemon (SIGSTOP); b's job needs more room than is free, so the
    prolog looks for idle daemons to stop: a's does not answer, and the prolog does not wait."""
    a, b = users
    pid = kept_idle(site, job_ids, a)
    subprocess.run(["setpriv", f"--reuid={a.uid}", f"--regid={a.gid}", "--clear-groups", "--", "kill", "-STOP",
                    str(pid)], check=True, timeout=30)
    try:
        job, config = job_ids(), site.config(600, "--max-memory 1P")
        took, _ = run_script(PROLOG, job, b, config)
        assert took < PROLOG_BOUND_S, f"b's prolog took {took:.0f}s\n{site.logged()}"
        assert task_runtime_dir(job, b) == str(kept_dir(b)) and kept_pid(b)
        run_script(EPILOG, job, b, config)
    finally:
        os.kill(pid, signal.SIGCONT)


def test_df_failing_stops_no_kept_daemon(site: Site, job_ids: Jobs, users: tuple[User, User]) -> None:
    """`df` fails (a shim): free space unknown is not "nothing free", and b's job stops none of
    a's."""
    a, b = users
    pid = kept_idle(site, job_ids, a)

    def body() -> None:
        job, config = job_ids(), site.config(600, "--max-memory 16M")
        run_script(PROLOG, job, b, config)
        run_script(EPILOG, job, b, config)
        assert kept_pid(a) == pid, f"a's kept daemon was stopped while df failed\n{site.logged()}"

    in_mount_namespace(shims(df="exit 1"), body)


def test_getent_failing_never_orphans_a_kept_daemon(site: Site, job_ids: Jobs, users: tuple[User, User]) -> None:
    """`getent` fails (a shim) all the while: a's kept daemon still goes once unused for
    H5SERVE_KEEP_S, whatever b's jobs do meanwhile; nothing leaves it running for ever."""
    a, b = users
    keep = 3

    def body() -> None:
        pid = kept_idle(site, job_ids, a, keep)
        for _ in range(2):
            job, config = job_ids(), site.config(keep)
            run_script(PROLOG, job, b, config)
            run_script(EPILOG, job, b, config)
        assert wait_for(lambda: not alive(pid), keep + 30), f"a's kept daemon still runs\n{site.logged()}"

    in_mount_namespace(shims(getent="exit 2"), body)


def test_a_full_run_dir_never_gets_a_job_an_unregistered_kept_daemon(site: Site, job_ids: Jobs,
                                                                     users: tuple[User, User]) -> None:
    """/run/h5serve is full (b filled its kept runtime dir with empty files): a's next job
    cannot be registered, so it must not use a's kept daemon, which would then go under it
    (the end of a's earlier job, b's epilog). Whatever the TaskProlog points a job at runs
    until that job's epilog."""
    a, b = users
    keep = 2

    def prepare() -> None:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755,size=16m,nr_inodes=400", "tmpfs", str(RUN_ROOT)],
                       check=True, timeout=30)

    def fill() -> int:
        n = 0
        try:
            while True:
                (kept_dir(b) / f"fill-{n}").touch()
                n += 1
        except OSError:
            return n

    def body() -> None:
        first, config = job_ids(), site.config(keep)
        run_script(PROLOG, first, a, config)
        b_job = job_ids()
        run_script(PROLOG, b_job, b, config)
        status, filled = as_user(b, fill)
        assert status == "ok" and filled, filled
        victim = job_ids()
        run_script(PROLOG, victim, a, config)
        pointed = task_runtime_dir(victim, a)
        run_script(EPILOG, first, a, config)  # a's earlier job ends
        subprocess.run(["find", str(kept_dir(b)), "-name", "fill-*", "-delete"], check=True, timeout=60)
        run_script(EPILOG, b_job, b, config)
        if pointed is not None:  # the victim's tasks use this daemon: it must still run
            deadline = time.monotonic() + keep + 3
            while time.monotonic() < deadline:
                assert (Path(pointed) / "h5serve.sock").exists(), f"{pointed} went under job {victim}\n{site.logged()}"
                time.sleep(0.2)  # a daemon under a running job must stay: watched for a while
        run_script(EPILOG, victim, a, config)
        kill_everything_of({a.uid, b.uid})  # in this namespace's /run: gone with it

    in_mount_namespace(prepare, body)


def test_room_is_taken_from_idle_daemons_least_recently_used_first_and_logged(
        site: Site, job_ids: Jobs, users: tuple[User, User]) -> None:
    """A job of c needs more than is free: the idle kept daemons of a and d are stopped, a's
    (used longest ago) first, each with everything it started (its process group), each logged
    with what was needed and free. b's, held by a running job, is never stopped."""
    a, b = users
    with throwaway_user() as c, throwaway_user() as d:
        try:
            pid_a = kept_idle(site, job_ids, a)
            assert wait_for(lambda: says_idle(site, a), 30)  # a's last use clearly before d's
            pid_d = kept_idle(site, job_ids, d)
            pid_b = kept_idle(site, job_ids, b)
            held = job_ids()  # b's next job runs: its kept daemon is held
            run_script(PROLOG, held, b, site.config(600))
            group_a = [int(p) for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == pid_a]
            assert wait_for(lambda: says_idle(site, a) and says_idle(site, d), 30)
            job, config = job_ids(), site.config(600, "--max-memory 1P")
            run_script(PROLOG, job, c, config)
            logged = site.logged()
            assert not alive(pid_a) and not alive(pid_d), logged
            assert not any(alive(p) and _pgid(p) == pid_a for p in group_a), "a's daemon's group survived"
            stop_a = logged.find(f"stopping the idle kept daemon of uid {a.uid} ")
            stop_d = logged.find(f"stopping the idle kept daemon of uid {d.uid} ")
            assert 0 <= stop_a < stop_d and "needed" in logged[stop_a:stop_d], logged
            assert kept_pid(b) == pid_b, f"b's daemon, held by a running job, was stopped\n{logged}"
            assert task_runtime_dir(held, b) == str(kept_dir(b))
            run_script(EPILOG, job, c, config)
            run_script(EPILOG, held, b, config)
        finally:
            kill_everything_of({c.uid, d.uid})
            for u in (c, d):
                subprocess.run(["rm", "-rf", "--one-file-system", str(kept_dir(u)),
                                str(RUN_ROOT / ".holds" / str(u.uid))], timeout=60, check=False)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


LOCKS = min(12000, resource.getrlimit(resource.RLIMIT_NOFILE)[1] - 100)


def test_thousands_of_locks_held_by_a_user_never_slow_a_stop(site: Site, job_ids: Jobs,
                                                             users: tuple[User, User]) -> None:
    """b holds 12000 flocks (one line each in /proc/locks, which root reads to verify the daemon
    it signals): b's job that needs room still gets it, a's idle daemon stopped, promptly."""
    a, b = users
    pid = kept_idle(site, job_ids, a)
    ready, target = site.workdir / "locked", site.workdir / "many"
    target.touch()
    target.chmod(0o644)
    ready.parent.chmod(0o777)

    def hold_many_locks() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, LOCKS + 100), hard))
        fds = [os.open(target, os.O_RDONLY) for _ in range(LOCKS)]
        for fd in fds:
            fcntl.flock(fd, fcntl.LOCK_SH)  # shared: each open file description is a line of its own
        os.close(os.open(ready, os.O_WRONLY | os.O_CREAT, 0o644))
        while True:
            signal.pause()

    with running_as(b, hold_many_locks):
        assert wait_for(ready.exists, 60) and wait_for(lambda: says_idle(site, a), 30)
        with open("/proc/locks") as f:
            assert sum(1 for _ in f) >= LOCKS
        job, config = job_ids(), site.config(600, "--max-memory 1P")
        took, _ = run_script(PROLOG, job, b, config, timeout=200)
        assert not alive(pid), f"a's idle kept daemon was not stopped to make room\n{site.logged()}"
        assert took < PROLOG_BOUND_S, f"b's prolog took {took:.0f}s\n{site.logged()}"
        run_script(EPILOG, job, b, config)
