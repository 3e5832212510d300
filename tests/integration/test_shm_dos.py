"""Other users cannot deny service through /dev/shm (issue 9, section 3).

The segment prefix ``h5serve-<uid>-<namespace>-`` is public (the SLURM epilog finds leftovers
by it) and /dev/shm is world-writable, so another user can put regular files, FIFOs and
symlinks under it, at any name they can guess or see. These tests do that as a real other
user (tests/users.py) against a daemon running as root and as an ordinary user, and check
that the daemon starts, serves (or lets clients fall back lazily), evicts and stops without
hanging or dying, removes every file of its own and never touches the other user's files.
Where a test needs an exact segment name it uses one the daemon published (as anyone could
see it in /dev/shm) or computes it with the daemon's own secret, as if the secret had leaked.
"""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import subprocess
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import h5py
import pytest
import torch
from torch.utils.data import DataLoader

from h5serve.client import SharedH5Dataset, collate
from h5serve.daemon.access.secret import KEY_NAME, load_secret
from h5serve.segments import HEADER_SIZE, SECRET_BYTES, read_meta, segment_name
from h5serve.wire.runtime import RuntimeLocation

from ..helpers import h5serve_cli, make_h5, short_tmpdir, wait_for
from ..users import PortablePython, User, as_user, root_only, setpriv, throwaway_user

SHM = Path("/dev/shm")
KINDS = ["root", "user"]  # the daemon's user: root (this interpreter), or a throwaway user

pytestmark = [root_only, pytest.mark.timeout(240)]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def attacker() -> Iterator[User]:
    with throwaway_user() as user:
        yield user


@pytest.fixture(scope="module")
def victim() -> Iterator[User]:
    with throwaway_user() as user:
        yield user


@pytest.fixture
def workdir() -> Iterator[Path]:
    """World-readable: the data file and a root-owned "precious" file symlinks point at."""
    where = short_tmpdir("h5s-dos-")
    where.chmod(0o755)
    try:
        yield where
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(where)], timeout=60, check=False)


@pytest.fixture
def data(workdir: Path) -> Path:
    path = make_h5(workdir / "data.h5")
    path.chmod(0o644)
    return path


@pytest.fixture
def precious(workdir: Path) -> Path:
    path = workdir / "precious"
    path.write_bytes(b"root's data\n")
    return path


class Served:
    """A daemon on its own runtime dir, run as root or as ``user`` (through portable python),
    and clients of it run as the same user."""

    def __init__(self, workdir: Path, user: User | None, py: PortablePython, *extra: str) -> None:
        self.user, self.py, self.extra = user, py, extra
        home = workdir / "home"
        home.mkdir()
        if user is not None:
            os.chown(home, user.uid, user.gid)
        self.runtime_dir = home / "rt"
        self.uid = 0 if user is None else user.uid
        self.prefix = f"h5serve-{self.uid}-{RuntimeLocation(self.runtime_dir).namespace}-"

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        if self.user is None:
            return h5serve_cli(*args, env={**os.environ, "H5SERVE_RUNTIME_DIR": str(self.runtime_dir)}, timeout=timeout)
        env = {**self.py.env, "H5SERVE_RUNTIME_DIR": str(self.runtime_dir)}
        return subprocess.run(setpriv(self.user) + self.py.argv(*args), env=env, capture_output=True, text=True,
                              timeout=timeout, cwd="/", check=False)

    def start(self) -> None:
        done = self.cli("start", *self.extra)
        assert done.returncode == 0, done.stdout + done.stderr + self.log()

    def stop(self) -> None:
        done = self.cli("stop")
        assert done.returncode == 0, done.stdout + done.stderr + self.log()

    def status(self) -> dict:
        import json

        done = self.cli("status", "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def pid(self) -> int:
        try:
            return int((self.runtime_dir / "h5serve.pid").read_text())
        except (OSError, ValueError):
            return 0

    def alive(self) -> bool:
        pid = self.pid()
        try:
            with open(f"/proc/{pid}/stat") as f:
                return pid > 0 and f.read().split(") ", 1)[1][0] != "Z"
        except OSError:
            return False

    def log(self) -> str:
        try:
            return (self.runtime_dir / "h5serve.log").read_text(errors="replace")
        except OSError:
            return ""

    def as_client(self, fn: Callable[[], object]) -> tuple[str, object]:
        """``fn`` as the daemon's user: ("ok", result) or ("error", "Type: message")."""
        if self.user is not None:
            return as_user(self.user, fn)
        try:
            return "ok", fn()
        except Exception as exc:  # noqa: BLE001 - reported like as_user does
            return "error", f"{type(exc).__name__}: {exc}"

    def own_files(self) -> list[str]:
        return sorted(n for n in os.listdir(SHM) if n.startswith(self.prefix)
                      and stat.S_ISREG(os.lstat(SHM / n).st_mode) and os.lstat(SHM / n).st_uid == self.uid)

    def cleanup(self) -> None:
        pid = self.pid()
        if self.alive():
            os.kill(pid, signal.SIGKILL)
        for name in os.listdir(SHM):
            if name.startswith(self.prefix):
                (SHM / name).unlink(missing_ok=True)


@pytest.fixture(params=KINDS)
def served(request: pytest.FixtureRequest, workdir: Path, py: PortablePython) -> Iterator[Served]:
    user = None if request.param == "root" else request.getfixturevalue("victim")
    s = Served(workdir, user, py)
    try:
        yield s
    finally:
        s.cleanup()


# --------------------------------------------------------------------------- helpers


def expected(path: Path, key: str) -> bytes:
    with h5py.File(path, "r") as f:
        return f[key][...].tobytes()


def read_all(runtime_dir: Path, path: Path, key: str, y_key: str | None = None,
             fallback: str = "lazy") -> tuple[str, bytes, list[str]]:
    """(backend, every x row's bytes, warnings) of one client reading the whole dataset."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = SharedH5Dataset(path, key, y_key, rank=0, world_size=1, runtime_dir=runtime_dir, fallback=fallback,
                             timeout=10)
        try:
            batch = ds.__getitems__(list(range(len(ds))))
            return ds.backend, batch.x.numpy().tobytes(), [str(w.message) for w in caught]
        finally:
            ds.close()


def plant(attacker: User, make: Callable[[], None]) -> None:
    status, out = as_user(attacker, make)
    assert status == "ok", out


def snapshot(paths: list[Path]) -> dict[Path, tuple]:
    """What is at each path: inode, mode, owner and content (regular file) or target (symlink)."""
    out = {}
    for p in paths:
        st = os.lstat(p)
        content = (p.read_bytes() if stat.S_ISREG(st.st_mode) else
                   os.readlink(p) if stat.S_ISLNK(st.st_mode) else None)
        out[p] = (st.st_ino, st.st_mode, st.st_uid, content)
    return out


def hold_exclusive_lock(user: User, path: Path) -> subprocess.Popen:
    """A process of ``user`` holding flock(LOCK_EX) on ``path`` until killed."""
    proc = subprocess.Popen(setpriv(user) + ["flock", "--exclusive", str(path), "sleep", "300"], cwd="/")

    def locked() -> bool:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    assert wait_for(locked, 10), "the attacker's flock was not taken"
    return proc


def kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)


# --------------------------------------------------------------------------- tests


def test_planted_files_deny_nothing(served: Served, attacker: User, data: Path, precious: Path) -> None:
    """Files another user put under the prefix, at the exact final names of the next loads
    (a forged complete segment, a FIFO) and elsewhere (regular files, FIFOs, symlinks to a
    root file, temporary-looking names): start, load under fresh names, stop, all in time,
    and every planted file left as it was."""
    served.start()
    status, out = served.as_client(lambda: read_all(served.runtime_dir, data, "x", "y", fallback="error"))
    assert status == "ok" and out[0] == "shm", out
    names = {s["key"]: s["name"] for s in served.status()["segments"]}
    x_final, y_final = SHM / names["x"], SHM / names["y"]
    forged = bytearray(x_final.read_bytes())
    forged[HEADER_SIZE:] = b"\xff" * (len(forged) - HEADER_SIZE)  # complete header, poisoned rows
    # The names come from the daemon's secret: with it (leaked), anyone computes them.
    secret = (served.runtime_dir / KEY_NAME).read_bytes()
    meta, _ = read_meta(x_final, owner=served.uid)
    assert segment_name("ns", meta, secret).rsplit("-", 1)[1] == names["x"].rsplit("-", 1)[1]
    served.stop()
    assert served.own_files() == []

    p = served.prefix
    planted = [x_final, y_final, SHM / f"{names['x']}.tmp-1-abcdef", SHM / f"{p}zz-regular",
               SHM / f"{p}zz-fifo", SHM / f"{p}zz-link", SHM / f"{p}zz-link.tmp-2-abcdef"]

    def make() -> None:
        fd = os.open(x_final, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, bytes(forged))
        os.close(fd)
        os.mkfifo(y_final, 0o666)
        os.mkfifo(planted[2], 0o666)
        (SHM / f"{p}zz-regular").write_bytes(b"mine")
        os.mkfifo(SHM / f"{p}zz-fifo", 0o666)
        os.symlink(precious, SHM / f"{p}zz-link")
        os.symlink(precious, SHM / f"{p}zz-link.tmp-2-abcdef")

    try:
        plant(attacker, make)
        before = snapshot(planted + [precious])

        served.start()  # recovery meets every planted file (the deadline is the cli's timeout)
        assert "not a segment of this daemon" in served.log()
        # the final names are taken: published under fresh names (issue 21: they used to be
        # refused for good, every client reading lazily), never the forged rows
        status, out = served.as_client(lambda: read_all(served.runtime_dir, data, "x", "y", fallback="error"))
        assert status == "ok", out
        backend, rows, caught = out
        assert backend == "shm" and rows == expected(data, "x") and not caught, out
        fresh = {s["key"]: s["name"] for s in served.status()["segments"]}
        for key in ("x", "y"):
            assert fresh[key] != names[key] and fresh[key].startswith(names[key] + "-"), (fresh, names)
        assert "not ours (left alone): publishing the segment as" in served.log()
        status, out = served.as_client(lambda: read_all(served.runtime_dir, data, "group/nested/x", fallback="error"))
        assert status == "ok" and out[0] == "shm" and out[1] == expected(data, "group/nested/x"), out
        assert served.own_files()

        served.stop()
        assert served.own_files() == []
        assert snapshot(planted + [precious]) == before
    finally:
        for path in planted:
            path.unlink(missing_ok=True)


def test_foreign_files_at_ready_names_neither_hang_clients_nor_kill_eviction(
        served: Served, attacker: User, data: Path, workdir: Path) -> None:
    """Once a segment's name is free again (its owner removed it), another user can put a
    file there: a regular file it keeps locked (LOCK_EX), or a FIFO. The next request loads the
    segment again under a fresh name, in time; evicting it for room (--max-memory) or because its source changed drops
    it from the registry and leaves the file alone; the daemon keeps serving."""
    # x (52,096 B: 13 pages), y (12,096 B: 3 pages) and other.h5's y (5,696 B: 2 pages), 73,728 B in tmpfs; not a
    # fourth of x's size
    served.extra = ("--max-memory", "80000")
    other = make_h5(workdir / "other.h5", rows=200)
    other.chmod(0o644)
    served.start()
    for path, key in ((data, "x"), (data, "y"), (other, "y")):
        status, out = served.as_client(lambda p=path, k=key: read_all(served.runtime_dir, p, k, fallback="error"))
        assert status == "ok" and out[0] == "shm", out
    names = {(Path(s["file"]).name, s["key"]): SHM / s["name"] for s in served.status()["segments"]}
    x_path, y_path, other_path = names["data.h5", "x"], names["data.h5", "y"], names["other.h5", "y"]
    for path in (x_path, y_path, other_path):
        path.unlink()  # its owner removes it (the daemon still lists it as ready)

    def make() -> None:
        x_path.write_bytes(b"\0" * 8192)
        x_path.chmod(0o644)
        os.mkfifo(y_path, 0o666)
        os.mkfifo(other_path, 0o666)

    holder = None
    try:
        plant(attacker, make)
        holder = hold_exclusive_lock(attacker, x_path)
        before = snapshot([x_path, y_path, other_path])

        started = time.monotonic()
        status, out = served.as_client(lambda: read_all(served.runtime_dir, data, "x", "y"))
        assert status == "ok", out
        # loaded again under fresh names (issue 21: the planted names used to deny them, clients read lazily)
        assert out[0] == "shm" and out[1] == expected(data, "x") and time.monotonic() - started < 30, out

        os.utime(other, ns=(time.time_ns(), time.time_ns() + 10**9))  # the sweep now evicts other.h5's segment
        assert wait_for(lambda: served.status()["counters"]["stale_evictions"] >= 1, 15), served.log()
        # nested x needs room: x (and y) are evicted, i.e. dropped, their foreign files left alone
        status, out = served.as_client(lambda: read_all(served.runtime_dir, data, "group/nested/x", fallback="error"))
        assert status == "ok" and out[0] == "shm" and out[1] == expected(data, "group/nested/x"), out
        info = served.status()
        # x and y: found damaged (a file not ours at the name) when asked for, and dropped; other.h5's
        # y: evicted as stale. Their files are left alone either way.
        assert served.alive() and info["counters"]["damaged"] >= 2 and info["counters"]["evictions"] >= 1, info
        assert {s["key"] for s in info["segments"]} <= {"y", "group/nested/x"}

        served.stop()
        assert served.own_files() == []
        assert snapshot([x_path, y_path, other_path]) == before
    finally:
        if holder is not None:
            kill(holder)
        for path in (x_path, y_path, other_path):
            path.unlink(missing_ok=True)


def test_spawned_worker_reads_lazily_when_a_fifo_replaced_its_segment(
        workdir: Path, py: PortablePython, attacker: User, data: Path) -> None:
    """A spawned DataLoader worker maps the segments again by name; after a stop another user
    can put FIFOs at those names. The worker must read the same rows lazily, not hang."""
    served = Served(workdir, None, py)
    try:
        served.start()
        ds = SharedH5Dataset(data, "x", "y", rank=0, world_size=1, runtime_dir=served.runtime_dir, fallback="error")
        assert ds.backend == "shm"
        names = [SHM / s["name"] for s in served.status()["segments"]]
        served.stop()

        def make() -> None:
            for name in names:
                os.mkfifo(name, 0o666)

        plant(attacker, make)
        try:
            loader = DataLoader(ds, batch_size=250, num_workers=1, multiprocessing_context="spawn",
                                collate_fn=collate, timeout=60)
            xs, ys = zip(*loader)
            assert torch.cat(ys).tolist() == list(range(1000))
            assert torch.cat(xs).numpy().tobytes() == expected(data, "x")
            assert all(stat.S_ISFIFO(os.lstat(n).st_mode) for n in names)
        finally:
            ds.close()
            for n in names:
                n.unlink(missing_ok=True)
    finally:
        served.cleanup()


def test_names_are_keyed_by_the_daemons_secret(workdir: Path, py: PortablePython, data: Path) -> None:
    """The same file gets a different name under another secret (same public prefix); the
    secret survives a kill -9, so a restarted daemon still adopts complete segments."""
    served = Served(workdir, None, py)
    key = served.runtime_dir / KEY_NAME

    def names() -> list[str]:
        return sorted(s["name"] for s in served.status()["segments"])

    try:
        served.start()
        assert read_all(served.runtime_dir, data, "x", "y", fallback="error")[0] == "shm"
        first = names()
        st = os.lstat(key)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == SECRET_BYTES
        os.kill(served.pid(), signal.SIGKILL)
        assert wait_for(lambda: not served.alive(), 10)

        served.start()
        assert names() == first and served.status()["counters"]["adopted"] == 2
        served.stop()

        key.unlink()  # another daemon, another secret
        served.start()
        assert read_all(served.runtime_dir, data, "x", "y", fallback="error")[0] == "shm"
        second = names()
        assert all(n.startswith(served.prefix) for n in first + second)
        assert not set(first) & set(second)
        served.stop()
    finally:
        served.cleanup()


def test_a_damaged_or_planted_key_file_is_replaced_never_followed(workdir: Path, precious: Path) -> None:
    runtime_dir = workdir / "rt"
    runtime_dir.mkdir(mode=0o700)
    key = runtime_dir / KEY_NAME
    first = load_secret(runtime_dir)
    assert load_secret(runtime_dir) == first and len(first) == SECRET_BYTES
    original = precious.read_bytes()
    for damage in (lambda: os.symlink(precious, key), lambda: key.write_bytes(b"short"),
                   lambda: (key.write_bytes(os.urandom(SECRET_BYTES)), key.chmod(0o644)),
                   lambda: os.mkfifo(key)):
        key.unlink(missing_ok=True)
        damage()
        fresh = load_secret(runtime_dir)
        st = os.lstat(key)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert key.read_bytes() == fresh and len(fresh) == SECRET_BYTES
        assert precious.read_bytes() == original and stat.S_ISREG(os.lstat(precious).st_mode)
    assert not [n for n in os.listdir(runtime_dir) if n != KEY_NAME]  # no temporaries left


def test_segment_names_differ_per_secret_behind_one_prefix() -> None:
    from ..helpers import NAMESPACE, make_meta

    meta = make_meta()
    a, b = segment_name(NAMESPACE, meta, b"a" * 32), segment_name(NAMESPACE, meta, b"b" * 32)
    assert a != b and a.rsplit("-", 1)[0] == b.rsplit("-", 1)[0]
    with pytest.raises(ValueError):
        segment_name(NAMESPACE, meta, b"")
