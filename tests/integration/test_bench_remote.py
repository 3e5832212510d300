"""The ``remote`` bench group (bench/remote.py) stays runnable and measures what it says: a
``--quick`` run against its loopback S3 server (moto in a subprocess), its output checked for
the fields and sane values (every row once, GET bytes about the object once per node, the bare
download all of it), never for speed. Skipped where moto[server] or s3fs is missing; the peers'
run where their interpreter (``.venv-peers``, or ``H5SERVE_PEERS_PYTHON``) is missing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ..helpers import output_or_kill

pytest.importorskip("moto.server", reason="moto[server] is not installed: pip install -e '.[test]'")
pytest.importorskip("s3fs", reason="s3fs is not installed: pip install -e '.[s3]'")

ROOT = Path(__file__).resolve().parents[2]


def run_group(tmp_path: Path, parts: str, deadline: float) -> tuple[dict, str]:
    """``python -m bench.remote --quick --parts PARTS``: its JSON report and stdout. On the
    deadline it and everything it started (torchrun, its ranks, the S3 server) are killed."""
    out = tmp_path / "remote.json"
    cmd = [sys.executable, "-m", "bench.remote", "--quick", "--parts", parts, "--data-dir", str(tmp_path / "data"),
           "--json", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    stdout = output_or_kill(proc, deadline)
    assert proc.returncode == 0 and out.exists(), stdout[-4000:]
    return json.loads(out.read_text()), stdout


def passed(job: dict, size: int, most: float = 1.1) -> None:
    """A cold 2-rank epoch: ran, every row once with its bytes, the object fetched about once
    (at most ``most`` times its size)."""
    assert "failed" not in job, job["failed"]
    checks = job["checks"]
    assert checks["failed"] == [] and checks["missing_on_node"] == 0, checks
    assert checks["samples"] * 2 >= checks["rows"] and checks["bytes_checked"] > 0, checks
    assert 0 < job["first_s"] <= job["epoch_s"]
    assert 0.99 <= job["get_bytes"] / size <= most, job["get_bytes"] / size


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_remote_group_quick_run_reports_every_figure(tmp_path: Path) -> None:
    report, stdout = run_group(tmp_path, "h5serve,first-batch", 400)
    size = report["size"]
    for name, download in report["download"].items():
        assert download["bytes"] == download["get_bytes"] == size, name  # counted at the server, all of it
        assert download["seconds"] > 0
    for mode in ("global", "stream"):
        passed(report[mode], size)
        assert report[mode]["daemon"]["fetched_bytes"] >= size * 0.99  # the daemon fetched it, not the ranks
    assert report["global"]["requests"]["GET"] < 200  # ranged GETs of whole chunk runs, not a GET a row
    first = report["first_batch"]
    assert set(first) == {"8 MiB stream", "8 MiB global", "32 MiB stream", "32 MiB global"}
    for name, job in first.items():
        assert "failed" not in job and job["first_s"] > 0, (name, job)
    # stream mode's first batch needs its first blocks only, global mode the whole object
    assert first["32 MiB stream"]["get_bytes"] < first["32 MiB global"]["get_bytes"]
    names = [row["scenario"] for row in report["rows"]]
    for expected in ("remote cold epoch 0 (construction to end), global", "remote GET bytes per node / file size, "
                     "stream", "remote first batch from a cold object, stream"):
        assert any(n.startswith(expected) for n in names), (expected, names)
    assert "| scenario |" in stdout and "| h5serve global |" in stdout


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_remote_group_peers_read_the_same_server(tmp_path: Path) -> None:
    from bench.remote import peers_python

    if peers_python() == sys.executable:
        pytest.skip("no interpreter with the peers (.venv-peers/bin/python or H5SERVE_PEERS_PYTHON): "
                    "see docs/benchmarks.md, Data on object storage")
    report, _ = run_group(tmp_path, "peers", 400)
    for system in ("streaming", "litdata"):
        job = report["peers"][system]
        # at most once per rank: LitData's ranks, sharing the node's cache, now and then both fetch a chunk
        passed(job, job.get("stored_bytes", 1), most=2.1)
