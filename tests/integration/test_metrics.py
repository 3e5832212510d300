"""Prometheus metrics scraped from a real daemon over HTTP, and the node_exporter textfile."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

from h5serve.client import SharedH5Dataset

from ..helpers import Daemon, h5serve_cli, short_tmpdir, wait_for


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def test_metrics_endpoint_and_textfile(h5file: Path) -> None:
    textfile_dir = short_tmpdir("h5s-prom-")
    d = Daemon("--metrics-port", "0", "--metrics-textfile", str(textfile_dir))
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
        assert f'h5serve_segment_bytes{{dtype="uint8",file="{h5file}",key="x",mode="contiguous",rank="0",' in text
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
