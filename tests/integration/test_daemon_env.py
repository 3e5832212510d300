"""Where the daemon's processes start from: never the directory `h5serve start` ran in (another
user's modules there are never imported), never the main module of whatever started it again
in a loader, and a loader that dies leaves its exit code and its last words in the daemon log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from h5serve.client import SharedH5Dataset
from h5serve.wire.connection import DaemonClient
from h5serve.wire.protocol import Acquire

from ..helpers import Daemon, descendant_pids, make_h5, short_workdir, wait_for
from ..users import root_only, throwaway_user

PLANTED = ("msgpack", "numpy", "h5py", "zmq")


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _load(path: Path, runtime_dir: Path) -> None:
    SharedH5Dataset(path, "x", rank=0, world_size=1, runtime_dir=runtime_dir, fallback="error").close()


def _wait_for_spare(pid: int) -> int:
    found: list[int] = []
    assert wait_for(lambda: bool(found.extend(p for p in descendant_pids(pid) if _comm(p) == "h5serve-spare") or found),
                    30, 0.1), "no spare loader was started"
    return found[0]


@pytest.fixture
def trap_dir() -> Iterator[Path]:
    """A directory a throwaway user owns, holding the modules the daemon imports: each, when
    imported, leaves a marker there (and then fails, as a broken shadow would)."""
    with short_workdir("h5s-trap-") as work, throwaway_user() as attacker:
        os.chmod(work, 0o755)
        trap = work / "trap"
        trap.mkdir()
        for name in PLANTED:
            (trap / f"{name}.py").write_text(
                f"open({str(trap / ('imported-' + name))!r}, 'w').close()\n"
                f"raise ImportError('planted {name} imported')\n")
        for path in (trap, *trap.iterdir()):
            os.chown(path, attacker.uid, attacker.gid)
        os.chmod(trap, 0o755)
        yield trap


def _markers(trap: Path) -> list[str]:
    return sorted(p.name for p in trap.iterdir() if p.name.startswith("imported-"))


def _assert_started_from_root(pid: int) -> None:
    processes = [pid, *descendant_pids(pid)]
    assert len(processes) >= 3  # the daemon, its forkserver, a spare loader at least
    for p in processes:
        assert os.readlink(f"/proc/{p}/cwd") == "/", (p, _comm(p))


@root_only
def test_start_in_another_users_directory_imports_nothing_from_it(trap_dir: Path, tmp_path: Path) -> None:
    """Root runs `h5serve start` (daemonizing) in the attacker's directory and loads: no
    module of theirs is imported by the CLI, the daemon, its forkserver or a loader."""
    source = make_h5(tmp_path / "data.h5")
    d = Daemon()
    try:
        done = subprocess.run([sys.executable, "-m", "h5serve", "start"], env=d.env, cwd=trap_dir,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        d.pid = int((d.runtime_dir / "h5serve.pid").read_text())
        _load(source, d.runtime_dir)
        _wait_for_spare(d.pid)  # a loader was forked after the load, too
        assert _markers(trap_dir) == []
        _assert_started_from_root(d.pid)
    finally:
        d.stop()
    assert _markers(trap_dir) == []


@root_only
def test_foreground_start_in_another_users_directory_imports_nothing_from_it(trap_dir: Path, tmp_path: Path) -> None:
    source = make_h5(tmp_path / "data.h5")
    d = Daemon()
    daemon = subprocess.Popen([sys.executable, "-m", "h5serve", "start", "--foreground"], env=d.env, cwd=trap_dir,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        pidfile = d.runtime_dir / "h5serve.pid"
        assert wait_for(lambda: pidfile.exists() and d.cli("status").returncode == 0, 60, 0.1), _stderr_of(daemon)
        d.pid = daemon.pid
        _load(source, d.runtime_dir)
        _wait_for_spare(d.pid)
        assert _markers(trap_dir) == []
        _assert_started_from_root(d.pid)
    finally:
        d.stop()
        daemon.kill()
        daemon.wait(timeout=30)
    assert _markers(trap_dir) == []


def _stderr_of(process: subprocess.Popen[str]) -> str:
    if process.poll() is None:
        process.kill()
    return process.communicate(timeout=30)[1]


def test_a_wrapper_without_a_main_guard_loses_no_load(tmp_path: Path) -> None:
    """`h5serve start --foreground` from a script that calls the CLI at module level (a site's
    entry script, a container's): loaders never run the script again, loads succeed."""
    source = make_h5(tmp_path / "data.h5")
    d = Daemon()
    wrapper = tmp_path / "run_h5serve.py"
    wrapper.write_text("import sys\nfrom h5serve.cli import main\n"
                       f"sys.exit(main(['start', '--foreground', '--runtime-dir', {str(d.runtime_dir)!r}]))\n")
    daemon = subprocess.Popen([sys.executable, str(wrapper)], env=d.env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: d.cli("status").returncode == 0, 60, 0.1), _stderr_of(daemon)
        d.pid = daemon.pid
        _load(source, d.runtime_dir)  # fallback="error": raises if the load failed
        for rank in range(2):  # more loaders: a spare and one of its own
            SharedH5Dataset(source, "x", "y", rank=rank, world_size=2, runtime_dir=d.runtime_dir,
                            fallback="error").close()
        assert all(s["state"] == "ready" for s in d.status()["segments"])
    finally:
        d.stop()
        daemon.kill()
        stderr = daemon.communicate(timeout=30)[1]
    assert "nothing to do" not in stderr and "died" not in stderr


def test_a_loader_that_dies_leaves_its_exit_code_and_last_words_in_the_log(tmp_path: Path) -> None:
    """A loader killed by a signal after writing to its stderr (faulthandler's report of a
    SIGSEGV): the load's error quotes its exit code and last line, the daemon log has both."""
    source = make_h5(tmp_path / "data.h5")
    d = Daemon()
    d.env["PYTHONFAULTHANDLER"] = "1"  # the forkserver, and so every loader, reports fatal signals
    spare = 0
    try:
        d.start()
        _load(source, d.runtime_dir)
        spare = _wait_for_spare(d.pid)
        os.kill(spare, signal.SIGSTOP)  # it will be the next load's loader, and not run it
        request = Acquire(str(source), "y", 1, 0, "contiguous", None, 1)
        with DaemonClient(d.runtime_dir) as client:
            assert client.request(request)["state"] == "loading"
            os.kill(spare, signal.SIGSEGV)
            os.kill(spare, signal.SIGCONT)
            errors: list[str] = []

            def failed() -> bool:
                try:
                    client.request(request)
                except Exception as exc:  # noqa: BLE001 - the load's error is what we wait for
                    errors.append(str(exc))
                    return True
                return False

            assert wait_for(failed, 30, 0.1)
        message = errors[0]
        assert "the loader process died (exit code -11): " in message, message
        last_line = message.split("(exit code -11): ", 1)[1].rsplit("; see the daemon log", 1)[0]
        log = (d.runtime_dir / "h5serve.log").read_text()
        assert f"(pid {spare}) died (exit code -11); its stderr ended:" in log
        assert "  | Fatal Python error: Segmentation fault" in log and f"  | {last_line}" in log
    finally:
        if spare:
            try:
                os.kill(spare, signal.SIGKILL)
            except ProcessLookupError:
                pass
        d.stop()
