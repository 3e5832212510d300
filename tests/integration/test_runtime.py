"""Unit tests for h5serve.wire.runtime: runtime dir, socket, pidfile, shm dir, daemon lock."""

import fcntl
import os
import select
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from h5serve.errors import ConfigError
from h5serve.wire.runtime import (
    MAX_IPC_PATH,
    RuntimeLocation,
    daemon_lock_held,
    ensure_runtime_dir,
    resolve_runtime,
    resolve_shm_dir,
)

DEFAULT_DIR = Path(f"/tmp/h5serve-{os.getuid()}")


@pytest.fixture
def env(monkeypatch):
    for name in ("H5SERVE_RUNTIME_DIR", "XDG_RUNTIME_DIR", "H5SERVE_SHM_DIR"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def short_tmp():
    """A short directory under /tmp (pytest's tmp_path can get close to the 107-char socket limit)."""
    path = Path(tempfile.mkdtemp(prefix="h5rt-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def private_dir(path):
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


# --------------------------------------------------------------------------- RuntimeLocation


def test_location_paths(short_tmp):
    loc = RuntimeLocation(short_tmp)
    assert loc.socket_path == short_tmp / "h5serve.sock"
    assert loc.endpoint == f"ipc://{short_tmp}/h5serve.sock"
    assert loc.pidfile == short_tmp / "h5serve.pid"
    assert loc.pidfile.parent == loc.socket_path.parent
    assert loc.logfile.parent == short_tmp


def test_location_namespace():
    a = RuntimeLocation(Path("/run/user/1000/h5serve"))
    assert a.namespace == RuntimeLocation(Path("/run/user/1000/h5serve")).namespace
    assert a.namespace != RuntimeLocation(Path("/tmp/h5serve-1000")).namespace
    assert len(a.namespace) == 8 and all(c in "0123456789abcdef" for c in a.namespace)


# --------------------------------------------------------------------------- resolve_runtime


def test_default_is_tmp_per_uid(env):
    loc = resolve_runtime()
    assert loc.directory == DEFAULT_DIR
    assert loc.socket_path == DEFAULT_DIR / "h5serve.sock"


def test_explicit_beats_everything(env, short_tmp):
    xdg = private_dir(short_tmp / "xdg")
    env.setenv("XDG_RUNTIME_DIR", str(xdg))
    env.setenv("H5SERVE_RUNTIME_DIR", str(short_tmp / "fromenv"))
    assert resolve_runtime(short_tmp / "explicit").directory == short_tmp / "explicit"
    assert resolve_runtime(str(short_tmp / "explicit2")).directory == short_tmp / "explicit2"


def test_env_beats_xdg(env, short_tmp):
    xdg = private_dir(short_tmp / "xdg")
    env.setenv("XDG_RUNTIME_DIR", str(xdg))
    env.setenv("H5SERVE_RUNTIME_DIR", str(short_tmp / "fromenv"))
    assert resolve_runtime().directory == short_tmp / "fromenv"
    assert resolve_runtime(None).directory == short_tmp / "fromenv"


def test_empty_explicit_falls_through_to_env(env, short_tmp):
    env.setenv("H5SERVE_RUNTIME_DIR", str(short_tmp / "fromenv"))
    assert resolve_runtime("").directory == short_tmp / "fromenv"


def test_empty_env_falls_through(env, short_tmp):
    env.setenv("H5SERVE_RUNTIME_DIR", "")
    assert resolve_runtime().directory == DEFAULT_DIR
    xdg = private_dir(short_tmp / "xdg")
    env.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert resolve_runtime().directory == xdg / "h5serve"


def test_private_xdg_is_used(env, short_tmp):
    xdg = private_dir(short_tmp / "xdg")
    env.setenv("XDG_RUNTIME_DIR", str(xdg))
    loc = resolve_runtime()
    assert loc.directory == xdg / "h5serve"
    assert not loc.directory.exists()  # resolving never creates


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o701, 0o710, 0o777, 0o1777])
def test_xdg_not_private_is_ignored(env, short_tmp, mode):
    xdg = short_tmp / "xdg"
    xdg.mkdir()
    os.chmod(xdg, mode)
    env.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert resolve_runtime().directory == DEFAULT_DIR


def test_xdg_missing_is_ignored(env, short_tmp):
    env.setenv("XDG_RUNTIME_DIR", str(short_tmp / "does-not-exist"))
    assert resolve_runtime().directory == DEFAULT_DIR


def test_xdg_that_is_a_file_is_ignored(env, short_tmp):
    f = short_tmp / "file"
    f.write_text("x")
    os.chmod(f, 0o600)
    env.setenv("XDG_RUNTIME_DIR", str(f))
    assert resolve_runtime().directory == DEFAULT_DIR


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
def test_xdg_owned_by_someone_else_is_ignored(env, short_tmp):
    xdg = private_dir(short_tmp / "xdg")
    os.chown(xdg, 65534, 65534)
    env.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert resolve_runtime().directory == DEFAULT_DIR


def test_relative_runtime_dir_is_made_absolute(env, short_tmp):
    env.chdir(short_tmp)
    loc = resolve_runtime("rel/dir")
    assert loc.directory.is_absolute()
    assert loc.directory == short_tmp / "rel" / "dir"
    env.setenv("H5SERVE_RUNTIME_DIR", "other")
    assert resolve_runtime().directory == short_tmp / "other"


def test_runtime_dir_is_normalised(env, short_tmp):
    assert resolve_runtime(f"{short_tmp}/a/../b/./").directory == short_tmp / "b"


def test_socket_path_length_limit(env):
    # socket path = dir + "/h5serve.sock" (13 chars)
    ok_dir = "/" + "a" * (MAX_IPC_PATH - len("/h5serve.sock") - 1)
    loc = resolve_runtime(ok_dir)
    assert len(str(loc.socket_path)) == MAX_IPC_PATH == 107
    too_long = ok_dir + "b"
    with pytest.raises(ConfigError, match="too long"):
        resolve_runtime(too_long)


def test_socket_path_length_limit_from_env(env):
    env.setenv("H5SERVE_RUNTIME_DIR", "/" + "x" * 200)
    with pytest.raises(ConfigError, match="107"):
        resolve_runtime()


def test_relative_dir_counts_absolute_length(env, short_tmp):
    env.chdir(short_tmp)
    rel = "r" * (MAX_IPC_PATH - len("/h5serve.sock"))  # short as given, too long once absolute
    assert len(rel + "/h5serve.sock") <= MAX_IPC_PATH
    with pytest.raises(ConfigError):
        resolve_runtime(rel)


# --------------------------------------------------------------------------- ensure_runtime_dir


def test_ensure_creates_private_dir_with_parents(short_tmp):
    loc = RuntimeLocation(short_tmp / "a" / "b" / "run")
    os.close(ensure_runtime_dir(loc))
    st = loc.directory.stat()
    assert stat.S_ISDIR(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.getuid()


def test_ensure_creates_0700_even_with_permissive_umask(short_tmp):
    old = os.umask(0)
    try:
        loc = RuntimeLocation(short_tmp / "run")
        os.close(ensure_runtime_dir(loc))
    finally:
        os.umask(old)
    assert stat.S_IMODE(loc.directory.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o755, 0o777, 0o750, 0o701])
def test_ensure_tightens_existing_dir(short_tmp, mode):
    d = short_tmp / "run"
    d.mkdir()
    os.chmod(d, mode)
    (d / "keep").write_text("data")
    os.close(ensure_runtime_dir(RuntimeLocation(d)))
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert (d / "keep").read_text() == "data"  # existing contents untouched


def test_ensure_is_idempotent(short_tmp):
    loc = RuntimeLocation(short_tmp / "run")
    os.close(ensure_runtime_dir(loc))
    os.close(ensure_runtime_dir(loc))
    assert stat.S_IMODE(loc.directory.stat().st_mode) == 0o700


def test_ensure_on_a_file_is_config_error(short_tmp):
    f = short_tmp / "run"
    f.write_text("not a dir")
    with pytest.raises(ConfigError, match="it is not a directory"):
        os.close(ensure_runtime_dir(RuntimeLocation(f)))


def test_ensure_refuses_a_symlinked_runtime_dir(short_tmp):
    """A symlink planted at the runtime dir (e.g. /tmp/h5serve-$UID -> somewhere) is never followed."""
    target = short_tmp / "elsewhere"
    target.mkdir(mode=0o755)
    (short_tmp / "run").symlink_to(target)
    with pytest.raises(ConfigError, match="it is a symbolic link"):
        os.close(ensure_runtime_dir(RuntimeLocation(short_tmp / "run")))
    assert stat.S_IMODE(target.stat().st_mode) == 0o755  # not chmod-ed through the link


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
def test_ensure_foreign_owner_is_config_error(short_tmp):
    d = short_tmp / "run"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        os.close(ensure_runtime_dir(RuntimeLocation(d)))


def test_resolved_private_xdg_dir_round_trips_through_ensure(env, short_tmp):
    xdg = private_dir(short_tmp / "xdg")
    env.setenv("XDG_RUNTIME_DIR", str(xdg))
    loc = resolve_runtime()
    os.close(ensure_runtime_dir(loc))
    assert loc.directory.is_dir()
    assert stat.S_IMODE(loc.directory.stat().st_mode) == 0o700


# --------------------------------------------------------------------------- resolve_shm_dir


def test_shm_dir_default(env):
    assert resolve_shm_dir() == Path("/dev/shm")
    assert resolve_shm_dir("") == Path("/dev/shm")


def test_shm_dir_env(env, short_tmp):
    env.setenv("H5SERVE_SHM_DIR", str(short_tmp / "shm"))
    assert resolve_shm_dir() == short_tmp / "shm"
    assert resolve_shm_dir(None) == short_tmp / "shm"


def test_shm_dir_explicit_beats_env(env, short_tmp):
    env.setenv("H5SERVE_SHM_DIR", str(short_tmp / "shm"))
    assert resolve_shm_dir(short_tmp / "explicit") == short_tmp / "explicit"
    assert resolve_shm_dir(str(short_tmp / "explicit")) == short_tmp / "explicit"


def test_shm_dir_empty_env_is_default(env):
    env.setenv("H5SERVE_SHM_DIR", "")
    assert resolve_shm_dir() == Path("/dev/shm")


def test_shm_dir_relative_is_made_absolute(env, short_tmp):
    env.chdir(short_tmp)
    assert resolve_shm_dir("shm") == short_tmp / "shm"
    env.setenv("H5SERVE_SHM_DIR", "envshm")
    assert resolve_shm_dir() == short_tmp / "envshm"


# --------------------------------------------------------------------------- daemon_lock_held

LOCKER = """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX if sys.argv[2] == "ex" else fcntl.LOCK_SH)
    print("locked", flush=True)
    time.sleep(60)  # holds the lock until the test kills it
"""


def start_locker(pidfile, kind):
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(LOCKER), str(pidfile), kind],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready, _, _ = select.select([proc.stdout], [], [], 10)
    line = proc.stdout.readline().strip() if ready else ""
    if line != "locked":
        stop(proc)
        raise AssertionError(f"locker did not start: {line!r}")
    return proc


def stop(proc):
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=5)
    proc.stdout.close()
    proc.stderr.close()


def test_lock_not_held_without_pidfile(short_tmp):
    loc = RuntimeLocation(short_tmp)
    assert not loc.pidfile.exists()
    assert daemon_lock_held(loc) is False
    assert daemon_lock_held(RuntimeLocation(short_tmp / "missing-dir")) is False


def test_lock_not_held_with_stale_pidfile(short_tmp):
    loc = RuntimeLocation(short_tmp)
    loc.pidfile.write_text("999999\n")
    assert daemon_lock_held(loc) is False


def test_lock_held_only_while_a_process_holds_it(short_tmp):
    loc = RuntimeLocation(short_tmp)
    proc = start_locker(loc.pidfile, "ex")
    try:
        assert daemon_lock_held(loc) is True
        assert daemon_lock_held(loc) is True  # asking does not disturb the holder
    finally:
        stop(proc)
    assert loc.pidfile.exists()  # the dead daemon's pidfile remains ...
    assert daemon_lock_held(loc) is False  # ... but its lock went with it


def test_shared_lock_is_not_the_daemon_lock(short_tmp):
    loc = RuntimeLocation(short_tmp)
    proc = start_locker(loc.pidfile, "sh")
    try:
        assert daemon_lock_held(loc) is False
    finally:
        stop(proc)


def test_lock_held_in_same_process_on_another_fd(short_tmp):
    loc = RuntimeLocation(short_tmp)
    fd = os.open(loc.pidfile, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert daemon_lock_held(loc) is True
        fcntl.flock(fd, fcntl.LOCK_UN)
        assert daemon_lock_held(loc) is False
    finally:
        os.close(fd)


def test_checking_leaves_no_lock_behind(short_tmp):
    loc = RuntimeLocation(short_tmp)
    loc.pidfile.write_text("")
    assert daemon_lock_held(loc) is False
    fd = os.open(loc.pidfile, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the check leaked its lock
    finally:
        os.close(fd)
