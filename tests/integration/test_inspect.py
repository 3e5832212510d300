"""`h5serve inspect FILE`: the preflight report, on small real files that trigger each piece of
advice, real tmpfs mounts (Docker's 64 MiB, a SLURM-style per-job bind mount), a real daemon
seen from its own and from another mount namespace, and errors without tracebacks."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import h5py
import hdf5plugin
import numpy as np
import pytest

from h5serve.cli import main
from h5serve.client import SharedH5Dataset
from h5serve.segments import HEADER_SIZE

from ..helpers import Daemon, h5serve_cli, short_tmpdir, tmpfs


def inspect_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["inspect", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def codes(report: dict) -> dict[str, str | None]:
    return {a["code"]: a["key"] for a in report["advice"]}


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    """A layout that needs no advice: 1,000 rows of 3x4x4 uint8 in 64-row chunks, int64 labels."""
    path = tmp_path / "plain.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.zeros((1000, 3, 4, 4), np.uint8), chunks=(64, 3, 4, 4))
        f.create_dataset("y", data=np.arange(1000, dtype=np.int64))
    return path


@pytest.fixture
def nowhere(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """No daemon runs on the runtime dir inspect looks at."""
    empty = short_tmpdir("h5s-none-")
    monkeypatch.setenv("H5SERVE_RUNTIME_DIR", str(empty))
    yield empty
    shutil.rmtree(empty, ignore_errors=True)


def test_a_good_layout_gets_no_advice_and_the_json_schema(plain: Path, nowhere: Path, capsys) -> None:
    report = inspect_json(capsys, str(plain))
    assert report["schema_version"] == 1
    assert set(report) == {"schema_version", "file", "file_bytes", "world_size", "ranks_per_node", "mode", "datasets",
                           "needs", "budget", "budget_rule", "shm", "daemon", "nofile_soft", "nofile_hard",
                           "recommended_mode", "stream", "advice", "remote"}
    assert report["remote"] == ""  # a local file (a URL's object: tests/integration/test_remote.py)
    assert report["recommended_mode"] == "global" and report["stream"] is None
    x, y = report["datasets"]
    assert x == {"key": "x", "rows": 1000, "row_shape": [3, 4, 4], "dtype": "uint8", "nbytes": 48000,
                 "row_bytes": 48, "layout": "chunked", "chunk_rows": 64, "chunk_bytes": 64 * 48, "filters": [],
                 "problem": "", "vlen": False}
    assert (y["key"], y["dtype"], y["layout"], y["chunk_rows"]) == ("y", "int64", "contiguous", None)
    assert [n["mode"] for n in report["needs"]] == ["contiguous", "interleave", "global", "node"]
    assert all(n["fits"] for n in report["needs"]) and report["advice"] == []
    assert report["daemon"]["running"] is False and report["daemon"]["runtime_dir"] == str(nowhere)
    st = os.statvfs("/dev/shm")
    assert report["shm"]["path"] == "/dev/shm" and report["shm"]["size"] == st.f_blocks * st.f_frsize
    assert 0.7 * st.f_bavail * st.f_frsize <= report["budget"] <= 0.9 * st.f_bavail * st.f_frsize
    assert [report["nofile_soft"], report["nofile_hard"]] == list(resource.getrlimit(resource.RLIMIT_NOFILE))
    assert main(["inspect", str(plain)]) == 0
    text = capsys.readouterr().out
    assert "chunks of 64 rows" in text and "advice: none" in text and "daemon: not running" in text


def test_memory_per_mode_on_a_node_of_a_larger_job(plain: Path, nowhere: Path, capsys) -> None:
    """World size 4, 2 ranks here (ranks 0 and 1): the node holds their shards; global the file."""
    report = inspect_json(capsys, str(plain), "--world-size", "4", "--ranks-per-node", "2", "--key", "x")
    needs = {n["mode"]: (n["rows"], n["bytes"]) for n in report["needs"]}
    assert needs == {"contiguous": (500, 500 * 48 + 2 * HEADER_SIZE), "interleave": (500, 500 * 48 + 2 * HEADER_SIZE),
                     "global": (1000, 1000 * 48 + HEADER_SIZE), "node": (500, 500 * 48 + HEADER_SIZE)}
    odd = inspect_json(capsys, str(plain), "--world-size", "3", "--ranks-per-node", "1", "--key", "x",
                       "--mode", "contiguous")
    assert [(n["mode"], n["rows"]) for n in odd["needs"]] == [("contiguous", 334)]  # rank 0 gets the extra row


def test_one_row_chunks_advise_rechunking(tmp_path: Path, nowhere: Path, capsys) -> None:
    path = tmp_path / "rows.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=np.zeros((500, 3, 8, 8), np.uint8), chunks=(1, 3, 8, 8))
    report = inspect_json(capsys, str(path))
    assert codes(report) == {"one_row_chunks": "images"}
    assert "lazy reads" in report["advice"][0]["text"] and "h5repack -l /images:CHUNK=500x3x8x8" in report[
        "advice"][0]["text"]


def test_compression_advises_load_processes(tmp_path: Path, nowhere: Path, capsys) -> None:
    path = tmp_path / "gz.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(4000, dtype=np.float32).reshape(1000, 4), chunks=(100, 4),
                         compression="gzip", shuffle=True)
        f.create_dataset("lz", data=np.zeros((1000, 4), np.float32), chunks=(100, 4), **hdf5plugin.LZ4())
    report = inspect_json(capsys, str(path))
    filters = {d["key"]: [(f["name"], f["available"], f["compression"]) for f in d["filters"]]
               for d in report["datasets"]}
    assert filters == {"lz": [("lz4", True, True)], "x": [("shuffle", True, False), ("gzip", True, True)]}
    advice = [a for a in report["advice"] if a["code"] == "compressed"]
    assert {a["key"] for a in advice} == {"x", "lz"} and len(report["advice"]) == 2
    assert all("--load-processes" in a["text"] for a in advice)


def test_over_budget_says_streamed_or_lazy_reads_and_how_to_raise_it(plain: Path, nowhere: Path, capsys) -> None:
    report = inspect_json(capsys, str(plain), "--max-memory", "40K")
    assert {n["mode"]: n["fits"] for n in report["needs"]} == {"contiguous": False, "interleave": False,
                                                                 "global": False, "node": False}
    (advice,) = [a for a in report["advice"] if a["code"] == "over_budget"]
    assert "mode 'global'" in advice["text"] and "streamed instead" in advice["text"]
    assert "--max-memory" in advice["text"]
    sharded = inspect_json(capsys, str(plain), "--max-memory", "40K", "--mode", "contiguous")
    assert "lazily" in codes_text(sharded, "over_budget") and "stream" not in codes(sharded)
    assert sharded["recommended_mode"] == "contiguous" and sharded["stream"] is None
    # a job of 2 nodes in node mode fits where global does not: said so
    split = inspect_json(capsys, str(plain), "--max-memory", "40K", "--world-size", "2", "--ranks-per-node", "1")
    assert "mode 'node' across more nodes" in codes_text(split, "over_budget")
    fits = inspect_json(capsys, str(plain), "--max-memory", "1M", "--mode", "contiguous")
    assert "over_budget" not in codes(fits)


def codes_text(report: dict, code: str) -> str:
    return " ".join(a["text"] for a in report["advice"] if a["code"] == code)


@pytest.mark.filterwarnings("ignore:h5serve. no h5serve daemon:RuntimeWarning")
def test_mode_stream_shows_its_window_and_the_arguments_that_pin_its_order(plain: Path, nowhere: Path,
                                                                            capsys) -> None:
    report = inspect_json(capsys, str(plain), "--max-memory", "40K", "--mode", "stream")
    stream = report["stream"]
    assert (report["mode"], report["recommended_mode"]) == ("stream", "stream") and stream is not None
    (need,) = report["needs"]
    assert need["mode"] == "stream" and need["fits"]
    assert need["bytes"] == stream["capacity"] * stream["block_cost"] + stream["whole_bytes"] <= 40 * 1024
    pin = f"window={stream['window']}, block_rows={stream['block_rows']}"
    assert pin in codes_text(report, "stream") and "without a daemon" in codes_text(report, "stream")
    # those arguments give that window and block without a daemon too: the order a daemon of that budget reads
    ds = SharedH5Dataset(plain, "x", "y", mode="stream", window=stream["window"], block_rows=stream["block_rows"],
                         runtime_dir=nowhere)
    try:
        assert ds.stream is not None
        assert (ds.stream.config.layout.block_rows, ds.stream.config.capacity) == (stream["block_rows"],
                                                                                  stream["capacity"])
    finally:
        ds.close()
    assert main(["inspect", str(plain), "--max-memory", "40K", "--mode", "stream"]) == 0
    text = capsys.readouterr().out
    assert "recommended: mode 'stream', window" in text and "\n  stream " in text
    # not even one block (64 rows of x and y, a header page each) fits: said, with what it needs
    tiny = inspect_json(capsys, str(plain), "--max-memory", "8K", "--mode", "stream")
    assert tiny["stream"] is None and tiny["needs"] == [{"mode": "stream", "rows": 64, "bytes": 64 * 56 + 2 * 4096,
                                                        "fits": False}]
    assert "SharedH5Dataset(mode='stream') refuses it" in codes_text(tiny, "over_budget")


def test_a_missing_filter_plugin_names_the_extra(tmp_path: Path, nowhere: Path) -> None:
    path = tmp_path / "blosc.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.zeros((100, 8), np.uint16), chunks=(10, 8), **hdf5plugin.Blosc())
    script = ("import sys\n"
              "sys.modules['hdf5plugin'] = None  # as if the filters extra were not installed\n"
              "from h5serve.cli import main\n"
              f"sys.exit(main(['inspect', {str(path)!r}, '--json']))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "H5SERVE_RUNTIME_DIR": str(nowhere)})
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    (x,) = report["datasets"]
    assert x["filters"] == [{"id": 32001, "name": "blosc", "available": False, "compression": True}]
    assert "pip install 'h5serve[filters]'" in codes_text(report, "missing_filter")
    assert x["nbytes"] == 1600 and report["needs"][0]["rows"] == 100  # still counted: servable once installed


def test_dockers_64_mib_shm_is_named_and_the_file_does_not_fit(tmp_path: Path, nowhere: Path, capsys) -> None:
    path = tmp_path / "big.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.zeros((60, 1024, 1024), np.uint8), chunks=(1, 1024, 1024))
    with tmpfs("64m") as shm:
        report = inspect_json(capsys, str(path), "--shm-dir", str(shm))
    assert report["shm"]["size"] == 64 * 1024**2 and report["shm"]["notes"] == ["docker-64m"]
    assert set(codes(report)) == {"docker_shm", "over_budget", "stream"}
    assert "--shm-size" in codes_text(report, "docker_shm")
    assert report["budget"] == int(report["shm"]["free"] * 0.8) and "80%" in report["budget_rule"]


def test_a_slurm_per_job_tmpfs_is_named(plain: Path, nowhere: Path, capsys, monkeypatch) -> None:
    """job_container/tmpfs bind-mounts a per-job directory at /dev/shm: mount it the same way."""
    with tmpfs("16m") as base:
        job_shm, target = base / "1234" / ".shm", short_tmpdir("h5s-jobshm-")
        job_shm.mkdir(parents=True)
        try:
            if subprocess.run(["mount", "--bind", str(job_shm), str(target)], capture_output=True,
                              timeout=30).returncode != 0:
                pytest.skip("cannot bind-mount here")
            try:
                monkeypatch.setenv("SLURM_JOB_ID", "1234")
                in_job = inspect_json(capsys, str(plain), "--shm-dir", str(target))
                monkeypatch.delenv("SLURM_JOB_ID")
                outside = inspect_json(capsys, str(plain), "--shm-dir", str(target))
            finally:
                subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=30)
        finally:
            shutil.rmtree(target, ignore_errors=True)
    assert in_job["shm"]["notes"] == ["slurm-job-tmpfs"] and "srun step" in codes_text(in_job, "slurm_tmpfs")
    assert outside["shm"]["notes"] == [] and "slurm_tmpfs" not in codes(outside)


def test_a_running_daemon_and_its_shm_seen_from_here_and_from_another_namespace(plain: Path, capsys) -> None:
    daemon = Daemon().start()
    try:
        env = {"H5SERVE_RUNTIME_DIR": str(daemon.runtime_dir)}
        report = inspect_json(capsys, str(plain), "--runtime-dir", str(daemon.runtime_dir))
        d = report["daemon"]
        assert (d["running"], d["pid"], d["shm_visible"]) == (True, daemon.pid, True), d
        assert d["budget"] == report["budget"] and "running daemon" in report["budget_rule"]
        ds = SharedH5Dataset(plain, "x", runtime_dir=daemon.runtime_dir, fallback="error")
        try:
            again = inspect_json(capsys, str(plain), "--runtime-dir", str(daemon.runtime_dir))["daemon"]
            assert again["shm_visible"] is True and "segment" in again["how"] and again["used"] > 0
            # a private /dev/shm (a container without shared IPC, a per-job tmpfs): the daemon's is not there
            private = subprocess.run(
                ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$0" -m h5serve inspect '
                 f'{plain} --json', sys.executable], capture_output=True, text=True, timeout=120,
                env={**os.environ, **env})
        finally:
            ds.close()
        if private.returncode != 0 and "unshare" in private.stderr:
            pytest.skip(f"no mount namespaces here: {private.stderr.strip()}")
        assert private.returncode == 0, private.stderr
        seen = json.loads(private.stdout)
        assert seen["daemon"]["shm_visible"] is False and "shm_not_shared" in codes(seen)
        assert seen["budget_rule"].startswith("a daemon started now")  # its budget is not this shm's
    finally:
        daemon.stop()


def test_a_low_open_file_limit_is_advised(plain: Path, nowhere: Path) -> None:
    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    done = subprocess.run([sys.executable, "-m", "h5serve", "inspect", str(plain), "--json"], capture_output=True,
                          text=True, timeout=120, preexec_fn=low)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["nofile_soft"], report["nofile_hard"]) == (1024, 1024)
    assert "LimitNOFILE" in codes_text(report, "low_nofile")


def test_unservable_datasets_are_listed_with_the_reason(tmp_path: Path, nowhere: Path, capsys) -> None:
    path = tmp_path / "mixed.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("events", data=np.zeros(10, dtype=[("energy", "f4"), ("n", "i8")]))
        f.create_dataset("x", data=np.zeros((10, 2), np.float32))
    report = inspect_json(capsys, str(path))
    assert "'events:energy'" in codes_text(report, "unservable")
    assert report["needs"][0]["rows"] == 10  # x only
    fields = inspect_json(capsys, str(path), "--key", "events:energy", "--key", "x")
    assert [(d["key"], d["dtype"], d["problem"]) for d in fields["datasets"]] == [("events:energy", "float32", ""),
                                                                                   ("x", "float32", "")]


def test_errors_exit_1_with_a_message_and_no_traceback(plain: Path, tmp_path: Path) -> None:
    missing = h5serve_cli("inspect", str(tmp_path / "nope.h5"))
    assert missing.returncode == 1 and "nope.h5" in missing.stderr and "cannot be read" in missing.stderr
    not_h5 = tmp_path / "text.h5"
    not_h5.write_text("hello")
    bad = h5serve_cli("inspect", str(not_h5))
    assert bad.returncode == 1 and "cannot be opened as an HDF5 file" in bad.stderr
    key = h5serve_cli("inspect", str(plain), "--key", "images")
    assert key.returncode == 1 and "'images' is not in" in key.stderr and "x, y" in key.stderr
    ranks = h5serve_cli("inspect", str(plain), "--world-size", "2", "--ranks-per-node", "3")
    assert ranks.returncode == 1 and "--ranks-per-node must be in 1..2" in ranks.stderr
    size = h5serve_cli("inspect", str(plain), "--max-memory", "lots")
    assert size.returncode == 1 and "is not a size" in size.stderr
    for done in (missing, bad, key, ranks, size):
        assert "Traceback" not in done.stderr and done.stdout == ""


def test_rows_per_mode_count_samples_not_datasets(tmp_path: Path, nowhere: Path, capsys) -> None:
    """Two datasets of 1,000 rows (x and y of the same samples), world size 2: every mode's
    node holds 1,000 rows (it said 2,000: the rows of x and y added up), and the memory is both."""
    path = tmp_path / "xy.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.zeros((1000, 4), np.float32))
        f.create_dataset("y", data=np.zeros(1000, np.int64))
    report = inspect_json(capsys, str(path), "--world-size", "2")
    needs = {n["mode"]: (n["rows"], n["bytes"]) for n in report["needs"]}
    assert needs["global"] == (1000, 1000 * (16 + 8) + 2 * HEADER_SIZE)
    assert needs["contiguous"] == (1000, 1000 * (16 + 8) + 4 * HEADER_SIZE)
    assert needs["node"][0] == needs["interleave"][0] == 1000
