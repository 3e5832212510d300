"""Trust on a shared node, with real other users (issue: security, parts 1, 2 and 5).

1. Root never acts on a path an unprivileged user controls (``start --user``).
2. A client talks only to a daemon of its own user, root, or the one it was told to trust.
5. A daemon never serves a file the requester could not read itself, and resolves each
   path once, checking what it opened.

Every test here creates throwaway users (tests/users.py) and needs root; elsewhere they skip.
Daemons that run as those users use ``portable_python``: the suite's own interpreter lives
where other users cannot read it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
import warnings
from pathlib import Path

import h5py
import pytest

from h5serve.client import SharedH5Dataset
from h5serve.errors import AccessDenied, DaemonUnavailable, SourceChanged, SourceNotFound
from h5serve.wire.connection import DaemonClient
from h5serve.wire.protocol import Acquire

from ..helpers import Daemon, kill_daemon_of, make_h5, wait_for
from ..users import PortablePython, User, as_user, root_only, run_as, throwaway_group, throwaway_user

pytestmark = [root_only, pytest.mark.timeout(240)]


def _uids(pid: int) -> list[int]:
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("Uid:"))
    return [int(n) for n in line.split()[1:]]


# --------------------------------------------------------------------------- 1. root and user paths


def test_start_user_never_follows_a_log_symlink_planted_by_the_user(py: PortablePython, public_dir: Path) -> None:
    """The prolog attack: the job user plants <runtime dir>/h5serve.log -> a root-only file;
    `h5serve start --user` (as root) must neither write to it nor hand it to the user."""
    victim = public_dir / "root-only.txt"
    victim.write_text("root's\n")
    victim.chmod(0o600)
    with throwaway_user() as user:
        runtime_dir = public_dir / "rt"
        runtime_dir.mkdir(mode=0o700)
        os.chown(runtime_dir, user.uid, user.gid)
        done = run_as(user, ["ln", "-s", str(victim), str(runtime_dir / "h5serve.log")])
        assert done.returncode == 0, done.stderr
        try:
            started = py.run("start", "--user", user.name, "--runtime-dir", str(runtime_dir))
            assert started.returncode == 1 and "symbolic link" in started.stderr, started.stderr
            st = victim.stat()
            assert (st.st_uid, st.st_mode & 0o777, victim.read_text()) == (0, 0o600, "root's\n")
        finally:
            kill_daemon_of(runtime_dir)


def test_start_user_refuses_a_symlinked_runtime_dir(py: PortablePython, public_dir: Path) -> None:
    """/tmp/h5serve-$UID (or any runtime dir) planted as a symlink to a root-owned directory:
    refused, and the directory it points to keeps its owner and mode."""
    target = public_dir / "roots-dir"
    target.mkdir(mode=0o755)
    with throwaway_user() as user:
        link = public_dir / "rt"
        link.symlink_to(target)
        os.lchown(link, user.uid, user.gid)
        started = py.run("start", "--user", user.name, "--runtime-dir", str(link))
        assert started.returncode == 1 and "symbolic link" in started.stderr, started.stderr
        st = target.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (0, 0o755) and not list(target.iterdir())


def test_start_user_refuses_a_runtime_dir_of_someone_else(py: PortablePython, public_dir: Path) -> None:
    with throwaway_user() as user, throwaway_user() as other:
        runtime_dir = public_dir / "rt"
        runtime_dir.mkdir(mode=0o700)
        os.chown(runtime_dir, other.uid, other.gid)
        started = py.run("start", "--user", user.name, "--runtime-dir", str(runtime_dir))
        assert started.returncode == 1 and f"belongs to uid {other.uid}" in started.stderr, started.stderr
        assert runtime_dir.stat().st_uid == other.uid


def test_start_user_serves_as_the_user_end_to_end(py: PortablePython, public_dir: Path) -> None:
    """The prolog path for real: root starts, the daemon and everything it made are the
    user's, and that user's training process maps the segments."""
    with throwaway_user() as user:
        runtime_dir = public_dir / "rt"  # created by root for the user (its parent is root's)
        try:
            started = py.run("start", "--user", user.name, "--runtime-dir", str(runtime_dir))
            assert started.returncode == 0, started.stderr
            pid = int((runtime_dir / "h5serve.pid").read_text())
            assert _uids(pid) == [user.uid] * 4
            for path in (runtime_dir, *(runtime_dir / n for n in ("h5serve.sock", "h5serve.pid", "h5serve.log"))):
                assert path.lstat().st_uid == user.uid, path

            def read() -> tuple[str, bytes, list[int]]:
                ds = SharedH5Dataset(public_dir / "data.h5", "x", runtime_dir=runtime_dir, fallback="error")
                owners = [os.stat(s.path).st_uid for s in ds._backend.segments]
                return ds.backend, ds.__getitems__(list(range(len(ds)))).x.numpy().tobytes(), owners

            status, out = as_user(user, read)
            assert status == "ok", out
            with h5py.File(public_dir / "data.h5") as f:
                assert out == ("shm", f["x"][:].tobytes(), [user.uid])
            stopped = py.run("stop", "--runtime-dir", str(runtime_dir), user=user)
            assert stopped.returncode == 0, stopped.stderr
        finally:
            kill_daemon_of(runtime_dir)


# --------------------------------------------------------------------------- 2. clients trust


def _hostile_daemon(py: PortablePython, attacker: User, runtime_dir: Path) -> None:
    """The attacker runs a real daemon at the victim's default runtime dir, with a socket
    anyone may connect to (it could serve any bytes it likes)."""
    done = py.run("start", "--runtime-dir", str(runtime_dir), user=attacker)
    assert done.returncode == 0, done.stderr
    run_as(attacker, ["chmod", "0755", str(runtime_dir)])
    run_as(attacker, ["chmod", "0666", str(runtime_dir / "h5serve.sock")])


def test_client_ignores_another_users_daemon_at_its_default_runtime_dir(py: PortablePython, public_dir: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("H5SERVE_RUNTIME_DIR", "XDG_RUNTIME_DIR", "H5SERVE_DAEMON_USER"):
        monkeypatch.delenv(name, raising=False)
    data = public_dir / "data.h5"
    with throwaway_user() as victim, throwaway_user() as attacker:
        squatted = Path(f"/tmp/h5serve-{victim.uid}")
        try:
            _hostile_daemon(py, attacker, squatted)

            def train() -> dict[str, object]:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    ds = SharedH5Dataset(data, "x")
                out: dict[str, object] = {"backend": ds.backend, "rows": ds.__getitems__([0, 1]).x.numpy().tobytes(),
                                          "warnings": [str(w.message) for w in caught]}
                try:
                    SharedH5Dataset(data, "x", fallback="error")
                except DaemonUnavailable as exc:
                    out["error"] = f"{type(exc).__name__}: {exc}"
                return out

            status, out = as_user(victim, train)
            assert status == "ok", out
            with h5py.File(data) as f:
                assert out["backend"] == "lazy" and out["rows"] == f["x"][:2].tobytes()
            assert len(out["warnings"]) == 1 and str(squatted) in out["warnings"][0], out["warnings"]
            assert f"uid {attacker.uid}" in out["warnings"][0]
            assert str(out["error"]).startswith("UntrustedDaemon")
            # the victim's status and stop refuse it too, and never signal the attacker's pid
            status_done = py.run("status", user=victim)
            assert status_done.returncode == 3 and "belongs to uid" in status_done.stdout + status_done.stderr
            pid = int((squatted / "h5serve.pid").read_text())
            stop_done = py.run("stop", user=victim)
            assert stop_done.returncode == 1 and "belongs to uid" in stop_done.stderr
            assert _uids(pid)[0] == attacker.uid  # still running
        finally:
            kill_daemon_of(squatted)
            shutil.rmtree(squatted, ignore_errors=True)


def test_shared_daemon_is_trusted_only_when_configured(py: PortablePython, public_dir: Path) -> None:
    """A service account's daemon with --group: members map its segments when they name it
    (H5SERVE_DAEMON_USER or daemon_user=), and read lazily, warned, when they do not."""
    data = public_dir / "data.h5"
    with throwaway_group() as group, throwaway_user() as service, throwaway_user((group,)) as member:
        subprocess.run(["usermod", "-aG", group.name, service.name], check=True, timeout=60)
        runtime_dir = public_dir / "rt"
        try:
            done = py.run("start", "--user", service.name, "--group", group.name,
                                          "--runtime-dir", str(runtime_dir))
            assert done.returncode == 0, done.stderr

            def read(daemon_user: str | None) -> tuple[str, list[str]]:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    ds = SharedH5Dataset(data, "x", runtime_dir=runtime_dir, daemon_user=daemon_user)
                return ds.backend, [str(w.message) for w in caught]

            status, out = as_user(member, lambda: read(service.name))
            assert status == "ok" and out == ("shm", []), out
            status, out = as_user(member, lambda: read(None))
            assert status == "ok" and out[0] == "lazy" and "H5SERVE_DAEMON_USER" in out[1][0], out
        finally:
            kill_daemon_of(runtime_dir)


def test_stop_signals_only_the_daemon_never_the_pid_in_the_pidfile(daemon: Daemon, h5file: Path) -> None:
    """A daemon that does not answer (stopped) with a pidfile naming another process of the
    same user: `stop` signals the process holding the pidfile lock, not the named one."""
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        os.kill(daemon.pid, signal.SIGSTOP)
        (daemon.runtime_dir / "h5serve.pid").write_text(f"{bystander.pid}\n")
        stopper = subprocess.Popen([*h5serve_cli_argv(), "stop"], env=daemon.env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            # stop's shutdown request times out (the daemon is stopped), then stop signals it:
            # the SIGTERM waits, pending, until the daemon runs again
            assert wait_for(lambda: signal_pending(daemon.pid, signal.SIGTERM), 30), "stop never signalled the daemon"
            os.kill(daemon.pid, signal.SIGCONT)
            out, err = stopper.communicate(timeout=60)
        finally:
            stopper.kill()
        assert stopper.returncode == 0, err
        assert bystander.poll() is None  # untouched
        assert wait_for(lambda: not daemon.alive(), 10)
    finally:
        bystander.kill()
        bystander.wait()


def signal_pending(pid: int, sig: int) -> bool:
    """Whether ``sig`` was sent to the process ``pid`` and waits, undelivered (it is stopped)."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    pending = int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)
    return bool(pending >> (sig - 1) & 1)


def h5serve_cli_argv() -> list[str]:
    import sys

    return [sys.executable, "-m", "h5serve"]


# --------------------------------------------------------------------------- 5. confused deputy


def test_group_daemon_never_serves_a_file_the_member_cannot_read(public_dir: Path) -> None:
    """A root daemon with --group: a member asking for a root-only file is refused before
    anything is loaded; a file the member can read is served."""
    secret = make_h5(public_dir / "secret.h5")
    secret.chmod(0o600)
    with throwaway_group() as group, throwaway_user((group,)) as member:
        d = Daemon("--group", group.name)
        d.dir.chmod(0o755)
        try:
            d.start()
            runtime_dir = d.runtime_dir

            def ask(path: Path, fallback: str) -> str:
                with warnings.catch_warnings(record=True):
                    warnings.simplefilter("always")
                    return SharedH5Dataset(path, "x", runtime_dir=runtime_dir, fallback=fallback).backend

            status, out = as_user(member, lambda: ask(secret, "error"))
            assert status == "error" and out.startswith("AccessDenied") and f"uid {member.uid} may not read" in out
            status, out = as_user(member, lambda: ask(secret, "lazy"))  # lazily, as the member: no right either
            assert status == "error" and "SourceNotFound" in out and "Permission denied" in out, out
            assert not [s for s in d.status()["segments"] if s["file"] == str(secret)]
            assert d.status()["counters"]["refusals"] >= 1
            status, out = as_user(member, lambda: ask(public_dir / "data.h5", "error"))
            assert (status, out) == ("ok", "shm")
        finally:
            d.stop()


def test_service_account_daemon_checks_modes_for_other_users(py: PortablePython, public_dir: Path) -> None:
    """A non-root daemon cannot take the member's identity: it checks mode bits on the real
    path and refuses a file readable by the daemon's user but not by the member."""
    with throwaway_group() as group, throwaway_user() as service, throwaway_user((group,)) as member:
        subprocess.run(["usermod", "-aG", group.name, service.name], check=True, timeout=60)
        private = make_h5(public_dir / "service-only.h5")
        os.chown(private, service.uid, service.gid)
        private.chmod(0o600)
        runtime_dir = public_dir / "rt"
        try:
            done = py.run("start", "--user", service.name, "--group", group.name,
                                          "--runtime-dir", str(runtime_dir))
            assert done.returncode == 0, done.stderr

            def ask(path: Path) -> str:
                return SharedH5Dataset(path, "x", runtime_dir=runtime_dir, daemon_user=service.name,
                                       fallback="error").backend

            status, out = as_user(member, lambda: ask(private))
            assert status == "error" and out.startswith("AccessDenied") and "no read permission" in out, out
            status, out = as_user(member, lambda: ask(public_dir / "data.h5"))
            assert (status, out) == ("ok", "shm")
        finally:
            kill_daemon_of(runtime_dir)


def test_allow_root_checks_the_file_it_opened_while_a_symlink_flips(public_dir: Path) -> None:
    """A symlink flipped between a file inside --allow-root and one outside, as fast as a
    process can: every load is of the inside file, never the outside one."""
    inside, outside = public_dir / "inside", public_dir / "outside"
    inside.mkdir()
    outside.mkdir()
    good = make_h5(inside / "good.h5")
    secret = make_h5(outside / "secret.h5", rows=999)
    flip = inside / "flip.h5"
    flip.symlink_to(good)
    stop = threading.Event()

    def flipper() -> None:
        tmp = inside / "flip.tmp"
        while not stop.is_set():
            for target in (secret, good):
                tmp.unlink(missing_ok=True)
                tmp.symlink_to(target)
                os.replace(tmp, flip)

    d = Daemon("--allow-root", str(inside))
    thread = threading.Thread(target=flipper, daemon=True)
    try:
        d.start()
        thread.start()
        outcomes = {"served": 0, "refused": 0}
        with DaemonClient(d.runtime_dir, timeout=5) as client:
            for _ in range(150):
                try:
                    result = client.acquire(Acquire(str(flip), "x", 1, 0, "contiguous", None))
                    assert result.rows_total == 1000  # good.h5's rows, never secret's 999
                    outcomes["served"] += 1
                except (AccessDenied, SourceChanged):  # refused, or seen replaced mid-check: asked again
                    outcomes["refused"] += 1
        stop.set()
        thread.join(10)
        files = {s["file"] for s in d.status()["segments"]}
        assert files <= {str(good)} and str(secret) not in files
        assert outcomes["served"] and outcomes["refused"], outcomes  # both sides of the flip were seen
    finally:
        stop.set()
        d.stop()


def test_a_fifo_at_the_path_never_blocks_the_daemon(public_dir: Path) -> None:
    fifo = public_dir / "fifo.h5"
    os.mkfifo(fifo)
    d = Daemon()
    try:
        d.start()
        with DaemonClient(d.runtime_dir, timeout=5) as client:
            started = time.monotonic()
            with pytest.raises(SourceNotFound, match="not a regular file"):
                client.acquire(Acquire(str(fifo), "x", 1, 0, "contiguous", None))
            assert client.ping()["pid"] == d.pid
            assert time.monotonic() - started < 5
    finally:
        d.stop()
