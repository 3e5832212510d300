"""The ``peers`` group: h5serve beside MosaicML Streaming and LitData on the same rows.

The rows of the plain bench file, with labels made row ids (``peers-N.h5``), written once with
Streaming's ``MDSWriter`` (uncompressed, default shard size) and LitData's ``optimize`` (64 MB
chunks), and kept. Every scenario is a real ``torchrun --standalone --nproc-per-node 2`` job (gloo),
as each system runs in DDP: Streaming's dataset needs every rank of the node (it barriers across
them), so no system is measured as a lone rank. Rank 0 reports; rank 0 of 2 reads 100,000 rows
per epoch, shuffled, batch 256, each system configured as its docs recommend for local data
(``bench/peer_jobs.py``). Epoch 0 of every job is checked: labels are row ids, rank 0's share is
1/2 of the rows, duplicates only as padding, the ranks together cover the file, and the images'
bytes are the file's rows for their labels. A failed check makes a failed row.

Needs the ``bench-peers`` extra (``pip install -e '.[bench-peers]' -c bench/constraints-peers.txt``);
without it the group says so in one line. A peer that cannot be imported is left out the same way.
"""

from __future__ import annotations

import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from h5serve.segments import segment_prefix
from h5serve.wire.runtime import resolve_runtime

from .common import CHUNK_ROWS, ROW_SHAPE, BenchDaemon, Row, cached_bytes, drop_page_cache, log, warm_page_cache
from .memory import _pss, _segments_bytes, _tree
from .peer_jobs import PEERS

ROOT = Path(__file__).resolve().parent.parent
NAMES = {"h5serve": "h5serve", "streaming": "Streaming", "litdata": "LitData"}
INSTALL = "pip install -e '.[bench-peers]' -c bench/constraints-peers.txt"
CONTROL_ROWS = 4096  # 2,048 rows a rank: 8 batches, so every worker fills its prefetch buffers as on the data
JOB_TIMEOUT = 900
EPOCHS = 3


@dataclass
class PeerRow(Row):
    """A peers row: h5serve against one peer (the baseline); ``failed`` names a failed job or check."""

    peer: str = ""
    failed: str = ""

    @property
    def met(self) -> bool | None:
        return False if self.failed else super().met

    def as_dict(self) -> dict:
        return {**super().as_dict(), "group": "peers", "peer": self.peer, "failed": self.failed}


@dataclass
class Outcome:
    """One system's figure in one scenario, or why there is none."""

    value: float = 0.0
    failed: str = ""
    extra: dict = field(default_factory=dict)


# ----- availability and data ----------------------------------------------------------------
def versions() -> dict[str, str]:
    """``{system: "dist version" | "unavailable: why"}`` from a fresh interpreter."""
    try:
        done = subprocess.run([sys.executable, "-m", "bench.peer_jobs", "versions"], capture_output=True,
                              text=True, timeout=300, cwd=ROOT)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
        return {system: f"unavailable: {type(e).__name__}" for system in PEERS}


def source_file(plain: Path, rows: int | None = None) -> Path:
    """The plain bench file's rows (the first ``rows``) with y = row ids; made once and kept."""
    with h5py.File(plain, "r") as f:
        n = len(f["y"]) if rows is None else rows
    path = plain.with_name(f"peers-{n}.h5")
    if not path.exists():
        log(f"peers: writing {path}")
        tmp = path.with_suffix(".tmp")
        with h5py.File(plain, "r") as src, h5py.File(tmp, "w") as dst:
            x = dst.create_dataset("x", (n, *ROW_SHAPE), dtype=np.uint8, chunks=(CHUNK_ROWS, *ROW_SHAPE))
            for a in range(0, n, CHUNK_ROWS * 100):
                x[a : min(n, a + CHUNK_ROWS * 100)] = src["x"][a : min(n, a + CHUNK_ROWS * 100)]
            dst.create_dataset("y", data=np.arange(n, dtype=np.int64), chunks=(CHUNK_ROWS,))
        os.replace(tmp, path)
    return path


def peer_dir(source: Path, system: str, shard_bytes: int | None = None, python: str = sys.executable) -> Path:
    """``system``'s copy of ``source`` (written once and kept; a half-written one is written again).
    ``shard_bytes``: Streaming's MDS shard size limit and LitData's chunk size (None: MDSWriter's
    default, 67 MB; LitData 64 MB). ``python``: the interpreter with the peers (bench/remote.py's
    ``peers_python``)."""
    suffix = f"-{shard_bytes}" if shard_bytes is not None else ""
    out = source.with_name(f"{source.stem}-{system}{suffix}")
    if not (out / "index.json").exists():
        log(f"peers: writing {out} with {NAMES[system]}")
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        tmp.rmdir()  # both writers want to make their output directory themselves
        try:
            writer = f"write-{'mds' if system == 'streaming' else system}"
            size = ["--size-limit", str(shard_bytes)] if suffix else []
            done = subprocess.run([python, "-m", "bench.peer_jobs", writer,
                                   str(source), str(tmp), *size], capture_output=True, text=True, timeout=1800,
                                  cwd=ROOT)
            if done.returncode != 0:
                raise RuntimeError(f"writing {out} failed: {done.stderr[-2000:]}")
            subprocess.run(["rm", "-rf", str(out)], check=True)
            os.replace(tmp, out)
        finally:
            subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return out


def data_files(data: Path) -> list[Path]:
    return sorted(p for p in data.iterdir() if p.is_file()) if data.is_dir() else [data]


# ----- 2-rank jobs --------------------------------------------------------------------------
class Job:
    """``torchrun --standalone --nproc-per-node 2 -m bench.peer_jobs run ...`` as a subprocess."""

    def __init__(self, system: str, data: Path, source: Path, runtime_dir: Path | None, *, workers: int = 0,
                 epochs: int = EPOCHS, threads: int | None = None, hold: Path | None = None) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "bench.peer_jobs", "run", system, str(data), "--source", str(source),
               "--workers", str(workers), "--epochs", str(epochs)]
        if runtime_dir is not None:
            cmd += ["--runtime-dir", str(runtime_dir)]
        if hold is not None:
            cmd += ["--hold", str(hold)]
        env = dict(os.environ)
        if threads is not None:  # else torchrun's default for 2 ranks: OMP_NUM_THREADS=1
            env["OMP_NUM_THREADS"] = str(threads)
        self.system, self.started = system, time.time()
        self.err = tempfile.TemporaryFile()  # a file, not a pipe: chatty ranks never block on it
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.err, text=True, env=env, cwd=ROOT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = JOB_TIMEOUT) -> None:
        """Wait for both ranks' ``ready`` line (with ``hold``); raw reads, so the deadline holds."""
        deadline, seen = time.time() + timeout, b""
        fd = self.proc.stdout.fileno()
        while seen.count(b"ready") < 2:
            left = deadline - time.time()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise RuntimeError(f"{self.system} job: its ranks were not ready within {timeout:.0f} s")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"{self.system} job ended before both ranks were ready")
            seen += chunk

    def result(self, timeout: float = JOB_TIMEOUT) -> dict:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"{self.system} job timed out after {timeout:.0f} s") from None
        lines = [line for line in out.splitlines() if line.startswith("result ")]
        if self.proc.returncode != 0 or not lines:
            self.err.seek(0)
            tail = [line for line in self.err.read().decode(errors="replace").splitlines() if line.strip()][-3:]
            raise RuntimeError(f"{self.system} job failed (exit {self.proc.returncode}): {' | '.join(tail)[-600:]}")
        return json.loads(lines[0][len("result "):])

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # torchrun and its ranks: the session this job started
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.err.close()


def checked(result: dict) -> str:
    failed = result["checks"]["failed"]
    return "; ".join(failed)


def iterate(system: str, data: Path, source: Path, runtime_dir: Path | None, *, busy: bool = False,
            **job: object) -> Outcome:
    """Rank 0's samples/s over its best epoch."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    j = Job(system, data, source, runtime_dir, **job)
    try:
        r = j.result()
    except RuntimeError as e:
        return Outcome(failed=str(e))
    finally:
        j.kill()
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    return Outcome(r["samples"] / min(r["epoch_times"]), checked(r),
                   {"epoch_times": r["epoch_times"], "checks": r["checks"]})


def first_batch(system: str, data: Path, source: Path, runtime_dir: Path | None, repeat: int) -> Outcome:
    """Median seconds from launching torchrun to rank 0's first batch (data in the page cache)."""
    times = []
    for _ in range(repeat):
        for f in data_files(data):
            warm_page_cache(f)
        j = Job(system, data, source, runtime_dir, epochs=0)
        try:
            times.append(j.result()["first_batch"] - j.started)
        except RuntimeError as e:
            return Outcome(failed=str(e))
        finally:
            j.kill()
    return Outcome(statistics.median(times), extra={"times": times})


def node_memory(system: str, data: Path, source: Path) -> tuple[int, dict]:
    """Bytes of node memory of a 2-rank x 2-worker job after one epoch, every process alive: PSS
    of every process (mappings of the data files and h5serve's segments left out), h5serve's
    segments once, and the page cache of the data files. Starts with those files evicted."""
    files = data_files(data)
    for f in files:
        drop_page_cache(f)
    with ExitStack() as stack:
        daemon = stack.enter_context(BenchDaemon()) if system == "h5serve" else None
        release = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="h5s-peers-"))) / "release"
        stack.callback(release.touch)  # the ranks' hold ends, whatever happens here
        job = Job(system, data, source, daemon.runtime_dir if daemon else None, workers=2, epochs=1, hold=release)
        stack.callback(job.kill)
        job.wait_ready()
        time.sleep(0.5)
        pids = _tree(job.proc.pid) + (_tree(daemon.pid) if daemon else [])
        if daemon is not None:
            prefix = segment_prefix(resolve_runtime(daemon.runtime_dir).namespace)
            pss, shm = sum(_pss(pid, f"/dev/shm/{prefix}") for pid in pids), _segments_bytes(prefix)
        else:
            pss, shm = sum(_pss(pid, str(data)) for pid in pids), 0
        cache = sum(cached_bytes(f) for f in files)
        release.touch()
        failed = checked(job.result())
    return pss + shm + cache, {"pss": pss, "segments": shm, "page_cache": cache, "failed": failed}


def memory(system: str, data: Path, control: Path, source: Path, control_source: Path, native: int) -> Outcome:
    try:
        total, parts = node_memory(system, data, source)
        base, base_parts = node_memory(system, control, control_source)
    except RuntimeError as e:
        return Outcome(failed=str(e))
    return Outcome((total - base) / native, parts["failed"] or base_parts["failed"],
                   {"total": total, "control": base, **{k: v for k, v in parts.items() if k != "failed"}})


# ----- the group ----------------------------------------------------------------------------
SCENARIOS = (
    ("iterate, workers=0, 1 torch thread", "samples/s", {"workers": 0}),
    ("iterate, workers=0, torch's default threads", "samples/s", {"workers": 0, "threads": os.cpu_count() or 1}),
    ("iterate, workers=2", "samples/s", {"workers": 2}),
    ("iterate beside a busy process, workers=0, 1 torch thread", "samples/s", {"workers": 0, "busy": True}),
)


def clean_streaming() -> None:
    """Streaming's documented fix for shared memory a killed job left behind."""
    subprocess.run([sys.executable, "-m", "bench.peer_jobs", "clean"], capture_output=True, timeout=300, cwd=ROOT)


def run_peers(files: dict[str, Path], repeat: int, report: dict) -> list[PeerRow]:
    """The group's rows; ``report`` gets the peers' versions and the skip line, if any."""
    report["load"] = [os.getloadavg()[0]]
    found = versions()
    report.update(versions=found, repeat=repeat)
    peers = [s for s in PEERS if not found[s].startswith("unavailable")]
    for s in PEERS:
        if s not in peers:
            log(f"peers: {NAMES[s]} left out ({found[s]}; {INSTALL})")
    if not peers:
        report["skipped"] = (f"peers: skipped, neither mosaicml-streaming nor litdata can be imported "
                             f"(install them with `{INSTALL}`)")
        log(report["skipped"])
        return []
    report["left_out"] = {s: found[s] for s in PEERS if s not in peers}
    source = source_file(files["plain"])
    control_source = source_file(files["plain"], CONTROL_ROWS)
    data = {"h5serve": source, **{s: peer_dir(source, s) for s in peers}}
    control = {"h5serve": control_source, **{s: peer_dir(control_source, s) for s in peers}}
    with h5py.File(source, "r") as f:
        native = f["x"].size * f["x"].dtype.itemsize + f["y"].size * f["y"].dtype.itemsize
        native -= CONTROL_ROWS * (native // len(f["y"]))  # the control holds its own rows once: data minus control
    outcomes: dict[str, dict[str, Outcome]] = {}
    systems = ["h5serve", *peers]
    if "streaming" in peers:
        clean_streaming()
    with BenchDaemon() as daemon:
        Job("h5serve", source, source, daemon.runtime_dir, epochs=0).result()  # the load: later jobs find it warm
        for name, _, job in SCENARIOS:
            log(f"peers: {name}")
            for s in systems:
                for f in data_files(data[s]) if s != "h5serve" else []:
                    warm_page_cache(f)
                outcome = outcomes.setdefault(name, {})[s] = iterate(s, data[s], source, daemon.runtime_dir, **job)
                log(f"peers:   {NAMES[s]}: {outcome.value:,.0f} samples/s {outcome.failed}")
        log("peers: first batch of a fresh 2-rank job")
        outcomes["first"] = {s: first_batch(s, data[s], source, daemon.runtime_dir, repeat) for s in systems}
    log(f"peers: node memory, 2 ranks x 2 workers (data and a {CONTROL_ROWS:,}-row control)")
    outcomes["memory"] = {s: memory(s, data[s], control[s], source, control_source, native) for s in systems}
    if "streaming" in peers and any(o.failed for o in (v.get("streaming") for v in outcomes.values()) if o):
        clean_streaming()
    report["load"].append(os.getloadavg()[0])
    report["outcomes"] = {k: {s: o.__dict__ for s, o in v.items()} for k, v in outcomes.items()}
    return rows(outcomes, peers, native)


def rows(outcomes: dict[str, dict[str, Outcome]], peers: list[str], native: int) -> list[PeerRow]:
    out: list[PeerRow] = []
    specs = [(name, unit, True) for name, unit, _ in SCENARIOS]
    specs += [("first", "s", False), ("memory", "x native", False)]
    titles = {"first": "first batch of a fresh 2-rank job, warm cache (report only)",
              "memory": "node memory, 2 ranks x 2 workers: PSS + shm + page cache (x of the data's native size)"}
    for name, unit, higher in specs:
        mine = outcomes[name]["h5serve"]
        for peer in peers:
            theirs = outcomes[name][peer]
            failed = "; ".join(f"{NAMES[s]}: {o.failed}" for s, o in (("h5serve", mine), (peer, theirs)) if o.failed)
            note = f"**failed** {failed}" if failed else ""
            if name == "memory" and not failed:
                note = (f"native {native / 2**20:,.0f} MiB; totals {mine.extra['total'] / 2**20:,.0f} / "
                        f"{theirs.extra['total'] / 2**20:,.0f} MiB minus a {CONTROL_ROWS:,}-row control")
            out.append(PeerRow(f"peers vs {NAMES[peer]}: {titles.get(name, name + ' (rank 0 of 2)')}", unit,
                               mine.value, theirs.value or None, higher_is_better=higher, note=note, peer=peer,
                               failed=failed, extra={"peer_value": theirs.value}))
    return out


# ----- the docs ---------------------------------------------------------------------------
def _cell(value: float | None, unit: str) -> str:
    if not value:
        return "—"
    if unit == "samples/s":
        return f"{value:,.0f}"
    return f"{value:.2f}x" if unit == "x native" else f"{value:.2f}"


def peers_table(rows: list[Row]) -> str:
    """One line per scenario: h5serve and each peer side by side, and h5serve's ratio to each."""
    peer_rows = [r for r in rows if isinstance(r, PeerRow)]
    peers = list(dict.fromkeys(r.peer for r in peer_rows))
    head = ["scenario", "unit", "h5serve", *(NAMES[p] for p in peers), *(f"vs {NAMES[p]}" for p in peers), "checks"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (1 + 2 * len(peers)) + "---|"]
    by_scenario: dict[str, list[PeerRow]] = {}
    for r in peer_rows:
        by_scenario.setdefault(r.scenario.split(": ", 1)[1], []).append(r)
    for scenario, group in by_scenario.items():
        of = {r.peer: r for r in group}
        cells = [scenario, group[0].unit, _cell(group[0].h5serve, group[0].unit)]
        cells += [_cell(of[p].baseline, of[p].unit) if p in of else "—" for p in peers]
        cells += [f"{of[p].ratio:.2f}x" if p in of and of[p].ratio else "—" for p in peers]
        failed = [r.failed for r in group if r.failed]
        cells.append("**failed**: " + "; ".join(failed) if failed else "passed")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def peers_section(rows: list[Row], report: dict, command: str, machine: str) -> str:
    """The *Peers* section of docs/benchmarks.md."""
    if not report:
        return "The peers group did not run (`--only` left it out)."
    if report.get("skipped"):
        return report["skipped"] + "."
    found = ", ".join(v for v in report["versions"].values() if not v.startswith("unavailable"))
    left = "".join(f" {NAMES[s]} was left out: {why}." for s, why in report.get("left_out", {}).items())
    load = report.get("load", [])
    busy = (f" The 1-minute load average was {load[0]:.1f} as the group started and {load[-1]:.1f} at its end "
            f"({os.cpu_count()} cores): other work shares this machine, so take the ratios, not the absolute "
            "figures." if load else "")
    return f"""Made by `{command}` on {machine}; peers: {found}.{left}{busy}

{peers_table(rows)}

The same 200,000 rows (x uint8 3x32x32, y = the row id as int64) as h5serve's HDF5 file, written
with Streaming's `MDSWriter` (columns `ndarray:uint8:3,32,32` and `int64`, no compression, the
default 67 MB shards) and LitData's `optimize` (64 MB chunks, its default). Every figure is rank 0
of a real `torchrun --standalone --nproc-per-node 2` job (gloo), both ranks iterating at once on
the same cores, since that is how each system runs and Streaming's dataset needs every rank of the
node (it barriers across them every epoch). Rank 0 reads 100,000 rows per epoch, shuffled, batch
256; samples/s is its best of {EPOCHS} epochs (the first includes start-up). Each system as its
docs recommend for local data:

- **h5serve**: a running daemon (`h5serve start`), `SharedH5Dataset(path, "x", "y",
  mode="global")` (the recommended mode: DistributedSampler's batches over every row) and
  `make_loader(ds, 256, num_workers=...)`.
- **Streaming**: `StreamingDataset(local=dir, remote=None, batch_size=256, shuffle=True)` (its
  default py1e shuffle) in a `DataLoader(batch_size=256)`, `persistent_workers=True` with workers.
- **LitData**: `StreamingDataset(dir, shuffle=True, drop_last=True)` in a
  `StreamingDataLoader(batch_size=256)`, `persistent_workers=True` with workers; `GLOBAL_RANK` is
  set from torchrun's `RANK` (LitData's DataLoader workers read `GLOBAL_RANK`).

*1 torch thread* is torchrun's default for 2 ranks (`OMP_NUM_THREADS=1`); *torch's default
threads* sets `OMP_NUM_THREADS` to the core count. *Workers=2*: 2 DataLoader workers per rank
(4 for the job), steady state; every batch then crosses from a worker to its rank through
DataLoader's queues, for h5serve too, which is why h5serve is fastest with `num_workers=0`
(docs/performance.md). *Beside a busy process*: a pure-Python spin loop on one core
runs throughout. *First batch*: the median over {report.get('repeat', 1)} launches, from launching torchrun to
rank 0's first
batch, with the data in the page cache and, for h5serve, the rows already in the daemon.
*Node memory*: 2 ranks x 2 workers after one full epoch, every process alive, the data files
evicted from the page cache before the job: PSS of torchrun, the ranks, their workers and the
daemon (mappings of the data files and of h5serve's segments left out), plus h5serve's segments
once, plus the data files' pages in the page cache (mincore), minus the same job on a
4,096-row copy of each (interpreter, torch and library overhead, and every worker's prefetch
buffers, which 8 batches a rank fill as the data does), as a multiple of the extra rows'
native size (x + y). h5serve's daemon evicts the HDF5 file's pages after its load.

*checks*: epoch 0 of every job, on rank 0: every label is a row id, rank 0 got half the rows
(LitData's `drop_last=True` drops at most a batch), duplicates only as padding, the two ranks
together saw every row (up to a batch per rank dropped), the order is shuffled, and the image
bytes of two batches are the file's rows for their labels. A failed check fails the row.

The peers are installed after torch without replacing it: `{INSTALL}` (the constraints pin
torch to the installed 2.13.0 and torchvision to 0.28.0, its match; Streaming also pins numpy
< 2.2, so a separate environment, e.g. `python -m venv --system-site-packages`, keeps the main
one's numpy). torchvision 0.28.0 on PyPI is a CUDA build whose ops do not load against the CPU
torch and Streaming imports torchvision at import time, so `bench/peer_jobs.py` imports Streaming
around it (a stand-in for the two names its vision datasets use; the bench uses none of them)."""
