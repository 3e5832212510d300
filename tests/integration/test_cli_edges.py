"""Environment problems at ``h5serve start``/``stop``/``status``, provoked for real: each ends
with exit 1 (3 for ``status`` with no daemon), a message that names the fix, and no traceback."""

from __future__ import annotations

import os
import resource
import shutil
import socket
import subprocess
import sys

import pytest

from ..helpers import Daemon, h5serve_cli, kill_daemon_of, short_tmpdir
from ..users import PortablePython, root_only, throwaway_user


def _no_traceback(done: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout, done.stderr


def _dead_pid() -> int:
    """A pid that belonged to a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    return child.pid


def test_a_directory_in_the_sockets_place_is_named_and_removing_it_is_the_fix() -> None:
    d = Daemon()
    try:
        d.runtime_dir.mkdir(mode=0o700)
        (d.runtime_dir / "h5serve.sock").mkdir()
        for args in (["start"], ["start", "--foreground"]):
            done = h5serve_cli(*args, env=d.env)
            assert done.returncode == 1, done
            _no_traceback(done)
            assert f"remove {d.runtime_dir / 'h5serve.sock'}" in done.stderr, done.stderr
            assert (d.runtime_dir / "h5serve.sock").is_dir()  # nothing of the user's was removed
        (d.runtime_dir / "h5serve.sock").rmdir()  # the fix the message names
        d.start()
        assert d.status()["running"] is True
    finally:
        d.stop()


@pytest.mark.parametrize("foreground", [True, False], ids=["foreground", "background"])
def test_too_low_an_open_file_limit_says_raise_it(foreground: bool) -> None:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    d = Daemon()
    try:
        done = subprocess.run([sys.executable, "-m", "h5serve", "start", *(["--foreground"] if foreground else [])],
                              env=d.env, capture_output=True, text=True, timeout=60, preexec_fn=limit)
        assert done.returncode == 1, done
        _no_traceback(done)
        assert "at most 64 files" in done.stderr and "raise the open-file limit" in done.stderr, done.stderr
        assert not (d.runtime_dir / "h5serve.sock").exists()
    finally:
        kill_daemon_of(d.runtime_dir)
        d.stop()


def test_a_runtime_dir_of_another_user_is_refused_with_what_to_do() -> None:
    where = short_tmpdir("h5s-edge-")
    try:
        theirs = where / "rt"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)  # nobody's
        env = {**os.environ, "H5SERVE_RUNTIME_DIR": str(theirs)}
        start = h5serve_cli("start", env=env)
        assert start.returncode == 1 and "belongs to uid 65534" in start.stderr, start
        assert "choose another --runtime-dir" in start.stderr
        stop = h5serve_cli("stop", env=env)
        assert stop.returncode == 1 and "set H5SERVE_RUNTIME_DIR" in stop.stderr, stop
        status = h5serve_cli("status", env=env)
        assert status.returncode == 3 and "set H5SERVE_RUNTIME_DIR" in status.stdout, status
        for done in (start, stop, status):
            _no_traceback(done)
        assert os.listdir(theirs) == []  # nothing made in someone else's dir
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_a_runtime_dir_under_a_file() -> None:
    where = short_tmpdir("h5s-edge-")
    try:
        (where / "file").write_text("")
        env = {**os.environ, "H5SERVE_RUNTIME_DIR": str(where / "file" / "rt")}
        start = h5serve_cli("start", env=env)
        assert start.returncode == 1 and "Not a directory" in start.stderr, start
        assert "choose another --runtime-dir" in start.stderr
        stop = h5serve_cli("stop", env=env)
        assert stop.returncode == 0 and "no h5serve daemon running" in stop.stdout, stop
        status = h5serve_cli("status", env=env)
        assert status.returncode == 3 and "start one with `h5serve start`" in status.stdout, status
        for done in (start, stop, status):
            _no_traceback(done)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_a_pidfile_naming_a_dead_pid_and_a_stale_socket() -> None:
    """What a daemon killed with SIGKILL leaves: nothing runs, and start takes the dir over."""
    d = Daemon()
    try:
        d.runtime_dir.mkdir(mode=0o700)
        dead = _dead_pid()
        (d.runtime_dir / "h5serve.pid").write_text(f"{dead}\n")
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(str(d.runtime_dir / "h5serve.sock"))
        stale.close()  # the socket file stays; nothing listens on it
        status = h5serve_cli("status", env=d.env)
        assert status.returncode == 3 and "start one with `h5serve start`" in status.stdout, status
        stop = h5serve_cli("stop", env=d.env)
        assert stop.returncode == 0 and "no h5serve daemon running" in stop.stdout, stop
        for done in (status, stop):
            _no_traceback(done)
        d.start()
        assert d.pid != dead and d.status()["pid"] == d.pid
    finally:
        d.stop()


def test_stop_and_status_where_nothing_ever_ran() -> None:
    d = Daemon()
    try:
        stop = h5serve_cli("stop", env=d.env)
        assert stop.returncode == 0 and f"no h5serve daemon running on {d.runtime_dir}" in stop.stdout, stop
        status = h5serve_cli("status", env=d.env)
        assert status.returncode == 3 and "start one with `h5serve start`" in status.stdout, status
        for done in (stop, status):
            _no_traceback(done)
        assert not d.runtime_dir.exists()  # stop and status never create the dir
    finally:
        d.stop()


def test_output_to_a_reader_that_went_away_is_quiet() -> None:
    """`h5serve status | head -0`: the pipe closes before h5serve writes; no traceback."""
    d = Daemon()
    try:
        process = subprocess.Popen([sys.executable, "-m", "h5serve", "status"], env=d.env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        assert process.stdout is not None and process.stderr is not None
        process.stdout.close()  # long before the interpreter has started and imported h5serve
        try:
            err = process.stderr.read()
            assert process.wait(timeout=60) == 1
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        assert err == ""
    finally:
        d.stop()


@root_only
def test_a_log_file_the_user_may_not_write(py: PortablePython) -> None:
    """A daemon user whose log in the runtime dir is read-only (e.g. left by a `chmod`): start
    names the file and the fix, and the fix works."""
    with throwaway_user() as user:
        where = short_tmpdir("h5s-edge-")
        runtime = where / "rt"
        try:
            where.chmod(0o755)
            runtime.mkdir(mode=0o700)
            log = runtime / "h5serve.log"
            log.write_text("")
            log.chmod(0o400)
            for path in (runtime, log):
                os.chown(path, user.uid, user.gid)
            done = py.run("start", "--runtime-dir", str(runtime), user=user)
            assert done.returncode == 1, done
            _no_traceback(done)
            assert "cannot open h5serve.log: Permission denied" in done.stderr, done.stderr
            assert "remove it from the runtime dir" in done.stderr
            log.unlink()  # the fix the message names
            started = py.run("start", "--runtime-dir", str(runtime), user=user)
            assert started.returncode == 0, started
            assert py.run("stop", "--runtime-dir", str(runtime), user=user).returncode == 0
        finally:
            kill_daemon_of(runtime)
            shutil.rmtree(where, ignore_errors=True)
