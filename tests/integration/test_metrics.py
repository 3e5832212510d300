"""Prometheus metrics scraped from a real daemon over HTTP, and the node_exporter textfile:
what they show (no file paths or keys unless --metrics-paths, for other users too) and that
a flood of idle connections to the endpoint neither takes the daemon's descriptors nor stops it."""

from __future__ import annotations

import os
import re
import resource
import socket
import stat
import time
import urllib.request
from pathlib import Path

import pytest

from h5serve.client import SharedH5Dataset
from h5serve.daemon.metrics_http import CONNECTION_TIMEOUT_S, MAX_CONNECTIONS

from ..helpers import Daemon, h5serve_cli, make_h5, short_tmpdir, short_workdir, start_with_files, wait_for
from ..users import as_user, root_only, throwaway_user


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def test_metrics_endpoint_and_textfile(h5file: Path) -> None:
    textfile_dir = short_tmpdir("h5s-prom-")
    d = Daemon("--metrics-port", "0", "--metrics-textfile", str(textfile_dir), "--metrics-paths")
    try:
        d.start()
        port = d.status()["metrics_port"]
        assert isinstance(port, int) and port > 0
        first = scrape(port)
        assert 'h5serve_build_info{python=' in first and "h5serve_loads_total 0.0" in first
        ds = SharedH5Dataset(h5file, "x", "y", rank=0, world_size=2, runtime_dir=d.runtime_dir, fallback="error")
        SharedH5Dataset(h5file, "x", "y", rank=0, world_size=2, runtime_dir=d.runtime_dir)

        def loaded() -> bool:  # the snapshot is refreshed at most every SNAPSHOT_INTERVAL_S: wait for it
            text = scrape(port)
            hits = re.search(r"^h5serve_hits_total (\S+)$", text, re.M)
            return "h5serve_loads_total 2.0" in text and hits is not None and float(hits.group(1)) >= 2

        assert wait_for(loaded, 10, 0.2)
        text = scrape(port)
        assert 'h5serve_segments{state="ready"} 2.0' in text
        # --metrics-paths: the file and key are labels (beside the opaque segment id)
        assert re.search(rf'h5serve_segment_bytes{{dtype="uint8",file="{h5file}",key="x",mode="contiguous",rank="0",'
                         r'segment="[0-9a-f]{16}"', text)
        assert "h5serve_load_seconds_count 2.0" in text and "h5serve_load_seconds_bucket" in text
        for name in ("h5serve_evictions_total", "h5serve_refusals_total", "h5serve_memory_budget_bytes",
                     "h5serve_load_errors_total", "h5serve_damaged_total", "h5serve_stalled_total"):
            assert name in text
        assert float(re.search(r"^h5serve_hits_total (\S+)$", text, re.M).group(1)) >= 2
        ds.close()
        assert h5serve_cli("stop", env=d.env).returncode == 0
        prom = (textfile_dir / "h5serve.prom").read_text()  # written once more on the way out
        assert "h5serve_loads_total 2.0" in prom and 'h5serve_segments{state="ready"} 0.0' in prom
        assert [p.name for p in textfile_dir.iterdir()] == ["h5serve.prom"]  # no temp files left
    finally:
        d.stop()
        for p in textfile_dir.iterdir():
            p.unlink()
        textfile_dir.rmdir()


def test_port_in_use_is_a_clear_error() -> None:
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    d = Daemon()
    try:
        done = h5serve_cli("start", "--metrics-port", str(busy.getsockname()[1]), env=d.env)
        assert done.returncode == 1 and "choose another --metrics-port" in done.stderr
    finally:
        busy.close()
        d.stop()


def _loaded_once(port: int) -> bool:
    return "h5serve_loads_total 1.0" in scrape(port)


@root_only
def test_other_users_see_no_path_or_key_by_default() -> None:
    """A local user with no access to the daemon reads the endpoint and the textfile: the
    segment is there (an opaque id, its size), its file and key are not."""
    with short_workdir("h5s-mp-") as work, throwaway_user() as other:
        data = work / "private-project-QX7"
        data.mkdir(mode=0o700)
        source = make_h5(data / "patients-QX7.h5", rows=64)
        prom_dir = work / "prom"
        prom_dir.mkdir()
        os.chmod(work, 0o755)
        os.chmod(prom_dir, 0o755)
        d = Daemon("--metrics-port", "0", "--metrics-textfile", str(prom_dir))
        try:
            d.start()
            port = d.status()["metrics_port"]
            SharedH5Dataset(source, "group/nested/x", rank=0, world_size=1, runtime_dir=d.runtime_dir,
                            fallback="error").close()
            assert wait_for(lambda: _loaded_once(port), 10, 0.2)
            assert wait_for(lambda: "h5serve_loads_total 1.0" in (prom_dir / "h5serve.prom").read_text(), 30, 0.2)
            status, seen = as_user(other, lambda: scrape(port) + (prom_dir / "h5serve.prom").read_text())
            assert status == "ok", seen
            assert isinstance(seen, str) and 'h5serve_segments{state="ready"} 1.0' in seen
            assert re.search(r'h5serve_segment_bytes{dtype="uint8",mode="contiguous",rank="0",segment="[0-9a-f]{16}"',
                             seen)
            for secret in ("QX7", "patients", "private-project", "nested", str(work)):
                assert secret not in seen
            assert stat.S_IMODE((prom_dir / "h5serve.prom").stat().st_mode) == 0o644  # nothing secret in it
        finally:
            d.stop()


def test_metrics_paths_textfile_is_for_the_daemons_group_only(h5file: Path) -> None:
    with short_workdir("h5s-mp-") as prom_dir:
        d = Daemon("--metrics-textfile", str(prom_dir), "--metrics-paths")
        try:
            d.start()
            SharedH5Dataset(h5file, "x", rank=0, world_size=1, runtime_dir=d.runtime_dir, fallback="error").close()
            prom = prom_dir / "h5serve.prom"
            assert wait_for(lambda: f'file="{h5file}"' in prom.read_text(), 30, 0.2)  # written every 10 s
            st = prom.stat()
            assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_gid == os.getegid()
        finally:
            d.stop()


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _open_sockets(pid: int) -> int:
    """The daemon's socket descriptors (a spare loader started meanwhile adds pipes, no socket)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile
            pass
    return count


def _idle_connections(port: int, count: int, deadline: float) -> list[socket.socket]:
    """``count`` TCP connections to loopback ``port`` that send nothing (non-blocking connects:
    those the kernel queues or drops are not waited for), opened within ``deadline`` seconds."""
    socks: list[socket.socket] = []
    stop = time.monotonic() + deadline
    try:
        while len(socks) < count and time.monotonic() < stop:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            socks.append(s)
            try:
                s.connect(("127.0.0.1", port))
            except (BlockingIOError, InterruptedError):
                pass
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def test_2000_idle_connections_leave_the_daemon_serving(h5file: Path) -> None:
    """At a hard limit of 1,024 open files, 2,000 idle connections to the metrics port: the
    daemon never holds more than its connection bound on their account (far from the ZeroMQ
    guard's reserve), answers ping and a scrape while they are open, and after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2200:
        pytest.skip(f"this process may open only {hard} files: 2,000 connections need more")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2200), hard))
    d = Daemon("--metrics-port", "0")
    socks: list[socket.socket] = []
    try:
        start_with_files(d, 1024, 1024)
        port = d.status()["metrics_port"]
        SharedH5Dataset(h5file, "x", rank=0, world_size=1, runtime_dir=d.runtime_dir, fallback="error").close()
        before, files_before = _open_sockets(d.pid), _open_fds(d.pid)
        socks = _idle_connections(port, 2000, 60)
        assert len(socks) == 2000
        most, most_files = before, files_before
        for _ in range(20):  # while they arrive and wait: the daemon's descriptors stay bounded
            most, most_files = max(most, _open_sockets(d.pid)), max(most_files, _open_fds(d.pid))
            time.sleep(0.05)
        assert most <= before + MAX_CONNECTIONS, (before, most)
        assert most_files < 1024 - 256  # the ZeroMQ connection guard sheds clients above limit - reserve
        assert d.alive() and h5serve_cli("status", env=d.env, timeout=30).returncode == 0
        assert "h5serve_loads_total 1.0" in scrape(port)  # a scraper gets in while the flood holds on
        for s in socks:
            s.close()
        socks = []
        assert wait_for(lambda: _open_sockets(d.pid) <= before + 1, CONNECTION_TIMEOUT_S + 10, 0.2)
        assert d.alive() and h5serve_cli("status", env=d.env, timeout=30).returncode == 0
        assert "h5serve_loads_total 1.0" in scrape(port)
    finally:
        for s in socks:
            s.close()
        d.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
