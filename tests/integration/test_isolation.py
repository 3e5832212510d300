"""A shared daemon gives each of its users only what that user was allowed (issue 21: "--group
members read each other's data", "leases are flocks anyone who can open a segment can take").

Segments are owner-only; a member maps a segment only from a descriptor the daemon hands out
(h5serve.fds) after an acquire of its own passed the access check. Every test acts as real
throwaway users (tests/users.py) against a real daemon: a root daemon with ``--group`` and a
service account's with ``--user svc --group G`` (run by ``portable_python``).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import h5py
import pytest

from h5serve.cli.status import verify_segments
from h5serve.client import SharedH5Dataset
from h5serve.errors import AccessDenied, SegmentError
from h5serve.segments import request_descriptor
from h5serve.wire.connection import DaemonClient
from h5serve.wire.protocol import Acquire
from h5serve.wire.runtime import HANDOUT_SOCKET_NAME

from ..helpers import Daemon, kill_daemon_of, make_h5, wait_for
from ..users import (
    REPO,
    PortablePython,
    as_user,
    public_interpreter,
    root_only,
    run_as,
    throwaway_group,
    throwaway_user,
)

pytestmark = [root_only, pytest.mark.timeout(240)]


def _rows(path: Path, key: str = "x") -> bytes:
    with h5py.File(path) as f:
        return f[key][:].tobytes()


def _load(path: Path, runtime_dir: Path, daemon_user: str | None = None) -> tuple[str, bytes, list[str]]:
    """As the calling user: map ``path`` through the daemon; (backend, rows, segment names)."""
    ds = SharedH5Dataset(path, "x", runtime_dir=runtime_dir, daemon_user=daemon_user, fallback="error")
    rows = ds.__getitems__(list(range(len(ds)))).x.numpy().tobytes()
    names = [s.name for s in ds._backend.segments]
    return ds.backend, rows, names


def _probe_refused(path: Path, segment: str, runtime_dir: Path, daemon_uid: int,
                   daemon_user: str | None = None) -> dict[str, str]:
    """As the calling user: every way to the rows of ``segment`` (of ``path``, which this user
    may not read)."""
    out: dict[str, str] = {}
    try:
        os.close(os.open(Path("/dev/shm") / segment, os.O_RDONLY | os.O_NONBLOCK))
        out["open"] = "opened"
    except PermissionError:
        out["open"] = "denied"
    try:
        os.close(request_descriptor(runtime_dir / HANDOUT_SOCKET_NAME, segment, daemon_uid))
        out["handout"] = "handed out"
    except (AccessDenied, SegmentError) as exc:
        out["handout"] = f"{type(exc).__name__}: {exc}"
    with DaemonClient(runtime_dir, timeout=10, daemon_user=daemon_user) as client:
        out["status"] = json.dumps([s["name"] for s in client.status()["segments"]])
    try:
        SharedH5Dataset(path, "x", runtime_dir=runtime_dir, daemon_user=daemon_user, fallback="error")
        out["dataset"] = "served"
    except AccessDenied as exc:
        out["dataset"] = f"AccessDenied: {exc}"
    return out


def _connect_handout(runtime_dir: Path) -> str:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        try:
            sock.connect(str(runtime_dir / HANDOUT_SOCKET_NAME))
        except OSError as exc:
            return f"{type(exc).__name__}: {exc.strerror}"
    return "connected"


def test_root_group_daemon_gives_each_member_only_what_it_was_allowed(public_dir: Path) -> None:
    """Alice loads her own 0600 file; Bob, in the same group, can neither open the segment's
    name, nor get its descriptor, nor see it in status, nor have it served; a non-member
    cannot reach the descriptor socket at all. What Bob may read he maps, zero-copy."""
    data = public_dir / "data.h5"
    with throwaway_group() as group, throwaway_user((group,)) as alice, throwaway_user((group,)) as bob, \
            throwaway_user() as outsider:
        private = make_h5(public_dir / "alice.h5", rows=500)
        os.chown(private, alice.uid, alice.gid)
        private.chmod(0o600)
        d = Daemon("--group", group.name)
        d.dir.chmod(0o755)
        try:
            d.start()
            runtime_dir = d.runtime_dir
            assert (runtime_dir / HANDOUT_SOCKET_NAME).stat().st_mode & 0o777 == 0o660
            status, out = as_user(alice, lambda: _load(private, runtime_dir))
            assert status == "ok", out
            backend, rows, (segment,) = out
            assert (backend, rows) == ("shm", _rows(private))
            assert (Path("/dev/shm") / segment).stat().st_mode & 0o777 == 0o400

            status, probe = as_user(bob, lambda: _probe_refused(private, segment, runtime_dir, 0))
            assert status == "ok", probe
            assert probe["open"] == "denied", probe
            assert probe["handout"].startswith("AccessDenied") and f"uid {bob.uid} was not granted" in probe["handout"]
            assert segment not in json.loads(probe["status"])
            assert probe["dataset"].startswith("AccessDenied") and f"uid {bob.uid} may not read" in probe["dataset"]

            status, out = as_user(bob, lambda: _load(data, runtime_dir))  # allowed: from a descriptor
            assert status == "ok", out
            assert out[:2] == ("shm", _rows(data))
            status, names = as_user(bob, lambda: [s["name"] for s in DaemonClient(runtime_dir).status()["segments"]])
            assert (status, names) == ("ok", out[2])  # his own segment, not Alice's

            def verify() -> dict:
                client = DaemonClient(runtime_dir)
                client.ping()  # resolves and checks the daemon's owner
                return verify_segments(client.status(), runtime_dir, client.daemon_uid)

            status, report = as_user(bob, verify)  # `status --verify` re-reads his segments through descriptors
            assert status == "ok", report
            assert (report["checked"], report["damaged"]) == (len(out[2]), []), report
            assert {s["name"] for s in d.status()["segments"]} == {segment, *out[2]}  # root sees all

            status, out = as_user(outsider, lambda: _connect_handout(runtime_dir))
            assert (status, out) == ("ok", "PermissionError: Permission denied"), out
        finally:
            d.stop()
        assert not (runtime_dir / HANDOUT_SOCKET_NAME).exists()


def test_service_account_daemon_serves_members_zero_copy_in_spawned_workers(py: PortablePython,
                                                                             public_dir: Path) -> None:
    """``--user svc --group G``: a member allowed a file maps it from descriptors in its main
    process and in DataLoader workers started with spawn (they ask again); a member refused
    it (a 0640 file of a group it is not in) never gets its rows, even once loaded for another."""
    data = public_dir / "data.h5"
    with throwaway_group() as group, throwaway_group() as team, throwaway_user() as svc, \
            throwaway_user((group, team)) as member, throwaway_user((group,)) as other, \
            public_interpreter() as interpreter:
        for g in (group, team):
            subprocess.run(["usermod", "-aG", g.name, svc.name], check=True, timeout=60)
        shared = make_h5(public_dir / "team.h5", rows=300)
        os.chown(shared, 0, team.gid)
        shared.chmod(0o640)
        runtime_dir = public_dir / "rt"
        try:
            done = py.run("start", "--user", svc.name, "--group", group.name, "--runtime-dir", str(runtime_dir))
            assert done.returncode == 0, done.stderr
            job = run_as(member, [interpreter.python, str(REPO / "tests" / "jobs" / "isolation_job.py"), str(data),
                                  str(runtime_dir), svc.name], env=interpreter.env, timeout=180)
            assert job.returncode == 0, job.stderr[-3000:]
            report = json.loads(job.stdout.strip().splitlines()[-1])
            assert report["main"] == "shm" and report["workers"] == ["shm"], report
            assert not report["warnings"], report["warnings"]
            with h5py.File(data) as f:
                assert report["rows"] == [f["x"][i].ravel().tolist() for i in (0, 1, 998, 999)]

            status, out = as_user(member, lambda: _load(shared, runtime_dir, svc.name))
            assert status == "ok", out
            assert out[:2] == ("shm", _rows(shared))
            (segment,) = out[2]
            status, probe = as_user(other, lambda: _probe_refused(shared, segment, runtime_dir, svc.uid, svc.name))
            assert status == "ok", probe
            assert probe["open"] == "denied" and probe["handout"].startswith("AccessDenied"), probe
            assert segment not in json.loads(probe["status"])
            assert probe["dataset"].startswith("AccessDenied") and "no read permission" in probe["dataset"], probe
        finally:
            kill_daemon_of(runtime_dir)


def _hold_exclusively(runtime_dir: Path, path: Path, held: Path, release: Path) -> str:
    """As a hostile member: acquire ``path`` (granted), get its descriptor, hold LOCK_EX on it
    until ``release`` exists."""
    with DaemonClient(runtime_dir, timeout=10) as client:
        result = client.acquire(Acquire(str(path), "x", 1, 0))
    fd = request_descriptor(runtime_dir / HANDOUT_SOCKET_NAME, result.name, 0)
    fcntl.flock(fd, fcntl.LOCK_EX)
    held.write_text(result.name)
    wait_for(release.exists, 120)
    os.close(fd)
    return "released"


def test_a_member_holding_a_segment_exclusively_never_delays_another(public_dir: Path) -> None:
    """An exclusive flock by a hostile member on a segment it was granted: the victim still
    maps it from shm within a second (no lease; it used to wait 5 s, then read lazily)."""
    data = public_dir / "data.h5"
    held, release = public_dir / "held", public_dir / "release"
    with throwaway_group() as group, throwaway_user((group,)) as attacker, throwaway_user((group,)) as victim:
        d = Daemon("--group", group.name)
        d.dir.chmod(0o755)
        public_dir.chmod(0o777)  # the attacker signals through files here
        runtime_dir = d.runtime_dir
        outcome: list[tuple[str, object]] = []
        thread = threading.Thread(target=lambda: outcome.append(
            as_user(attacker, lambda: _hold_exclusively(runtime_dir, data, held, release), timeout=150)))
        try:
            d.start()
            thread.start()
            assert wait_for(held.exists, 60), outcome

            def attach() -> tuple[str, float, bool, bytes]:
                started = time.monotonic()
                ds = SharedH5Dataset(data, "x", runtime_dir=runtime_dir, fallback="error")
                seconds = time.monotonic() - started
                rows = ds.__getitems__([0, 999]).x.numpy().tobytes()
                return ds.backend, seconds, ds._backend.segments[0].leased, rows

            status, out = as_user(victim, attach)
            assert status == "ok", out
            backend, seconds, leased, rows = out
            with h5py.File(data) as f:
                assert (backend, leased, rows) == ("shm", False, f["x"][[0, 999]].tobytes())
            assert seconds < 1.0, seconds
        finally:
            release.touch()
            thread.join(150)
            d.stop()
        assert outcome == [("ok", "released")], outcome
