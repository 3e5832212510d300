"""``python -m bench`` (or ``python bench/run.py``): every scenario in one run, printed as one
table of ratios.

    python -m bench                        # the full suite (~3-4 minutes on 2 quiet cores)
    python -m bench --write-docs           # ... and write docs/benchmarks.md, benchmarks.png, shuffle.png
    python -m bench --only iterate,memory  # some groups only (iterate includes lazy and loading)
    python -m bench --only shuffle         # shuffle quality per mode (deterministic, ~10 s)
    python -m bench --only stream          # stream mode: daemon vs lazy blocks and rows, CPU vs global (~1 min)
    python -m bench --only peers           # beside MosaicML Streaming and LitData (the bench-peers extra)
    python -m bench --only multinode       # 2 namespace nodes beside 1 (root: tests/cluster)
    python -m bench --only bigdata         # data 4-20x the budget, cold, beside the peers (~5-10 min)
    python -m bench --only remote          # s3:// on loopback S3: cold epoch vs a bare download, the peers (~5 min)

Data files are made on first use under --data-dir and kept. Speed is measured here, never
asserted in tests; rows with a target say whether this run met it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

if not __package__:  # run as a script, `python bench/run.py`: import the package it belongs to
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import bench  # noqa: F401

    __package__ = "bench"

from .common import BenchDaemon, Row, log, make_files, table
from .shuffle import Quality, as_dicts, shuffle_chart, shuffle_section, shuffle_table

GROUPS = ("iterate", "modes", "shuffle", "memory", "first-batch", "data-model", "stream", "peers", "multinode",
          "bigdata", "remote")
ROOT = Path(__file__).resolve().parent.parent


def first_batch(files: dict[str, Path], repeat: int) -> list[Row]:
    """Report only: a fresh 2-rank torchrun job, from launch to rank 0's first batch."""
    path = files["plain"]

    def launch(kind: str, runtime_dir: str) -> float:
        start = time.time()
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             "-m", "bench.jobs", kind, str(path), runtime_dir, "--first-batch"],
            capture_output=True, text=True, timeout=600, cwd=ROOT)
        lines = [line for line in done.stdout.splitlines() if line.startswith("first-batch ")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"torchrun {kind} job failed: {done.stderr[-2000:]}")
        return float(lines[0].split()[1]) - start

    with BenchDaemon() as daemon:
        launch("h5serve", str(daemon.runtime_dir))  # the load: later jobs find the daemon warm
        warm = [launch("h5serve", str(daemon.runtime_dir)) for _ in range(repeat)]
    seed = [launch("seed", "/nonexistent") for _ in range(repeat)]
    return [Row("first batch of a fresh 2-rank torchrun job (report only)", "s", float(np.median(warm)),
                float(np.median(seed)), higher_is_better=False,
                note="from launching torchrun; includes interpreter, torch and gloo start-up in both")]


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    import h5py
    import torch
    return (f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, Linux {platform.release()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}, h5py {h5py.__version__} (HDF5 "
            f"{h5py.version.hdf5_version}), numpy {np.__version__}")


def load_average() -> float:
    """The 1-minute load average (runnable processes, averaged), 0.0 where unknown."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def load_sentence(loads: dict[str, float]) -> str:
    """How busy the machine was: the load average as each group started and at the end."""
    shown = ", ".join(f"{name} {value:.1f}" for name, value in loads.items())
    cores = os.cpu_count() or 1
    busy = max(loads.values(), default=0.0) > cores
    return (f"1-minute load average as each group started and at the end: {shown} ({cores} cores; the bench "
            "itself accounts for about 1). "
            + ("Other work shared the machine during this run, so timings are below what a quiet machine gives "
               "(see *Under load* below)." if busy else "The machine was quiet (this run's load only)."))


def chart(rows: list[Row], out: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[bench]'): no chart")
        return False
    shown = [r for r in rows if r.ratio is not None or r.vs_limit is not None]
    labels = [r.scenario.split(" (")[0] for r in shown]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 0.45 * len(shown) + 1.5), sharey=True)
    y = np.arange(len(shown))
    colors = ["#2a9d8f" if getattr(r, "peer", "") else "#3b7dd8" for r in shown]
    ax1.barh(y, [r.ratio or 0 for r in shown], color=colors)
    ax1.set_xscale("log")
    ax1.axvline(1, color="grey", lw=0.8)
    ax1.set_xlabel("h5serve vs baseline (seed-style; mode rows: contiguous; green: the named peer) (x, log scale; "
                   "> 1 is better)")
    ax2.barh(y, [r.vs_limit or 0 for r in shown], color="#e3872d")
    ax2.set_xscale("log")
    ax2.axvline(1, color="grey", lw=0.8)
    ax2.set_xlabel("h5serve vs physical limit (x, log scale; 1 = at the limit)")
    ax1.set_yticks(y, labels, fontsize=8)
    ax1.invert_yaxis()
    fig.suptitle("h5serve benchmarks (python -m bench)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def under_load(rows: list[Row]) -> str:
    """How the machine's load bends the figures, with this run's own mode-row threads figures."""
    text = """h5serve's gather is a single-threaded `np.take` (docs/performance.md: torch's `index_select`,
which runs on torch's thread pool, one thread per core by default, lost up to 13x beside one
busy process: every parallel gather waits for its slowest thread to be scheduled again). The
limit rows are single-threaded too (a bare `np.take`), and the *beside one busy process* row
measures the loop with another process spinning on a core. A DDP job with several ranks per node
runs torch ops with `OMP_NUM_THREADS=1` (torchrun's default). The mode rows measure with one torch thread,
batches of the
three modes in turn so that the load falls on each alike, and give the default threads'
figures in their notes; the other rows use torch's default, and the load rows (MB/s) and ratios
against the seed, measured back to back rather than interleaved, move with the load too."""
    extra = next((r.extra for r in rows if "contiguous_mean_threads" in r.extra), None)
    if extra is None:
        return text
    return text + (f"\n\nIn this run, contiguous mode (rank 0 of 2, the mode rows' lockstep) averaged "
                   f"{extra['contiguous_mean_one_thread']:,.0f} samples/s with 1 torch thread and "
                   f"{extra['contiguous_mean_threads']:,.0f} with {extra['threads']}.")


def write_docs(rows: list[Row], qualities: list[Quality], command: str, took: float, loads: dict[str, float],
               png: bool, shuffle_png: bool, peers: dict | None = None) -> None:
    from .peers import peers_section

    docs = ROOT / "docs"
    text = f"""# Benchmarks

Made by `{command}` in {took / 60:.1f} minutes on {machine()}.
{load_sentence(loads)}

Every figure comes from the same run. *ratio* is h5serve against the seed-style baseline (the
predecessor's classes as its documentation describes them, in `bench/baselines.py`), higher is
better whatever the unit, except in the mode rows, whose baseline is h5serve itself in
contiguous mode (below); *vs limit* is h5serve against the physical limit measured in the same
run (1.00 = at the limit). Rows with a target say whether this run met it; speed is never
asserted in tests.

{table(rows)}

{"![ratios](benchmarks.png)" if png else "(no chart: matplotlib was not installed)"}

## What each row measures

- **ready**: a `SharedH5Dataset` for rank 0 of 2 (x 307 MB uint8 + y, served as float32) when the
  daemon already holds the shard, vs the seed's `RankMemCachedH5Dataset` preload (`f[key][a:b]`
  then `astype(float32)`). Limit: one memcpy of the shard into already-touched memory.
- **iterate shm**: one shuffled epoch of rank 0's shard (100,000 rows, batch 256), DataLoader
  `num_workers=0`. Baseline: the seed's rank-cached dataset (per-item indexing plus
  `default_collate`). Limit: a bare single-threaded gather of the same batches (precomputed):
  one `np.take` of x and one of y out of the same segment mapping into new tensors, each batch
  kept alive until the next (as a training loop keeps it). The note splits make_loader's time
  per batch into what it cannot skip: DataLoader's own per-batch work and the epoch's
  `torch.randperm` (the order DistributedSampler defines).
- **beside one busy process**: the same make_loader loop while another process spins on a core
  (a rank, a worker, another job), against the same loop just before without it.
- **workers=2**: steady state, persistent workers already started, for both.
- **lazy fallback**: no daemon; rows read through h5py. Baseline: the seed's `H5LazyDataset`
  (dataset looked up and indexed per item, 256 MB HDF5 chunk cache) over the same rows in the
  same order. The first epoch includes reading every chunk once.
- **load into shm**: from a client's request to a ready dataset on a fresh daemon whose loader
  processes are warm (rank 0 of 2, 154 MB of x). Limit: the bare copy of the same bytes from the
  file into a fresh `/dev/shm` file, its `posix_fallocate` included (a load reserves every page
  before it writes, so a full `/dev/shm` is a clear error up front): the faster of
  `pread`/`pwrite` through a 4 MiB buffer and `sendfile`, one process. *Reading rows*: the
  loader's read phase alone; limit: `pread`/`pwrite` into an already fallocated file. *Cold page
  cache*: the file dropped from the page cache first (`posix_fadvise(DONTNEED)`, no root
  needed), as on a cluster node; its limit is the bare copy from the cold file.
- **shuffle+gzip load**: the same with `--load-processes 2` vs `--load-processes 1`.
- **memory**: 2 jobs x 2 ranks x 2 DataLoader workers, float32 out, every process alive after a
  full epoch, the data file out of the page cache before they start: PSS of every rank, worker
  and the daemon, h5serve segments counted once, plus the data file's pages in the page cache
  (mincore), minus the same topology on a 4,096-row file (interpreter and torch overhead, and
  every worker's prefetch buffers: make_loader's ring slots, torch's queue, filled by 8 batches
  a rank as on the data), as a multiple of the extra rows' native size. Baseline: the seed's
  private float32 preload per rank (and
  the file it leaves cached). h5serve drops the file's pages once a load is published.
- **first batch**: a fresh `torchrun --nproc-per-node 2` job from launch to rank 0's first batch.
- **small files** (`bench/manyfiles.py`): 1,000 files of 16 rows each (x uint8 3x32x32, y int64)
  as one global-mode dataset, from `SharedH5Dataset("…/part_*.h5")` to x and y attached, on a
  fresh daemon each time (every file resolved, checked and loaded). Baseline: h5py opening every
  file and reading x and y in one process. The files are in the page cache.
- **variable-length rows** (`bench/vlen.py`): 1M rows of float32 sequences, mean length 32.
  Load: request to ready vs h5py reading the same rows (`dset[a:b]`). Iteration: make_loader
  (batch 256, shuffled; a list of tensors, or padded) vs h5py reading each batch's rows with a
  sorted fancy index, as a user would.
- **memory: a 2-rank job in global mode** (`bench/modes.py`): `/dev/shm` blocks of the daemon's
  segments (as `h5serve status --json` names them) once both ranks of a world-size-2 job have
  attached the global dataset, as a multiple of x.nbytes + y.nbytes. Baseline: the same job's
  two contiguous shards. Both are the file once: a node holds the rows once in either mode.
- **ready: a world-size-4 job attaching the global dataset**: the first job (world size 2)
  loaded it; a `SharedH5Dataset(mode="global", rank=0, world_size=4, dtype_x=float32)` attaches
  the same segments (nothing is loaded again). Baseline: the seed's preload of the same rows,
  every row (`RankMemCachedH5Dataset` rank 0 of 1, its float32 cast). Limit: memcpy of x.
- **global / node mode vs contiguous mode**: `make_loader` over rank 0 of 2 in global mode
  (DistributedShuffleSampler over all 200,000 rows: 100,000 samples per epoch), in node mode
  (one node of 2 ranks: NodeShuffleSampler over the node's rows, the whole file) and in
  contiguous mode (rank 0's 100,000-row shard), on the same file and daemon, batch 256, one
  torch thread (as torchrun runs each of 2 ranks on a node; see *Under load*); after a first
  epoch of each, the three loaders in lockstep, a batch of each in turn, each batch timed alone,
  over 5 epochs; samples/s of a typical batch (256 / the median batch time: a batch another
  process preempted is left out rather than charged to whichever mode it hit). The note gives
  the mean-based ratio, the same with torch's default threads, and the first epoch with its
  minor page faults: it faults in the pages of the segment it touches, and a global or node
  dataset maps the whole file where a contiguous one maps half, so its first epoch takes more
  faults (once per process). Later epochs gather from a mapping twice the size, a few percent
  slower at most (page-table walks; 4 KiB tmpfs pages).

## Peers: MosaicML Streaming and LitData

{peers_section(rows, peers or {}, command, machine())}

## Shuffle quality per mode

{shuffle_section(qualities, shuffle_png)}

## Under load

{under_load(rows)}

## Reading the load rows

A load writes to tmpfs pages. A loader never faults them in one by one through its mapping
(with 4 KiB pages that alone is slower than reading the rows): rows stored as numpy holds them
are copied from the file kernel-side (`splice`), other rows are read through h5py into a small
staging buffer and `pwrite`n, and each loader process hashes its rows (crc32) in a thread
that follows the copy. Request to ready is measured against the bare copy of the same bytes
into a fresh `/dev/shm` file with its `posix_fallocate`: what any loader that reserves its
memory up front must pay. A `read_direct` into ordinary process memory (in the note) is faster
still: it gets transparent huge pages and reserves nothing. Mounting `/dev/shm` with
`huge=within_size` closes much of that gap; see
[performance.md](performance.md#loading).

Results as JSON: `bench/results.json` (written with `--write-docs`; `--results PATH` writes them elsewhere).
"""
    (docs / "benchmarks.md").write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=200_000, help="rows of the uint8 datasets (default 200000)")
    p.add_argument("--float-rows", type=int, default=50_000, help="rows of the float32 dataset (same bytes)")
    p.add_argument("--data-dir", type=Path, default=Path("/tmp/h5serve-bench-data"))
    p.add_argument("--repeat", type=int, default=3, help="repetitions of timed steps (median)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per iteration measurement (best)")
    p.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated groups of {GROUPS}")
    p.add_argument("--write-docs", action="store_true",
                   help="write docs/benchmarks.md, docs/benchmarks.png and docs/shuffle.png")
    p.add_argument("--results", type=Path, default=None,
                   help="write the JSON here (default: bench/results.json, only with --write-docs: a run never "
                        "overwrites the committed results unless asked)")
    args = p.parse_args(argv)
    groups = [g.strip() for g in args.only.split(",") if g.strip()]
    unknown = set(groups) - set(GROUPS)
    if unknown:
        p.error(f"unknown groups {sorted(unknown)}; choose from {GROUPS}")
    os.chdir(ROOT)
    started = time.time()
    files = make_files(args.data_dir, args.rows, args.float_rows)
    from .memory import memory, tiny_copy
    from .modes import run_modes
    from .scenarios import run_iteration_suite
    from .shuffle import run_shuffle

    rows: list[Row] = []
    qualities: list[Quality] = []
    loads: dict[str, float] = {}
    peers: dict = {}
    big: dict = {}
    far: dict = {}
    for group in GROUPS:
        if group not in groups:
            continue
        loads[group] = load_average()
        if group == "iterate":
            rows += run_iteration_suite(files, tiny_copy(files["plain"]), args.repeat, args.epochs)
        elif group == "modes":
            rows += run_modes(files, args.repeat, args.epochs)
        elif group == "shuffle":
            qualities = run_shuffle(args.data_dir)
        elif group == "memory":
            rows += memory(files)
        elif group == "data-model":
            from .manyfiles import many_files
            from .vlen import vlen_rows

            log("many small files as one dataset")
            rows += many_files(args.data_dir, min(args.repeat, 2))
            log("variable-length rows")
            rows += vlen_rows(args.data_dir)
        elif group == "stream":
            from .stream import stream

            log("stream mode from the daemon and without it")
            rows += stream(args.data_dir, epochs=args.epochs)
            from .stream_cost import stream_cost

            log("stream mode's CPU against global mode at 5/25/100% windows")
            rows += stream_cost(args.data_dir, 256, epochs=args.epochs)
        elif group == "peers":
            from .peers import run_peers

            rows += run_peers(files, args.repeat, peers)
        elif group == "bigdata":
            from .bigdata import bigdata

            log("data bigger than the budget, cold, beside the peers")
            rows += bigdata(args.data_dir, report=big)
        elif group == "remote":
            from .remote import remote

            log("s3:// objects on a loopback S3 server, cold, beside a bare download and the peers")
            rows += remote(args.data_dir, report=far)
        elif group == "multinode":
            from .multinode import multinode

            log("a 2-node job beside a 1-node job, on namespace nodes")
            rows += multinode(files, args.repeat)
        else:
            log("first batch of a torchrun job")
            rows += first_batch(files, args.repeat)
    loads["end"] = load_average()
    took = time.time() - started
    print(table(rows))
    if qualities:
        print(shuffle_table(qualities))
    results = args.results or (ROOT / "bench" / "results.json" if args.write_docs else None)
    if results is not None:
        results.write_text(json.dumps(
            {"machine": machine(), "argv": sys.argv, "seconds": took, "load_average": loads,
             "rows": [r.as_dict() for r in rows], "shuffle": as_dicts(qualities), "peers": peers,
             "bigdata": big, "remote": far}, indent=1))
    if args.write_docs:
        command = "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])
        docs = ROOT / "docs"
        write_docs(rows, qualities, command.strip(), took, loads, chart(rows, docs / "benchmarks.png"),
                   bool(qualities) and shuffle_chart(qualities, docs / "shuffle.png"), peers)
    return 0 if all(r.met is not False for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
