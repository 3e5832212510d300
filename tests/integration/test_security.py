"""Who may connect, map and ask: file modes, other uids, --group, --allow-root, --user."""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from h5serve.client import SharedH5Dataset
from h5serve.errors import AccessDenied, DaemonUnavailable, SegmentError
from h5serve.segments import attach_segment
from h5serve.wire.connection import DaemonClient

from ..helpers import Daemon, descendant_pids, h5serve_cli, kill_daemon_of, make_h5, short_tmpdir, wait_for
from ..users import PortablePython, setpriv, throwaway_user
from ..users import as_ids as as_user
from ..users import as_user as as_account

NOBODY, NOGROUP = 65534, 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="switching uids needs root")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def public_file() -> Path:
    """An HDF5 file other users may read (pytest's tmp dirs are private to root)."""
    d = short_tmpdir("h5s-pub-")
    d.chmod(0o755)
    path = make_h5(d / "data.h5")
    path.chmod(0o644)
    yield path
    subprocess.run(["rm", "-rf", str(d)])


def test_runtime_dir_socket_pidfile_log_and_segments_are_private(daemon: Daemon, h5file: Path) -> None:
    ds = SharedH5Dataset(h5file, "x", runtime_dir=daemon.runtime_dir, fallback="error")
    assert mode(daemon.runtime_dir) == 0o700
    for name in ("h5serve.sock", "h5serve.pid", "h5serve.log"):
        assert mode(daemon.runtime_dir / name) == 0o600, name
    segment = Path("/dev/shm") / daemon.segment_files()[0]
    assert mode(segment) == 0o400 and os.stat(segment).st_uid == os.getuid()  # published: read-only
    ds.close()


@root_only
def test_another_uid_cannot_connect_or_attach(daemon: Daemon, public_file: Path) -> None:
    SharedH5Dataset(public_file, "x", runtime_dir=daemon.runtime_dir, fallback="error")
    segment = daemon.segment_files()[0]
    runtime_dir = daemon.runtime_dir

    def probe() -> dict[str, str]:
        out = {}
        try:
            DaemonClient(runtime_dir, timeout=1.0).ping()
            out["ping"] = "answered"
        except DaemonUnavailable as exc:
            out["ping"] = f"unavailable: {exc}"
        try:
            os.open(runtime_dir / "h5serve.sock", os.O_RDONLY)
            out["socket"] = "opened"
        except PermissionError:
            out["socket"] = "denied"
        try:
            attach_segment(Path("/dev/shm"), segment, 0)
            out["attach"] = "mapped"
        except SegmentError as exc:
            out["attach"] = f"refused: {exc}"
        return out

    status, out = as_user(NOBODY, NOGROUP, [], probe)
    assert status == "ok", out
    assert out["ping"].startswith("unavailable") and out["socket"] == "denied"
    assert out["attach"].startswith("refused") and "Permission denied" in out["attach"]


@root_only
def test_group_members_may_connect_and_attach(public_file: Path) -> None:
    d = Daemon("--group", "nogroup")
    d.dir.chmod(0o755)  # the runtime dir's parent must be reachable; the runtime dir itself is 0750
    try:
        d.start()
        assert mode(d.runtime_dir) == 0o750 and os.stat(d.runtime_dir).st_gid == NOGROUP
        assert mode(d.runtime_dir / "h5serve.sock") == 0o660
        runtime_dir = d.runtime_dir

        def read_shard() -> tuple[str, bytes]:
            ds = SharedH5Dataset(public_file, "x", "y", rank=1, world_size=2, runtime_dir=runtime_dir,
                                 fallback="error")
            return ds.backend, ds.__getitems__(list(range(len(ds)))).x.numpy().tobytes()

        status, out = as_user(NOBODY, NOGROUP, [NOGROUP], read_shard)
        assert status == "ok", out
        with h5py.File(public_file) as f:
            assert out == ("shm", f["x"][500:].tobytes())
        # owner-only: the member mapped them from descriptors the daemon handed out (was 0440 to the
        # group, which let every member read every other member's segments)
        segments = [Path("/dev/shm") / n for n in d.segment_files()]
        assert segments and all(mode(p) == 0o400 and os.stat(p).st_uid == os.getuid() for p in segments)

        status, out = as_user(NOBODY - 1, NOGROUP - 1, [], read_shard)  # not in the group
        assert status == "error" and "DaemonUnavailable" in out
    finally:
        d.stop()


def test_allow_root_refuses_files_outside_after_resolving_symlinks(tmp_path: Path) -> None:
    inside, outside = tmp_path / "inside", tmp_path / "outside"
    inside.mkdir()
    outside.mkdir()
    good = make_h5(inside / "good.h5")
    secret = make_h5(outside / "secret.h5")
    (inside / "sneaky.h5").symlink_to(secret)
    with h5py.File(inside / "linker.h5", "w") as f:
        f["x"] = h5py.ExternalLink(str(secret), "/x")
    d = Daemon("--allow-root", str(inside))
    try:
        d.start()
        assert SharedH5Dataset(good, "x", runtime_dir=d.runtime_dir, fallback="error").backend == "shm"
        for path, key in ((secret, "x"), (inside / "sneaky.h5", "x"), (inside / "linker.h5", "x"),
                          (Path(str(inside) + "/../outside/secret.h5"), "x")):
            with pytest.raises(AccessDenied, match="outside the daemon's allowed roots"):
                SharedH5Dataset(path, key, runtime_dir=d.runtime_dir, fallback="error")
        with pytest.warns(RuntimeWarning, match="allowed roots"):
            lazy = SharedH5Dataset(secret, "x", runtime_dir=d.runtime_dir)
        assert lazy.backend == "lazy"  # the policy is the daemon's; the user may still read the file
        assert [s["file"] for s in d.status()["segments"]] == [str(good)]
    finally:
        d.stop()


def _user_can_run_python(uid: int) -> bool:
    try:
        return subprocess.run([sys.executable, "-c", "pass"], user=uid, capture_output=True, timeout=30).returncode == 0
    except PermissionError:
        return False


@root_only
def test_user_option_drops_privileges(public_file: Path) -> None:
    runtime_dir = short_tmpdir("h5s-user-") / "rt"
    env = {**os.environ, "H5SERVE_RUNTIME_DIR": str(runtime_dir)}
    try:
        done = h5serve_cli("start", "--user", "nobody", env=env)
        if not _user_can_run_python(NOBODY):
            # Here the interpreter lives under /root (0700): the daemon drops to nobody first,
            # then finds it could not start loaders, and says so instead of failing later.
            assert done.returncode == 1 and "cannot run the Python interpreter" in done.stderr
            assert os.stat(runtime_dir).st_uid == NOBODY
            assert not (runtime_dir / "h5serve.sock").exists()
            return
        assert done.returncode == 0, done.stderr
        pid = int((runtime_dir / "h5serve.pid").read_text())
        uids = Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split()[:2]
        assert uids == [str(NOBODY), str(NOBODY)]
        assert os.stat(runtime_dir / "h5serve.sock").st_uid == NOBODY
        ds = SharedH5Dataset(public_file, "x", runtime_dir=runtime_dir, fallback="error")
        assert ds.backend == "shm"
        assert all(os.stat(s.path).st_uid == NOBODY for s in ds._backend.segments)
    finally:
        h5serve_cli("stop", env=env)
        subprocess.run(["rm", "-rf", str(runtime_dir.parent)])


def test_bad_user_and_group_are_clear_errors() -> None:
    done = h5serve_cli("start", "--user", "no-such-user-h5s", "--runtime-dir", "/tmp/h5s-nouser")
    assert done.returncode == 1 and "no such user" in done.stderr
    done = h5serve_cli("start", "--group", "no-such-group-h5s", "--runtime-dir", "/tmp/h5s-nogroup")
    assert done.returncode == 1 and "no such group" in done.stderr


@root_only
def test_client_that_does_not_share_dev_shm_is_told_so(daemon: Daemon, h5file: Path) -> None:
    """A job in its own mount namespace with a private /dev/shm (what SLURM job_container/tmpfs
    or a container without shared IPC gives): clear warning, lazy reads, correct data."""
    script = (
        "import warnings, json\n"
        "from h5serve.client import SharedH5Dataset\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        f"    ds = SharedH5Dataset({str(h5file)!r}, 'x', 'y', runtime_dir={str(daemon.runtime_dir)!r})\n"
        "print(json.dumps([ds.backend, int(ds[7][1]), [str(m.message) for m in w]]))\n"
    )
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           f"mount -t tmpfs tmpfs /dev/shm && exec {sys.executable} -c \"$0\"", script]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0 and "unshare" in done.stderr:
        pytest.skip(f"cannot make a mount namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    import json

    backend, label, warnings_seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert backend == "lazy" and label == 7
    assert any("does not see the daemon's /dev/shm" in w for w in warnings_seen), warnings_seen


_PTRACE_SEIZE = 0x4206  # attaches without stopping the tracee; the tracer's exit detaches it


def _ptrace_seize(pid: int) -> str:
    """PTRACE_SEIZE ``pid`` as the calling process: "attached" or the errno's name."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    if libc.ptrace(_PTRACE_SEIZE, pid, None, None) == 0:
        return "attached"
    return errno.errorcode.get(ctypes.get_errno(), "?")


def _yama_lets_users_trace() -> bool:
    """Without Yama, or with ptrace_scope 0, a user may trace any process of its own."""
    try:
        return Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip() == "0"
    except OSError:
        return True


@root_only
@pytest.mark.parametrize("started", ["by the user", "by root with --user"])
def test_the_daemon_and_every_process_it_starts_are_undumpable(py: PortablePython, started: str) -> None:
    """A daemon its own user started (an exec by that user makes a process dumpable again), or one
    root started with --user (the prolog's; the daemonized interpreter is exec'd as the user):
    the daemon, its forkserver, resource tracker and spare loader are undumpable, so their
    /proc/PID entries are root's and their own user cannot ptrace them. A plain process of the
    user, exec'd the same way, is the control."""
    with throwaway_user() as user:
        where = short_tmpdir("h5s-dump-")
        runtime = where / "rt"
        control: subprocess.Popen[bytes] | None = None
        try:
            where.chmod(0o755)
            if started == "by the user":
                runtime.mkdir(mode=0o700)
                os.chown(runtime, user.uid, user.gid)
                done = py.run("start", "--runtime-dir", str(runtime), user=user)
            else:
                done = py.run("start", "--user", user.name, "--runtime-dir", str(runtime))
            assert done.returncode == 0, done.stderr
            pid = int((runtime / "h5serve.pid").read_text())
            assert wait_for(lambda: any(Path(f"/proc/{p}/comm").read_text().strip() == "h5serve-spare"
                                        for p in descendant_pids(pid)), 30), "no spare loader started"
            processes = [pid, *descendant_pids(pid)]
            assert len(processes) >= 4, processes  # daemon, forkserver, resource tracker, spare
            control = subprocess.Popen([*setpriv(user), "sleep", "120"], stdin=subprocess.DEVNULL)
            assert wait_for(lambda: Path(f"/proc/{control.pid}/comm").read_text().strip() == "sleep", 10)

            def owner(p: int) -> int:
                return os.stat(f"/proc/{p}/mem").st_uid

            assert owner(control.pid) == user.uid  # the control: a process of the user, dumpable
            assert {p: owner(p) for p in processes} == dict.fromkeys(processes, 0)
            assert all(Path(f"/proc/{p}/status").read_text().split("Uid:")[1].split()[0] == str(user.uid)
                       for p in processes)  # still the user's processes: only undumpable
            if _yama_lets_users_trace():
                for target, expected in [(control.pid, "attached"), *[(p, "EPERM") for p in processes]]:
                    status, out = as_account(user, functools.partial(_ptrace_seize, target))
                    assert (status, out) == ("ok", expected), (target, status, out)
            stopped = py.run("stop", "--runtime-dir", str(runtime), user=user)
            assert stopped.returncode == 0, stopped.stderr
        finally:
            if control is not None:
                control.kill()
                control.wait()
            kill_daemon_of(runtime)
            shutil.rmtree(where, ignore_errors=True)
