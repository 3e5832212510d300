"""What a member of a shared daemon's group, or any local user, must not be able to do to the
others (issue 21, second security round: shutdown, load starvation, planted names, forged log
lines). Every test acts as real throwaway users (tests/users.py) against a real daemon; they
need root and skip elsewhere.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.client import SharedH5Dataset, collate
from h5serve.daemon.config import MAX_QUEUED_LOADS_PER_UID
from h5serve.errors import AccessDenied, CapacityError, H5ServeError
from h5serve.segments import is_published_as, segment_prefix
from h5serve.wire.connection import DaemonClient
from h5serve.wire.protocol import Acquire, AcquireResult
from h5serve.wire.runtime import resolve_runtime, signal_daemon

from ..helpers import Daemon, make_h5, vlen_file, wait_for, watch_memory
from ..users import (
    Group,
    PortablePython,
    User,
    as_user,
    root_only,
    run_as,
    setpriv,
    throwaway_group,
    throwaway_user,
)

pytestmark = [root_only, pytest.mark.timeout(300)]

SHM = Path("/dev/shm")


@pytest.fixture
def group_daemon_users() -> Iterator[tuple[Group, User, User]]:
    """A group and two of its members (the victim, the attacker)."""
    with throwaway_group() as group, throwaway_user((group,)) as victim, throwaway_user((group,)) as attacker:
        yield group, victim, attacker


def _group_daemon(group: Group, *extra: str) -> Daemon:
    d = Daemon("--group", group.name, *extra)
    d.dir.chmod(0o755)  # members reach the runtime dir under it
    return d


def _log(d: Daemon) -> str:
    return (d.runtime_dir / "h5serve.log").read_text(errors="replace")


# --------------------------------------------------------------------------- shutdown


def test_a_member_can_neither_shut_down_nor_signal_the_daemon(
        group_daemon_users: tuple[Group, User, User], public_dir: Path, py: PortablePython) -> None:
    """A --group member's shutdown request is refused (AccessDenied) and logged with its uid
    and pid; `h5serve stop` as the member fails and its signal path cannot reach the daemon
    either; the daemon keeps serving the victim; root's stop is accepted and logged."""
    group, victim, attacker = group_daemon_users
    d = _group_daemon(group)
    try:
        d.start()
        runtime_dir = d.runtime_dir

        def shut_down() -> tuple[str, int]:
            with DaemonClient(runtime_dir, timeout=5) as client:
                try:
                    client.shutdown()
                    return "stopped", 0
                except AccessDenied as exc:
                    assert "only uid 0" in str(exc), exc
                    return "refused", os.getpid()

        status, out = as_user(attacker, shut_down)
        assert status == "ok" and out[0] == "refused", out
        assert d.alive()
        assert re.search(rf"shutdown requested by uid {attacker.uid} \(pid {out[1]}\): refused", _log(d)), _log(d)

        def signal_it() -> str:
            location = resolve_runtime(runtime_dir)
            try:
                return f"signalled {signal_daemon(location, 0, signal.SIGTERM)}"
            except H5ServeError as exc:
                return f"{type(exc).__name__}: {exc}"

        status, out = as_user(attacker, signal_it)  # root's daemon: the kernel refuses the member's signal
        assert status == "ok" and (out.startswith("NoPermission") or out == "signalled 0"), out
        stopped = py.run("stop", "--runtime-dir", str(runtime_dir), user=attacker, timeout=90)
        assert stopped.returncode != 0 and "may stop this daemon" in stopped.stderr, stopped
        assert d.alive()

        def read() -> str:
            return SharedH5Dataset(public_dir / "data.h5", "x", runtime_dir=runtime_dir, fallback="error").backend

        assert as_user(victim, read) == ("ok", "shm")
        done = d.cli("stop")
        assert done.returncode == 0, done.stderr
        assert wait_for(lambda: not d.alive(), 30)
        log = _log(d)
        assert re.search(r"shutdown requested by uid 0 \(pid \d+\): stopping", log), log
    finally:
        d.stop()


# --------------------------------------------------------------------------- starvation


def _slow_file(path: Path, rows: int) -> Path:
    """A gzip dataset (compressed chunk by chunk: every rank's share costs decompression)."""
    data = (np.arange(rows * 256, dtype=np.int64).reshape(rows, 256) % 251).astype(np.uint8)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data, chunks=(16, 256), compression="gzip", compression_opts=1)
    path.chmod(0o644)
    return path


def test_a_member_queuing_hundreds_of_loads_never_starves_another(
        group_daemon_users: tuple[Group, User, User], public_dir: Path) -> None:
    """The attacker queues as many loads as it may (fresh segments: every rank of a 400-way
    split, each key spelled with extra slashes too) with one loader slot; the victim's load
    starts after at most one of the attacker's and is ready within seconds, while hundreds of
    the attacker's still wait. Past MAX_QUEUED_LOADS_PER_UID the attacker is refused."""
    group, victim, attacker = group_daemon_users
    world = 400
    slow = _slow_file(public_dir / "slow.h5", world * 64)
    d = _group_daemon(group, "--loaders", "1", "--load-processes", "1")
    try:
        d.start()
        runtime_dir = d.runtime_dir

        def flood() -> dict[str, object]:
            queued: set[str] = set()
            refused: list[str] = []
            spellings: set[str] = set()
            with DaemonClient(runtime_dir, timeout=10) as client:
                for rank in range(world):
                    for key in ("x", "//x", "/x/") if rank < 3 else ("x",):
                        deadline = time.monotonic() + 30
                        while True:  # "loading" with no name: the file is still being resolved
                            try:
                                result = AcquireResult.from_wire(client.request(Acquire(str(slow), key, world, rank)))
                            except CapacityError as exc:
                                refused.append(str(exc))
                                break
                            if result.name or time.monotonic() > deadline:
                                queued.add(result.name)
                                if rank < 3:
                                    spellings.add(f"{rank}:{result.name}")
                                break
                            time.sleep(0.01)
            return {"queued": len(queued), "refused": refused, "spellings": len(spellings)}

        status, out = as_user(attacker, flood, timeout=240)
        assert status == "ok", out
        assert out["spellings"] == 3, out  # "x", "//x" and "/x/" are one segment per rank
        assert out["refused"] and str(MAX_QUEUED_LOADS_PER_UID) in out["refused"][0], out
        assert out["queued"] >= MAX_QUEUED_LOADS_PER_UID, out

        def victim_reads() -> float:
            started = time.monotonic()
            with DaemonClient(runtime_dir, timeout=10) as client:
                client.acquire(Acquire(str(public_dir / "data.h5"), "x", 1, 0), deadline=started + 120)
            return time.monotonic() - started

        status, waited = as_user(victim, victim_reads, timeout=150)
        assert status == "ok", waited
        waiting = sum(1 for s in d.status()["segments"] if s["state"] == "loading")
        print(f"\n[h5serve member abuse] victim served in {waited:.2f}s with {waiting} of the attacker's loads "
              "still waiting")
        assert waiting >= 100, waiting  # the queue was real
        assert waited < 5, f"the victim waited {waited:.1f}s behind the attacker's queue"
    finally:
        d.stop()


# --------------------------------------------------------------------------- the budget


def _digests(path: Path, key: str, rows: list[int]) -> list[str]:
    with h5py.File(path) as f:
        return [hashlib.sha256(f[key][r].astype(np.float32).tobytes()).hexdigest() for r in rows]


def test_a_members_rows_longer_than_the_estimate_never_take_more_than_the_budget(
        group_daemon_users: tuple[Group, User, User], public_dir: Path) -> None:
    """Finding 3, acted by a member of a root daemon's --group: a file whose first 1,024 rows
    (all the daemon's estimate reads) are empty and whose last 76 hold 48 MiB of values, under
    a 4 MiB budget (the daemon loaded all of it: 52 MiB counted). Its load is stopped at the
    room the budget gave it (BudgetExceeded naming the key and the budget, its temporary
    removed), the member reads the right rows lazily, and the victim is served from shared
    memory next; neither the budget's count nor the daemon's files in /dev/shm ever pass the
    budget."""
    group, victim, attacker = group_daemon_users
    budget = 4 << 20
    hostile = vlen_file(public_dir / "hostile.h5", {"tokens": 48})
    rows = [0, 1023, 1024, 1099]
    d = _group_daemon(group, "--max-memory", str(budget))
    try:
        d.start()
        runtime_dir = d.runtime_dir

        def read_hostile() -> dict[str, object]:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ds = SharedH5Dataset(hostile, "tokens", runtime_dir=runtime_dir, fallback="lazy")
            try:
                got = collate(ds.__getitems__(rows))
                return {"backend": ds.backend, "warnings": [str(w.message) for w in caught],
                        "rows": [hashlib.sha256(t.numpy().tobytes()).hexdigest() for t in got]}
            finally:
                ds.close()

        def victim_reads() -> str:
            return SharedH5Dataset(public_dir / "data.h5", "x", runtime_dir=runtime_dir, fallback="error").backend

        with watch_memory(d) as peaks:
            status, out = as_user(attacker, read_hostile, timeout=120)
            assert status == "ok", out
            assert isinstance(out, dict) and out["backend"] == "lazy", out
            assert [w for w in out["warnings"] if re.search(  # type: ignore[union-attr]
                r"hostile.h5\[tokens\] all ranks \(global\) needs at least 4\d.\d MiB .* the daemon's budget of "
                r"4.0 MiB \(--max-memory\) had room for", w)], out
            assert out["rows"] == _digests(hostile, "tokens", rows)
            assert as_user(victim, victim_reads) == ("ok", "shm")
        assert d.status()["counters"]["load_errors"] == 1
        assert not [n for n in d.segment_files() if "tmp-" in n], d.segment_files()  # the stopped load's is gone
        assert peaks.samples > 0 and peaks.used <= budget and peaks.allocated <= budget, vars(peaks)
    finally:
        d.stop()


# --------------------------------------------------------------------------- planted names


def _plant(user: User, kind: str, path: Path, target: Path) -> None:
    argv = {"file": ["sh", "-c", f'echo planted > "{path}"'], "fifo": ["mkfifo", str(path)],
            "symlink": ["ln", "-s", str(target), str(path)]}[kind]
    done = run_as(user, argv)
    assert done.returncode == 0, done.stderr


def _kind(path: Path) -> tuple[str, int]:
    st = path.lstat()
    kind = "file" if stat.S_ISREG(st.st_mode) else "fifo" if stat.S_ISFIFO(st.st_mode) else \
        "symlink" if stat.S_ISLNK(st.st_mode) else "?"
    return kind, st.st_uid


def _rows(path: Path, key: str, runtime_dir: Path) -> tuple[str, bytes]:
    ds = SharedH5Dataset(path, key, runtime_dir=runtime_dir, fallback="error", timeout=30)
    try:
        return ds.backend, ds.__getitems__(list(range(len(ds)))).x.numpy().tobytes()
    finally:
        ds.close()


def test_a_name_planted_after_a_restart_is_published_around(public_dir: Path) -> None:
    """A non-member (no access to the daemon at all) plants a file, a FIFO and a symlink at
    published names while the daemon is stopped; after the restart every segment loads and is
    served under a fresh name, and what was planted is left as it was."""
    data = public_dir / "data.h5"
    keys = {"x": "file", "y": "fifo", "group/nested/x": "symlink"}
    precious = public_dir / "precious"
    precious.write_text("root's\n")
    precious.chmod(0o600)
    d = Daemon()
    planted: list[Path] = []
    try:
        with throwaway_user() as outsider:
            d.start()
            for key in keys:
                assert _rows(data, key, d.runtime_dir)[0] == "shm"
            names = {s["key"]: s["name"] for s in d.status()["segments"]}
            assert d.cli("stop").returncode == 0  # the runtime dir (and its naming key) stays
            assert wait_for(lambda: not d.alive(), 30)
            for key, kind in keys.items():
                planted.append(SHM / names[key])
                _plant(outsider, kind, planted[-1], precious)
            before = [_kind(p) for p in planted]
            d.start()
            for key in keys:
                backend, rows = _rows(data, key, d.runtime_dir)
                with h5py.File(data) as f:
                    assert (backend, rows) == ("shm", f[key][:].tobytes()), key
            fresh = {s["key"]: s["name"] for s in d.status()["segments"]}
            for key in keys:
                assert fresh[key] != names[key] and is_published_as(fresh[key], names[key]), (fresh, names)
            assert [_kind(p) for p in planted] == before == [(k, outsider.uid) for k in keys.values()]
            assert precious.read_text() == "root's\n" and precious.stat().st_uid == 0
    finally:
        d.stop()
        for path in planted:
            path.unlink(missing_ok=True)


def test_a_temporary_reveals_no_name_to_take(public_dir: Path) -> None:
    """A load's temporary is visible to every local user while it runs. Whatever name an
    outsider derives from it (the part before ``.tmp-``, as earlier versions named them) and
    plants a file at, the segment is published and served."""
    big = public_dir / "big.h5"
    rows = 400_000
    with h5py.File(big, "w") as f:  # a load long enough to see its temporary
        f.create_dataset("x", data=(np.arange(rows * 256, dtype=np.int64) % 251).astype(np.uint8).reshape(rows, 256),
                         chunks=(256, 256), compression="gzip", compression_opts=1)
    big.chmod(0o644)
    d = Daemon("--load-processes", "1")
    planted: list[Path] = []
    try:
        with throwaway_user() as outsider:
            d.start()
            prefix = segment_prefix(resolve_runtime(d.runtime_dir).namespace)
            seen: list[str] = []

            def temporary_appeared() -> bool:
                seen.extend(n for n in os.listdir(SHM) if n.startswith(prefix))
                return bool(seen)

            with DaemonClient(d.runtime_dir, timeout=10) as client:
                client.request(Acquire(str(big), "x", 1, 0))
                assert wait_for(temporary_appeared, 30, interval=0.002), "no temporary seen"
                tmp = seen[0]
                learned = tmp.split(".tmp-")[0] if ".tmp-" in tmp else ""
                if learned:  # what the name gave away: take it before the publish
                    planted.append(SHM / learned)
                    _plant(outsider, "file", planted[-1], big)
                result = client.acquire(Acquire(str(big), "x", 1, 0), deadline=time.monotonic() + 120)
            assert result.state == "ready"
            assert result.name[len(prefix):] not in tmp and tmp.startswith(prefix + "tmp-"), (tmp, result.name)
            backend, data = _rows(big, "x", d.runtime_dir)
            with h5py.File(big) as f:
                assert backend == "shm" and data == f["x"][:].tobytes()
    finally:
        d.stop()
        for path in planted:
            path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- log lines


FORGED = "2099-01-01 00:00:00,000 h5serve[1] WARNING FORGED"


def test_a_newline_in_a_file_name_forges_no_log_line(group_daemon_users: tuple[Group, User, User],
                                                     public_dir: Path) -> None:
    """A member requests a file whose name holds a newline and a fake log line; an outsider
    plants one under the daemon's prefix in /dev/shm. The daemon logs both names (loading,
    leaving it alone), escaped: no line of its log starts with the forged text."""
    group, member, _ = group_daemon_users
    odd = make_h5(public_dir / f"a\n{FORGED} path.h5")
    odd.chmod(0o644)
    d = _group_daemon(group)
    planted = SHM / (segment_prefix(resolve_runtime(d.runtime_dir).namespace) + f"zz\n{FORGED} shm")
    try:
        with throwaway_user() as outsider:
            done = run_as(outsider, ["sh", "-c", 'echo x > "$1"', "sh", str(planted)])
            assert done.returncode == 0, done.stderr
            d.start()

            def read() -> str:
                with warnings.catch_warnings(record=True):
                    warnings.simplefilter("always")
                    return SharedH5Dataset(odd, "x", runtime_dir=d.runtime_dir, fallback="error").backend

            assert as_user(member, read) == ("ok", "shm")
            log = _log(d)
            assert "FORGED path.h5" in log and "FORGED shm" in log, log  # both were logged...
            assert not [line for line in log.splitlines() if line.startswith(FORGED)], log  # ...on their own lines
            assert "\\x0a" + FORGED in log
    finally:
        d.stop()
        planted.unlink(missing_ok=True)


# --------------------------------------------------------------------------- the admin's terminal


FORGED_ROW = "/data/secret.h5  x  all  global  float32  1.0 GiB  0  0  1s  ready"
TERMINAL_BYTES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # ESC, CR, BEL...: every control but the newline


def test_a_members_file_name_and_key_never_reach_the_admins_terminal_raw(
        group_daemon_users: tuple[Group, User, User], public_dir: Path) -> None:
    """A member loads a file whose name holds ESC (a title-setting OSC sequence), BEL, CR and a
    newline followed by a fake ``ready`` row, through a key holding the same; root's `h5serve
    status` shows the segment on one line, escaped as the log escapes it (no control byte, no
    forged row), and `status --json` has the exact name and key."""
    group, member, _ = group_daemon_users
    odd_dir = public_dir / "evil\x1b]0;owned\x07\r\n" / "data"  # the path goes on with "/data/secret.h5  x  all ..."
    odd_dir.mkdir(parents=True)
    for d in (odd_dir, odd_dir.parent):
        d.chmod(0o755)
    odd = odd_dir / FORGED_ROW.removeprefix("/data/")
    key = "x\x1b[2J\x07\r\n" + FORGED_ROW
    with h5py.File(odd, "w") as f:
        f.create_dataset(key, data=np.arange(64, dtype=np.float32))
    os.chown(odd, member.uid, member.gid)
    odd.chmod(0o644)
    assert str(odd).split("\n")[1].startswith(FORGED_ROW)  # raw, the name would start a line with the fake row
    d = _group_daemon(group)
    try:
        d.start()
        runtime_dir = d.runtime_dir

        def load() -> str:
            with DaemonClient(runtime_dir, timeout=10) as client:
                return client.acquire(Acquire(str(odd), key, 1, 0), deadline=time.monotonic() + 60).state

        assert as_user(member, load) == ("ok", "ready")
        raw = subprocess.run([sys.executable, "-m", "h5serve", "status"], env=d.env, capture_output=True, timeout=60)
        assert raw.returncode == 0, raw.stderr
        text = raw.stdout.decode()  # bytes: text mode would turn the CR of "\r\n" into a newline unseen
        for byte in "\x1b\r\x07":
            assert byte not in text, repr(text)
        assert not TERMINAL_BYTES.search(text), repr(text)
        assert not [line for line in text.splitlines() if line.startswith(FORGED_ROW[:15])], text
        rows = [line for line in text.splitlines() if line.startswith(str(public_dir))]
        assert len(rows) == 1 and rows[0].endswith("ready"), text  # one segment, one line
        assert "evil\\x1b]0;owned\\x07\\x0d\\x0a/data/secret.h5" in rows[0], rows
        assert "x\\x1b[2J\\x07\\x0d\\x0a/data/secret.h5" in rows[0], rows
        done = d.cli("status", "--json")
        assert done.returncode == 0, done.stderr
        (segment,) = json.loads(done.stdout)["segments"]
        assert (segment["file"], segment["key"], segment["state"]) == (str(odd), key, "ready")
    finally:
        d.stop()


# --------------------------------------------------------------------------- file locks


def _locked_exclusively(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@contextlib.contextmanager
def _flocked_by(attacker: User, path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``path`` held with LOCK_EX by a shell-only attacker (``flock FILE sleep 600`` as them) for
    the block; the lock's process is killed and reaped on exit."""
    lock = subprocess.Popen(setpriv(attacker) + ["flock", str(path), "sleep", "600"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd="/")
    try:
        assert wait_for(lambda: _locked_exclusively(path) or lock.poll() is not None, 30)
        assert lock.poll() is None, lock.stderr.read() if lock.stderr else ""
        yield lock
    finally:
        lock.kill()
        lock.wait(timeout=30)


def test_a_members_exclusive_flock_never_fails_anothers_loads(group_daemon_users: tuple[Group, User, User],
                                                             public_dir: Path) -> None:
    """The attacker, a shell-only member, holds ``flock`` LOCK_EX on the victim's group-readable
    file (``flock FILE sleep 600``); the victim's acquire through the daemon (inspection, then
    a load) is still ready within the deadline with the file's rows, as is a whole-file load
    of a second key. HDF5's own shared lock would fail both ("unable to lock file, errno = 11")."""
    group, victim, attacker = group_daemon_users
    owned = make_h5(public_dir / "victim.h5")
    os.chown(owned, victim.uid, group.gid)
    owned.chmod(0o640)
    with h5py.File(owned) as f:
        expected = f["x"][:].tobytes()
    d = _group_daemon(group)
    with _flocked_by(attacker, owned) as lock:
        try:
            d.start()
            runtime_dir = d.runtime_dir

            def load() -> tuple[str, str, bytes]:
                with DaemonClient(runtime_dir, timeout=10) as client:
                    deadline = time.monotonic() + 60
                    sharded = client.acquire(Acquire(str(owned), "x", 2, 1), deadline=deadline)
                    whole = client.acquire(Acquire(str(owned), "y", 1, 0, "global"), deadline=deadline)
                backend, rows = _rows(owned, "x", runtime_dir)
                return f"{sharded.state} {whole.state}", backend, rows

            status, out = as_user(victim, load, timeout=90)
            assert status == "ok", out
            assert out == ("ready ready", "shm", expected)
            assert _locked_exclusively(owned) and lock.poll() is None  # the lock held all along
        finally:
            d.stop()


def test_a_members_exclusive_flock_on_a_linked_file_never_fails_a_load(group_daemon_users: tuple[Group, User, User],
                                                                      public_dir: Path) -> None:
    """The files HDF5 opens by itself take no lock either: with the attacker's LOCK_EX on the
    victim's file, the victim's load of an external link to it and root's load of a virtual
    dataset whose source it is (root's own: virtual datasets are served to root) are ready."""
    group, victim, attacker = group_daemon_users
    target = make_h5(public_dir / "target.h5")
    linked = public_dir / "linked.h5"
    with h5py.File(linked, "w") as f:
        f["x"] = h5py.ExternalLink(str(target), "x")
    for path in (target, linked):
        os.chown(path, victim.uid, group.gid)
        path.chmod(0o640)
    layout = h5py.VirtualLayout(shape=(1000,), dtype="int64")
    layout[:] = h5py.VirtualSource(str(target), "y", shape=(1000,))
    vds = public_dir / "vds.h5"
    with h5py.File(vds, "w") as f:
        f.create_virtual_dataset("v", layout)
    with h5py.File(target) as f:
        expected = f["x"][:].tobytes()
    d = _group_daemon(group)
    with _flocked_by(attacker, target) as lock:
        try:
            d.start()
            runtime_dir = d.runtime_dir

            def load() -> tuple[str, str, bytes]:
                with DaemonClient(runtime_dir, timeout=10) as client:
                    state = client.acquire(Acquire(str(linked), "x", 1, 0), deadline=time.monotonic() + 60).state
                return (state, *_rows(linked, "x", runtime_dir))

            assert as_user(victim, load, timeout=90) == ("ok", ("ready", "shm", expected))
            with DaemonClient(runtime_dir, timeout=10) as client:
                assert client.acquire(Acquire(str(vds), "v", 1, 0), deadline=time.monotonic() + 60).state == "ready"
            assert _locked_exclusively(target) and lock.poll() is None
        finally:
            d.stop()
