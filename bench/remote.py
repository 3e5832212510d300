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
from pathlib import Path
from typing import Any

from .common import BenchDaemon, Row, log, table
from .memory import _tree
from .peers import NAMES, source_file
from .remote_report import STREAM_SHARE, markdown, rows
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
JOB_TIMEOUT = 600
PARTS = ("h5serve", "first-batch", "peers")
WARM_KEY = "warm/stream-warm.h5"  # the tiny object warm_remote loads
# stream mode's budget in the first-batch figure: the same at every size (25% of a small object is
# too small a window for a batch of 256 on 2 ranks), 4x less than the smallest default size
FIRST_BATCH_BUDGET = 16 << 20


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
           report: dict | None = None, moto_as_is: bool = False) -> list[Row]:
    """``moto_as_is``: moto's server exactly as it comes (s3server.keep_objects_in_memory: why not)."""
    report = {} if report is None else report
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as e:
        log(f"remote: skipped, {e} (pip install -e '.[test]': moto[server] and s3fs)")
        report["skipped"] = str(e)
        return []
    report["load"] = [os.getloadavg()[0]]
    source = source_file(stream_file(data_dir, mib))
    size = source.stat().st_size
    report.update(mib=mib, size=size, moto_as_is=moto_as_is)
    home = Path(tempfile.mkdtemp(prefix="h5s-remote-home-", dir="/tmp"))
    try:
        with S3Server(moto_as_is) as server, environment(aws_env(server.endpoint, home)):
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


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.remote", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, default=Path("/tmp/h5serve-bench-data"))
    p.add_argument("--mib", type=int, default=None, help="the object's size (default 256; --quick 32)")
    p.add_argument("--sizes", default=None, help="object sizes of the first-batch figure, MiB (default 64,512; "
                                                 "--quick 8,32)")
    p.add_argument("--quick", action="store_true", help="small objects: a smoke run of a minute or two")
    p.add_argument("--parts", default=",".join(PARTS), help="some of " + ",".join(PARTS))
    p.add_argument("--moto-as-is", action="store_true",
                   help="serve objects as moto does (every GET reads the whole object: bench/s3server.py)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None, help="print the docs table of a saved --json, run nothing")
    a = p.parse_args()
    if a.markdown:
        print(markdown(json.loads(a.markdown.read_text())))
        return
    mib = a.mib or (32 if a.quick else 256)
    sizes = tuple(int(s) for s in (a.sizes or ("8,32" if a.quick else "64,512")).split(","))
    report: dict = {}
    found = remote(a.data_dir, mib, sizes, tuple(a.parts.split(",")), report, a.moto_as_is)
    print(table(found))
    print(markdown(report))
    if a.json:
        a.json.write_text(json.dumps({"rows": [r.as_dict() for r in found], **report}, indent=1, default=str))


if __name__ == "__main__":
    main()
