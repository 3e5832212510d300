"""The daemon's sd_notify messages, received on a real datagram socket set as NOTIFY_SOCKET."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from h5serve.client import SharedH5Dataset

from ..helpers import Daemon, make_h5, short_tmpdir


def receive(sock: socket.socket, until: str, timeout: float) -> list[str]:
    messages: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            messages.append(sock.recv(4096).decode())
        except TimeoutError:
            break
        if until in messages[-1]:
            break
    return messages


@pytest.fixture
def notify_socket() -> tuple[socket.socket, Path]:
    d = short_tmpdir("h5s-notify-")
    path = d / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    yield sock, path
    sock.close()
    path.unlink(missing_ok=True)
    d.rmdir()


@pytest.mark.parametrize("watchdog_pid", ["", "1"])
def test_ready_status_watchdog_stopping(notify_socket, tmp_path: Path, watchdog_pid: str) -> None:
    sock, path = notify_socket
    d = Daemon()
    env = {**d.env, "NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000"}
    if watchdog_pid:
        env["WATCHDOG_PID"] = watchdog_pid  # another process's watchdog: we must not pet it
    process = subprocess.Popen([sys.executable, "-m", "h5serve", "start", "--foreground"], env=env,
                               stderr=subprocess.DEVNULL)
    try:
        first = receive(sock, "READY=1", 30)
        assert first and "READY=1" in first[-1] and "STATUS=0 segments ready" in first[-1]
        h5 = make_h5(tmp_path / "n.h5")
        SharedH5Dataset(h5, "x", runtime_dir=d.runtime_dir, fallback="error")
        later = receive(sock, "never", 1.5)
        assert "EXTEND_TIMEOUT_USEC=30000000" in later + first  # sent as the load started
        watchdogs = [m for m in later if m == "WATCHDOG=1"]
        if watchdog_pid:
            assert watchdogs == []
        else:
            assert len(watchdogs) >= 5  # every 100 ms (half of WATCHDOG_USEC)
        assert any(m.startswith("STATUS=1 segments ready") for m in later + first)
        process.send_signal(signal.SIGTERM)
        assert any("STOPPING=1" in m for m in receive(sock, "STOPPING=1", 20))
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        d.stop()


def test_idle_exit_says_stopping_and_exits_0(notify_socket, tmp_path: Path) -> None:
    """--idle-exit under Type=notify: READY=1, then, unused, STOPPING=1 with the reason in STATUS=,
    segments unlinked and exit status 0 (Restart=on-failure leaves it stopped)."""
    sock, path = notify_socket
    d = Daemon()
    env = {**d.env, "NOTIFY_SOCKET": str(path)}
    process = subprocess.Popen([sys.executable, "-m", "h5serve", "start", "--foreground", "--idle-exit", "1"],
                               env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert any("READY=1" in m for m in receive(sock, "READY=1", 30))
        SharedH5Dataset(make_h5(tmp_path / "idle.h5"), "x", runtime_dir=d.runtime_dir, fallback="error").close()
        assert len(d.segment_files()) == 1
        stopping = [m for m in receive(sock, "STOPPING=1", 30) if "STOPPING=1" in m]
        assert stopping and "STATUS=stopping (idle for " in stopping[0] and "--idle-exit 1)" in stopping[0], stopping
        assert process.wait(timeout=30) == 0
        assert "(--idle-exit 1): exiting" in process.stderr.read()
        assert d.segment_files() == [] and not (d.runtime_dir / "h5serve.sock").exists()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        d.stop()


def test_abstract_socket_address_and_no_socket_is_silent() -> None:
    from h5serve.daemon.notify import Notifier

    name = f"h5serve-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    try:
        notifier = Notifier({"NOTIFY_SOCKET": "@" + name})
        notifier.ready("up")
        sock.settimeout(5)
        assert sock.recv(100) == b"READY=1\nSTATUS=up"
    finally:
        sock.close()
    quiet = Notifier({})
    assert not quiet.enabled
    quiet.ready("nobody listens")  # a no-op, no error
