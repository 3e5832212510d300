"""The ``remote`` group: data on object storage (issue 34), against a real S3 API server on loopback.

    python -m bench --only remote
    python -m bench.remote [--mib 256] [--sizes 64,512] [--quick] [--parts h5serve,first-batch,peers] [--json F]

moto's S3 server runs in a subprocess on a free 127.0.0.1 port (``bench/s3server.py``: moto's
app under a layer that counts the body bytes of every GET it answers, so bytes are counted at
the server, with no proxy in the path; objects kept in its memory, since moto reads the whole
object for every GET, why there; killed by its pid on the way out). The bench file of ``--mib``
MiB (uint8 rows of 3x32x32 in 256-row chunks, labels = row ids, bench/peers.py's ``source_file``)
is uploaded once. In one run:

1. **Cold epoch, 2 ranks.** ``torchrun --nproc-per-node 2`` (gloo, ``bench/remote_jobs.py``) of
   h5serve reading ``s3://…`` through a fresh daemon (``--allow-url`` the bucket, warmed by one
   tiny local load and one tiny remote one, as a node's long-running daemon is; the measured
   object is cold): global mode (budget 2x the file) and stream mode (budget 25% of the file;
   blocks as ``h5serve inspect`` recommends, the default window), from the dataset's
   construction (packages imported, after a barrier) to the end of epoch 0 on the slower rank;
   batch 256, no model step. Epoch 0 is checked (bench/peer_jobs.py ``check``: labels are row
   ids, each rank's share, every row seen, the image bytes of two batches equal the file's rows).
   The daemon's log splits the time (``phases``).
2. **Bare parallel download**, the physical limit here: the same object with the same s3fs in a
   fresh process, into memory: ``fs.cat_ranges`` of 8 MiB ranges (the daemon's ``RANGE_BYTES``),
   16 in flight (its ``FETCH_CONCURRENCY``); ``fs.cat_file`` of the whole object beside it
   (report only). Goal: h5serve's epoch pace >= 0.7x the ranged download's.
3. **GET bytes per node / file size**: the server's count over each job (every rank's
   description, the daemon's inspections and loads). Goal <= 1.05x.
4. **First batch from a cold object** at two sizes (``--sizes``): the same 2-rank job stopped at
   the first batch, stream mode (a 16 MiB budget at both sizes) and global mode, each on a fresh
   daemon. Goal: <= 2 s and flat in size (stream mode: global mode waits for its whole load by
   design, a remote object has no "ready at once": client/backends/progressive.py).
5. **Peers** reading the same rows from the same server, each written with its own writer
   (bench/peer_jobs.py) and uploaded: MosaicML Streaming (``StreamingDataset(remote="s3://…",
   local=cache)``, endpoint from ``S3_ENDPOINT_URL``) and LitData (``StreamingDataset(Dir(path=
   cache, url="s3://…"), storage_options={"endpoint_url": …})``, plain http allowed:
   remote_jobs.allow_plain_http), each with a node-wide cache, the same 2-rank job. They run in
   the interpreter ``peers_python`` finds (``H5SERVE_PEERS_PYTHON``, else ``.venv-peers/bin/python``
   in the repo, else this one), since Streaming pins numpy < 2.2. A peer that cannot be imported
   or fails says why in its row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import BenchDaemon, Row, log, table
from .memory import _tree
from .peers import NAMES, source_file
from .s3server import S3Server, aws_env
from .stream import stream_file, warm_daemon


def warm_daemon_file(data_dir: Path) -> Path:
    """bench/stream.py's tiny file of warm_daemon's load (made there on first use)."""
    path = data_dir / "stream-warm.h5"
    if not path.exists():
        import h5py
        import numpy as np

        data_dir.mkdir(parents=True, exist_ok=True)
        with h5py.File(path, "w") as f:
            f["x"] = np.zeros((4, 4), np.float32)
    return path

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "h5serve-bench"
STREAM_SHARE = 25  # stream mode's budget, percent of the file
JOB_TIMEOUT = 600
PARTS = ("h5serve", "first-batch", "peers")
WARM_KEY = "warm/stream-warm.h5"  # the tiny object warm_remote loads
PACE_GOAL, BYTES_GOAL, FIRST_GOAL_S = 0.7, 1.05, 2.0
# stream mode's budget in the first-batch figure: the same at every size (25% of a small object is
# too small a window for a batch of 256 on 2 ranks), 4x less than the smallest default size
FIRST_BATCH_BUDGET = 16 << 20


@dataclass
class GoalRow(Row):
    """A row whose goal is a ceiling on the h5serve figure (bytes ratio, seconds)."""

    at_most: float | None = None

    @property
    def met(self) -> bool | None:
        if self.at_most is not None:
            return self.h5serve <= self.at_most
        return super().met

    def as_dict(self) -> dict:
        return {**super().as_dict(), "group": "remote", "at_most": self.at_most}


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` for the duration (the daemons and ranks inherit it)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def peers_python() -> str:
    given = os.environ.get("H5SERVE_PEERS_PYTHON")
    if given:
        return given
    venv = ROOT / ".venv-peers" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def peer_versions(python: str) -> dict[str, str]:
    try:
        done = subprocess.run([python, "-m", "bench.peer_jobs", "versions"], capture_output=True, text=True,
                              timeout=300, cwd=ROOT)
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError, OSError) as e:
        return {s: f"unavailable: {type(e).__name__}" for s in ("streaming", "litdata")}


def launch(cmd: list[str], timeout: float = JOB_TIMEOUT) -> dict:
    """Run ``cmd`` (a job printing ``result {json}``); its result, or ``{"failed": why}``."""
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in _tree(proc.pid):  # torchrun's ranks are not in its process group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        return {"failed": f"timed out after {timeout:.0f} s"}
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [line for line in out.splitlines() if line.startswith("result ")]
    err.seek(0)
    text = [line for line in err.read().decode(errors="replace").splitlines() if line.strip()]
    err.close()
    if proc.returncode != 0 or not lines:
        why = ([line.split("]:", 1)[-1].strip() for line in text if "Error:" in line and line.startswith("[rank")]
               or [line for line in text if "Error:" in line] or text[-2:] or ["no output"])
        return {"failed": f"exit {proc.returncode}: {why[-1][:600]}"}
    return dict(json.loads(lines[0][len("result "):]))


def torchrun(system: str, url: str, source: Path, *, python: str = sys.executable, runtime_dir: Path | None = None,
             block_rows: int | None = None, first_only: bool = False) -> dict:
    cache = tempfile.mkdtemp(prefix=f"h5s-remote-{system}-", dir="/tmp")
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "bench.remote_jobs",
           "run", system, url, "--source", str(source), "--cache", cache]
    if runtime_dir is not None:
        cmd += ["--runtime-dir", str(runtime_dir)]
    if block_rows is not None:
        cmd += ["--block-rows", str(block_rows)]
    if first_only:
        cmd.append("--first-only")
    try:
        return launch(cmd)
    finally:
        subprocess.run(["rm", "-rf", cache], check=False)


def counted(server: S3Server, fn: Any, *args: Any, **kwargs: Any) -> dict:
    """``fn``'s result plus ``get_bytes`` and ``requests``: what the server answered meanwhile."""
    before = server.counts()
    r = fn(*args, **kwargs)
    after = server.counts()
    r["get_bytes"] = after["get_bytes"] - before["get_bytes"]
    r["requests"] = {k: v - before["requests"].get(k, 0) for k, v in after["requests"].items()
                     if v - before["requests"].get(k, 0)}
    return r


def timings(r: dict) -> dict:
    """Epoch 0 (construction on the first rank to the end on the last) and the first batch."""
    if "failed" in r:
        return r
    start = min(r["built"])
    return {**r, "epoch_s": max(r["end"]) - start, "first_s": max(r["first"]) - start,
            "ready_s": max(r["ready"]) - start}


def warm_remote(url: str, runtime_dir: Path) -> None:
    """One load of a tiny object, so that the measured job meets a daemon that has fetched
    before (its s3fs client made: ~1.3 s at the first remote acquire of a fresh daemon), as a
    node's long-running daemon has; the measured object is still cold."""
    from h5serve.client import SharedH5Dataset

    ds = SharedH5Dataset(url, "x", rank=0, world_size=1, runtime_dir=runtime_dir, fallback="error")
    try:
        ds[0]
    finally:
        ds.close()


def h5serve_job(server: S3Server, mode: str, url: str, source: Path, size: int, *, first_only: bool = False,
                stream_budget: int | None = None) -> dict:
    """One cold 2-rank job of h5serve on a fresh daemon, counted at the server. Stream mode's
    budget: ``stream_budget``, else STREAM_SHARE of the file."""
    from .bigdata import recommended_block

    budget = (2 * size + (64 << 20) if mode == "global" else
              stream_budget or size * STREAM_SHARE // 100)
    block = recommended_block(source, budget) if mode == "stream" else None
    # --idle-exit: a daemon left by a bench killed from outside (a test's deadline) goes on its own
    with BenchDaemon("--max-memory", str(budget), "--allow-url", f"s3://{BUCKET}/", "--idle-exit", "300") as daemon:
        warm_daemon(source.parent, daemon.runtime_dir)
        warm_remote(f"s3://{BUCKET}/{WARM_KEY}", daemon.runtime_dir)
        r = timings(counted(server, torchrun, mode, url, source, runtime_dir=daemon.runtime_dir, block_rows=block,
                            first_only=first_only))
        r["daemon"] = daemon.status().get("remote", {})
        if "built" in r:
            r["phases"] = phases(daemon.start_output, url, min(r["built"]), max(r["first"]))
    r.update(budget=budget, block_rows=block)
    return r


def phases(start_output: str, url: str, built: float, first: float) -> dict:
    """From the daemon's log (INFO lines, this machine's clock): seconds from the construction's
    start to the first load of ``url`` (the ranks' descriptions, the daemon's HEAD and inspection),
    the loads that ended before the first batch (global mode: x and y; stream mode: the probe
    and the first blocks), from the first load's start to the last one's end, and from then to
    the slower rank's first batch."""
    log = Path(start_output.rsplit("log: ", 1)[-1].strip())
    began, ended = [], []
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    for line in lines:
        at = line[:23]
        if (f"loading {url}[" in line or " loaded " in line) and len(at) == 23:
            try:
                t = time.mktime(time.strptime(at[:19], "%Y-%m-%d %H:%M:%S")) + int(at[20:23]) / 1000
            except ValueError:
                continue
            if f"loading {url}[" in line:
                began.append(t)
            elif began and t <= first + 0.01:
                ended.append(t)
    if not began or not ended:
        return {}
    return {"until_load_s": began[0] - built, "loads_s": max(ended) - began[0], "after_loads_s": first - max(ended)}


def bare_download(server: S3Server, url: str) -> dict:
    """The object with the same s3fs in a fresh process: ``fs.cat_ranges`` of the daemon's
    ``RANGE_BYTES`` ranges, ``FETCH_CONCURRENCY`` in flight (the limit), and ``fs.cat_file`` of
    the whole object (report only)."""
    from h5serve.hdf5.fetch import FETCH_CONCURRENCY, RANGE_BYTES

    out = {}
    for name, size in ((f"{RANGE_BYTES >> 20} MiB ranges, {FETCH_CONCURRENCY} in flight", RANGE_BYTES),
                       ("fs.cat_file of the whole object", 0)):
        cmd = [sys.executable, "-m", "bench.remote_jobs", "download", url, "--range-bytes", str(size),
               "--concurrency", str(FETCH_CONCURRENCY)]
        out[name] = counted(server, launch, cmd)
    return out


def upload(fs: Any, local: Path, key: str) -> str:
    """``local`` (a file, or a directory's files) under ``key``; each object then read once by a
    one-byte GET, so that the server holds its bytes in memory (s3server.keep_objects_in_memory)
    before anything is measured."""
    files = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
    for f in files:
        name = f"{BUCKET}/{key}/{f.relative_to(local)}" if local.is_dir() else f"{BUCKET}/{key}"
        fs.put_file(str(f), name)
        fs.cat_file(name, start=0, end=1)
    return f"s3://{BUCKET}/{key}"


def peer_jobs(server: S3Server, fs: Any, source: Path, size: int) -> dict:
    """Each peer's cold 2-rank epoch on its own copy of the rows, uploaded to the same server."""
    from .peers import peer_dir

    python = peers_python()
    found = peer_versions(python)
    out: dict = {"python": python, "versions": found}
    for system in ("streaming", "litdata"):
        if found.get(system, "unavailable").startswith("unavailable"):
            out[system] = {"failed": found.get(system, "unavailable")}
            continue
        try:
            local = peer_dir(source, system, python=python)
        except RuntimeError as e:
            out[system] = {"failed": str(e)[-600:]}
            continue
        url = upload(fs, local, f"{source.stem}-{system}")
        out[system] = timings(counted(server, torchrun, system, url, source, python=python))
        out[system]["stored_bytes"] = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
        log(f"remote: {NAMES[system]}: {brief(out[system], size)}")
    return out


def brief(r: dict, size: int) -> str:
    if "failed" in r:
        return f"FAILED {r['failed'][:300]}"
    return (f"epoch 0 {r['epoch_s']:.2f} s, first batch {r['first_s']:.2f} s, GET {r['get_bytes'] / size:.3f}x "
            f"the file, checks {r['checks']['failed'] or 'passed'}")


def remote(data_dir: Path, mib: int = 256, sizes: tuple[int, ...] = (64, 512), parts: tuple[str, ...] = PARTS,
           report: dict | None = None) -> list[Row]:
    report = {} if report is None else report
    report["load"] = [os.getloadavg()[0]]
    source = source_file(stream_file(data_dir, mib))
    size = source.stat().st_size
    report.update(mib=mib, size=size)
    home = Path(tempfile.mkdtemp(prefix="h5s-remote-home-", dir="/tmp"))
    try:
        with S3Server() as server, environment(aws_env(server.endpoint, home)):
            import s3fs

            fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": server.endpoint}, skip_instance_cache=True)
            fs.mkdir(BUCKET)
            upload(fs, warm_daemon_file(data_dir), WARM_KEY)
            url = upload(fs, source, source.name)
            log(f"remote: {url} ({size / 2**20:.0f} MiB) on {server.endpoint}")
            report["download"] = bare_download(server, url)
            log(f"remote: bare download {report['download']}")
            if "h5serve" in parts:
                for mode in ("global", "stream"):
                    report[mode] = h5serve_job(server, mode, url, source, size)
                    log(f"remote: h5serve {mode}: {brief(report[mode], size)}")
            if "first-batch" in parts:
                report["first_batch"] = first_batches(server, fs, data_dir, sizes)
            if "peers" in parts:
                report["peers"] = peer_jobs(server, fs, source, size)
    finally:
        subprocess.run(["rm", "-rf", str(home)], check=False)
    report["load"].append(os.getloadavg()[0])
    return rows(report)


def first_batches(server: S3Server, fs: Any, data_dir: Path, sizes: tuple[int, ...]) -> dict:
    out: dict = {}
    for mib in sizes:
        path = stream_file(data_dir, mib)
        url = upload(fs, path, path.name)
        for mode in ("stream", "global"):
            r = h5serve_job(server, mode, url, path, path.stat().st_size, first_only=True,
                            stream_budget=FIRST_BATCH_BUDGET)
            out[f"{mib} MiB {mode}"] = {k: v for k, v in r.items() if k not in ("built", "ready", "first", "end")}
            log(f"remote: first batch, {mib} MiB, {mode}: {r.get('first_s', r.get('failed'))}")
    return out


def limit_s(report: dict) -> float | None:
    """The bare parallel download's seconds (the ranged one: the whole GET is a report)."""
    done = [d["seconds"] for name, d in report.get("download", {}).items() if "seconds" in d and "ranges" in name]
    return min(done) if done else None


def rows(report: dict) -> list[Row]:
    size, mib = report["size"], report["mib"]
    mb = size / 1e6
    bare = limit_s(report)
    out: list[Row] = []
    what = f"{mib} MiB s3:// object on loopback moto, 2 ranks"
    for mode in ("global", "stream"):
        r = report.get(mode)
        if r is None:
            continue
        label = "global" if mode == "global" else f"stream ({STREAM_SHARE}% budget)"
        if "failed" in r:
            out.append(GoalRow(f"remote cold epoch 0, {label}, {what}: FAILED {r['failed'][:200]}", "MB/s", 0.0))
            continue
        checks = r["checks"]["failed"]
        out.append(Row(f"remote cold epoch 0 (construction to end), {label}, vs bare parallel download, {what}",
                       "MB/s", mb / r["epoch_s"], limit=mb / bare if bare else None, target=f">= {PACE_GOAL}x limit",
                       target_vs_limit=PACE_GOAL, note=f"checks: {'; '.join(checks) or 'passed'}"))
        out.append(GoalRow(f"remote GET bytes per node / file size, {label}, {what}", "x file", r["get_bytes"] / size,
                           target=f"<= {BYTES_GOAL}x", at_most=BYTES_GOAL,
                           note=f"{r['get_bytes'] / size:.3f}x; requests {r['requests']}"))
    fb = report.get("first_batch", {})
    for mode in ("stream", "global"):
        got = [(k.split()[0], v) for k, v in fb.items() if k.endswith(mode)]
        if len(got) < 2:
            continue
        (small, a), (large, b) = got[0], got[-1]
        if "failed" in a or "failed" in b:
            out.append(GoalRow(f"remote first batch, {mode}: FAILED {(a.get('failed') or b.get('failed'))[:200]}",
                               "s", 0.0))
            continue
        goal = mode == "stream"
        out.append(GoalRow(f"remote first batch from a cold object, {mode}, {large} MiB vs {small} MiB, 2 ranks"
                           + ("" if goal else " (report only: waits for the whole load)"), "s", b["first_s"],
                           a["first_s"], higher_is_better=False, target=f"<= {FIRST_GOAL_S} s" if goal else "",
                           at_most=FIRST_GOAL_S if goal else None,
                           note=f"{b['first_s'] / a['first_s']:.2f}x the time for {int(large) / int(small):g}x "
                                "the size"))
    ours = report.get("global", {})
    for system, r in report.get("peers", {}).items():
        if system not in NAMES or not isinstance(r, dict):
            continue
        if "failed" in r or "epoch_s" not in ours:
            out.append(GoalRow(f"remote cold epoch 0, h5serve global vs {NAMES[system]}, {what} (report only)", "s",
                               ours.get("epoch_s", 0.0), note=f"{NAMES[system]}: {r.get('failed', '')[:400]}"))
            continue
        out.append(GoalRow(f"remote cold epoch 0, h5serve global vs {NAMES[system]}, {what} (report only)", "s",
                           ours["epoch_s"], r["epoch_s"], higher_is_better=False,
                           note=f"{NAMES[system]}: GET {r['get_bytes'] / size:.3f}x the HDF5 file, checks "
                                f"{'; '.join(r['checks']['failed']) or 'passed'}"))
    return out


def markdown(report: dict) -> str:
    """The docs table of one run's report (``--json``)."""
    size = report["size"]
    bare = limit_s(report)
    lines = ["| reader | epoch 0 from construction (s) | MB/s | vs bare download | first batch (s) "
             "| GET bytes / file | GETs | HEADs | epoch-0 checks |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]

    def line(name: str, r: dict) -> None:
        if "failed" in r:
            lines.append(f"| {name} | failed: {r['failed'][:300]} |" + " |" * 7)
            return
        mbs = size / 1e6 / r["epoch_s"]
        lines.append(f"| {name} | {r['epoch_s']:.2f} | {mbs:.1f} | {bare / r['epoch_s'] if bare else 0:.2f}x | "
                     f"{r['first_s']:.2f} | {r['get_bytes'] / size:.3f} | {r['requests'].get('GET', 0)} | "
                     f"{r['requests'].get('HEAD', 0)} | {'; '.join(r['checks']['failed']) or 'passed'} |")

    for name, d in report.get("download", {}).items():
        if "failed" in d:
            lines.append(f"| bare s3fs download, {name} | failed: {d['failed'][:300]} |" + " |" * 7)
            continue
        lines.append(f"| bare s3fs download, {name} | {d['seconds']:.2f} | "
                     f"{size / 1e6 / d['seconds']:.1f} | {bare / d['seconds']:.2f}x | — | {d['get_bytes'] / size:.3f} "
                     f"| {d['requests'].get('GET', 0)} | {d['requests'].get('HEAD', 0)} | — |")
    for mode in ("global", "stream"):
        if mode in report:
            line(f"h5serve {mode}" + (f" ({STREAM_SHARE}% budget, {report[mode].get('block_rows')}-row blocks)"
                                      if mode == "stream" else ""), report[mode])
    for system, r in report.get("peers", {}).items():
        if system in NAMES and isinstance(r, dict):
            line(NAMES[system], r)
    timed = [(m, report[m]) for m in ("global", "stream") if "phases" in report.get(m, {})]
    if timed:
        lines += ["", "| h5serve | construction to first load (s) | loads before the first batch (s) | then to the "
                  "first batch (s) | the daemon's fetch (MB/s, all its loads) |", "|---|---:|---:|---:|---:|"]
        for mode, r in timed:
            ph, d = r["phases"], r.get("daemon", {})
            rate = f"{d['bytes_per_s'] / 1e6:.1f}" if d.get("bytes_per_s") else "—"
            lines.append(f"| {mode} | {ph['until_load_s']:.2f} | {ph['loads_s']:.2f} | {ph['after_loads_s']:.2f} | "
                         f"{rate} |")
    if report.get("first_batch"):
        lines += ["", "| object, mode | first batch from construction, cold (s) | GET bytes until then / object |",
                  "|---|---:|---:|"]
        for k, v in report["first_batch"].items():
            got = "failed" if "failed" in v else f"{v['first_s']:.2f}"
            part = f"{v['get_bytes'] / (int(k.split()[0]) << 20):.3f}" if "get_bytes" in v else "—"
            lines.append(f"| {k} | {got} | {part} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.remote", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, default=Path("/tmp/h5serve-bench-data"))
    p.add_argument("--mib", type=int, default=None, help="the object's size (default 256; --quick 32)")
    p.add_argument("--sizes", default=None, help="object sizes of the first-batch figure, MiB (default 64,512; "
                                                 "--quick 8,32)")
    p.add_argument("--quick", action="store_true", help="small objects: a smoke run of a minute or two")
    p.add_argument("--parts", default=",".join(PARTS), help="some of " + ",".join(PARTS))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None, help="print the docs table of a saved --json, run nothing")
    a = p.parse_args()
    if a.markdown:
        print(markdown(json.loads(a.markdown.read_text())))
        return
    mib = a.mib or (32 if a.quick else 256)
    sizes = tuple(int(s) for s in (a.sizes or ("8,32" if a.quick else "64,512")).split(","))
    report: dict = {}
    found = remote(a.data_dir, mib, sizes, tuple(a.parts.split(",")), report)
    print(table(found))
    print(markdown(report))
    if a.json:
        a.json.write_text(json.dumps({"rows": [r.as_dict() for r in found], **report}, indent=1, default=str))


if __name__ == "__main__":
    main()
