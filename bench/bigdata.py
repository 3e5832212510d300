"""The ``bigdata`` group: data bigger than the budget, from a cold file, 2 ranks (report only).

    python -m bench --only bigdata
    python -m bench.bigdata [--mib 256] [--budgets 5,10,25] [--sizes 256,1024] [--quick]

A uint8 file (rows of 3x32x32, chunks of 256 rows, labels = row ids) of ``--mib`` MiB. For each
budget (a share of the data), every system runs as a real ``torchrun --nproc-per-node 2`` job
(``bench/bigdata_jobs.py``, 2 epochs, a 2 ms sleep per step as a GPU step, workers=0), the file
(or the peer's shards) dropped from the page cache before each job (``posix_fadvise(DONTNEED)``
after an fsync, no root needed): h5serve stream mode from a daemon with ``--max-memory`` = the
budget, lazy h5py (global mode, no daemon: one run, the budget does not apply), MosaicML
Streaming with ``cache_limit`` = the budget and LitData with ``max_cache_size`` = the budget, each
on the same rows written with its own writer (bench/peers.py), reading them from the data dir as
their "remote" into a private local cache. Streaming's MDS shards are written with ``size_limit`` =
a quarter of the smallest budget (``shard_bytes``: it refuses a ``cache_limit`` under 4x its largest
shard, and its default 64 MiB shards would need 256 MiB), one MDS dir for every budget; its default
py1e shuffle thrashes below its working set, so every job's epoch is cut after ``MAX_EPOCH_S``
(rank 0 reports the rows it got), and ``py1e_order`` gives its order's entropy and overlap over
whole epochs from Streaming's own shuffle code. ``--systems`` runs some of the jobs only,
``--no-extras`` skips the training check and the first batch. The physical limit is a bare sequential read of the
cold file. Bytes read are the ``read_bytes`` of ``/proc/<pid>/io`` (storage reads) of every
process of the job and the daemon, sampled every 0.1 s (a process that exits between samples
loses its last reads). Peak memory: the daemon's ``status`` (h5serve) or the peer's local cache
directory (its bounded cache is on disk, not in shared memory).

Also: shuffle quality (Streaming's neighbour-difference entropy of rank 0's epoch-0 labels,
and rank 0's overlap between its two epochs), a training check (scikit-learn's digits repeated
and sorted by label, a logistic regression in torch: stream mode at a 10% and a 25% window vs
global mode vs file order, 10 seeds, test accuracy after 1, 3 and 8 epochs of each run) and the first
batch against file size, cold (stream and global mode).

Stream blocks: what ``h5serve inspect`` recommends for each budget (``recommended_block``: the
default ~8 MiB block, or smaller whole chunks so that the window holds 8), or ``--block-rows``
at every budget. Rank 0 also reports its block waits (DaemonBlocks' counters) and its
samples/s after the first batch (the stream's pace without the job's start-up).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import h5py
import numpy as np

from h5serve.order.stream_order import neighbour_entropy

from .common import BenchDaemon, Row, drop_page_cache, log, table
from .memory import _tree
from .peers import NAMES, data_files, peer_dir, source_file, versions
from .stream import memory_peak, stream_file

ROOT = Path(__file__).resolve().parent.parent
BLOCK_ROWS = 512  # 1.5 MiB blocks: a 5% window of 256 MiB still holds 8 of them (the first-batch figure)
JOB_TIMEOUT = 240
MAX_EPOCH_S = 60  # Streaming below its working set copies a shard for nearly every row (#339): cut its epoch
EPOCHS = 2
SYSTEMS = ("stream", "lazy", "streaming", "litdata")
TRAIN_SEEDS = 10  # the training check: 3 seeds could not tell a 1-point gap from noise
TRAIN_EPOCHS = (1, 3, 8)  # test accuracy after each of these epochs of one run; the last is the final one


def seq_read(path: Path) -> float:
    drop_page_cache(path)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass
    return time.perf_counter() - t


def _read_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))
    except (OSError, StopIteration, ValueError):
        return None


def _du(path: Path) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(root, n)).st_size
            except OSError:
                pass
    return total


def job(system: str, data: Path, *, runtime_dir: Path | None = None, daemon_pid: int | None = None,
        budget: int = 0, epochs: int = EPOCHS, block_rows: int = BLOCK_ROWS) -> dict:
    """One cold 2-rank job: rank 0's result plus ``launch``, ``read_bytes``, ``peak_cache``."""
    for f in data_files(data):
        drop_page_cache(f)
    cache = Path(tempfile.mkdtemp(prefix=f"h5s-bigdata-{system}-", dir="/tmp"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "bench.bigdata_jobs", system, str(data), "--budget", str(budget), "--cache", str(cache),
           "--block-rows", str(block_rows), "--epochs", str(epochs), "--max-epoch-s", str(MAX_EPOCH_S)]
    if runtime_dir is not None:
        cmd += ["--runtime-dir", str(runtime_dir)]
    base = {p: _read_bytes(p) or 0 for p in (_tree(daemon_pid) if daemon_pid else [])}
    seen: dict[int, int] = {}
    peak = [0]
    stop = threading.Event()
    launch = time.time()
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, start_new_session=True)

    def sample() -> None:
        while not stop.is_set():
            for p in _tree(proc.pid) + (_tree(daemon_pid) if daemon_pid else []):
                r = _read_bytes(p)
                if r is not None:
                    seen[p] = max(seen.get(p, 0), r - base.get(p, 0))
            if system in ("streaming", "litdata"):
                peak[0] = max(peak[0], _du(cache))
            stop.wait(0.1)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        out, _ = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        for pid in _tree(proc.pid):  # torchrun's ranks are not in its process group
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        os.killpg(proc.pid, 9)
        proc.wait()
        return {"failed": f"timed out after {JOB_TIMEOUT} s"}
    finally:
        stop.set()
        thread.join(10)
        subprocess.run(["rm", "-rf", str(cache)], check=False)
    lines = [line for line in out.splitlines() if line.startswith("result ")]
    err.seek(0)
    text = [line for line in err.read().decode(errors="replace").splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        why = ([line.split("]:", 1)[-1].strip() for line in text if "Error:" in line and line.startswith("[rank")]
               or [line for line in text if "Error:" in line] or text[-2:])
        if not lines:
            return {"failed": f"exit {proc.returncode}: {why[-1][:400]}"}
    r = json.loads(lines[0][len("result "):])
    # rank 0 reports before the job's closing barrier: its figures stand when another rank's epoch was cut
    r["others_cut"] = sorted({int(line.split()[1].rstrip(":")) for line in text
                              if line.startswith("rank ") and "epoch cut after" in line} - {0})
    r.update(launch=launch, read_bytes=sum(seen.values()), peak_cache=peak[0])
    return r


def figures(r: dict, size: int) -> dict:
    """Rank 0's figures of a job's result (or its failure)."""
    if "failed" in r:
        return {"failed": r["failed"]}
    labels = [np.asarray(e, dtype=np.int64) for e in r["labels"]]
    t0 = r["ends"][0] - r["launch"]
    whole = len(labels) > 1 and not any(r.get("cut", []))
    overlap = len(np.intersect1d(labels[0], labels[1])) / max(1, len(np.unique(labels[0]))) if whole else None
    return {"epoch0_s": t0, "samples_s": len(labels[0]) / t0, "first_s": r["first_batch"] - r["launch"],
            "wait_share": r["waited"][0] / max(1, r["steps"][0]), "wait_time_share": r["wait"][0] / t0,
            "read_x": r["read_bytes"] / size, "peak_cache": r["peak_cache"], "entropy": neighbour_entropy(labels[0]),
            "overlap": overlap, "samples": len(labels[0]), "blocks": r.get("blocks", {}),
            "steady_s": len(labels[0]) / max(r["ends"][0] - r["first_batch"], 1e-9), "cut": r.get("cut", []),
            "others_cut": r.get("others_cut", [])}


def py1e_order(mds: Path, epochs: int = EPOCHS, ranks: int = 2, block: int | None = None) -> dict:
    """Rank 0's full-epoch labels in Streaming's default order for ``mds``, from its own
    ``get_partitions`` and ``get_shuffle`` as ``generate_work_random_batching`` calls them (py1e,
    1 canonical node, seed 9176, ``shuffle_block_size`` max(4,000,000 // 1, 2**18), 1 worker a
    rank): its entropy and overlap over whole epochs, where a thrashing job's epoch was cut.
    ``block``: another ``shuffle_block_size`` (py1e at equal memory: the rows a budget holds,
    so that the shards one shuffle block draws from fit the cache and nothing is fetched twice)."""
    from .peer_jobs import import_streaming

    import_streaming()
    from streaming.base.partition import get_partitions
    from streaming.base.shuffle import get_shuffle

    sizes = np.array([s["samples"] for s in json.loads((mds / "index.json").read_text())["shards"]], np.int64)
    block = max(4_000_000 // 1, 1 << 18) if block is None else block
    labels = []
    for epoch in range(epochs):
        ids = get_partitions("relaxed", int(sizes.sum()), 1, 1, ranks, 1, 256, 0, None)
        shuffle = get_shuffle("py1e", sizes, 1, 9176, epoch, block)
        ids = np.where(ids != -1, shuffle[ids], -1)[0, 0, 0].ravel()
        labels.append(ids[ids != -1])
    overlap = len(np.intersect1d(labels[0], labels[1])) / len(np.unique(labels[0])) if epochs > 1 else None
    return {"entropy": neighbour_entropy(labels[0]), "overlap": overlap, "rows": len(labels[0]),
            "shards": len(sizes), "shuffle_block_size": block, "labels0_head": labels[0][:2048].tolist()}


def recommended_block(path: Path, budget: int) -> int:
    """The block ``h5serve inspect`` recommends for ``path``'s x and y under ``budget``
    (stream_plan.plan_window: the default block, or smaller whole chunks for 8 in the window)."""
    from h5serve.order.stream_plan import plan_window

    with h5py.File(path) as f:
        keys = [f[k] for k in ("x", "y")]
        chunks = [d.chunks[0] if d.chunks else 1 for d in keys]
        row_bytes = [int(np.prod(d.shape[1:], dtype=np.int64)) * d.dtype.itemsize for d in keys]
        rows = keys[0].shape[0]
    window = plan_window(chunks, row_bytes, rows, budget)
    assert window is not None, budget
    return window.block_rows


def row_bytes(path: Path) -> int:
    """Bytes of one row of x and y together."""
    with h5py.File(path) as f:
        return sum(int(np.prod(f[k].shape[1:], dtype=np.int64)) * f[k].dtype.itemsize for k in ("x", "y"))


def shard_bytes(size: int, shares: list[int]) -> int:
    """Streaming's MDS shard size limit: a quarter of the smallest budget, whole MiB (Streaming
    refuses a ``cache_limit`` under 4x its largest shard), so one MDS dir serves every budget
    and its rows differ only in ``cache_limit``."""
    return max(1 << 20, (size * min(shares) // 100 // 4) >> 20 << 20)


def big(data_dir: Path, mib: int, shares: list[int], peers: list[str],
        block_rows: int | None = None, systems: tuple[str, ...] = SYSTEMS) -> tuple[list[Row], dict]:
    plain = stream_file(data_dir, mib)
    source = source_file(plain)
    size = os.path.getsize(source)
    peers = [s for s in peers if s in systems]
    shard = shard_bytes(size, shares)
    dirs = {s: peer_dir(source, s, shard) for s in peers}
    out: dict = {"size": size, "seq_s": seq_read(source), "budgets": {}, "streaming_shard_bytes": shard}
    log(f"bigdata: {size / 2**20:.0f} MiB, bare cold read {out['seq_s']:.2f} s")
    if "streaming" in dirs:
        out["py1e_order"] = py1e_order(dirs["streaming"])
    if "lazy" in systems:
        out["lazy"] = figures(job("lazy", source), size)
        log(f"bigdata: lazy h5py {out['lazy']}")
    rows: list[Row] = []
    for share in shares:
        budget = size * share // 100
        res: dict = {}
        block = block_rows or recommended_block(source, budget)
        with BenchDaemon("--max-memory", str(budget)) as daemon:
            with memory_peak(daemon.runtime_dir) as mem:
                res["stream"] = figures(job("stream", source, runtime_dir=daemon.runtime_dir,
                                            daemon_pid=daemon.pid, block_rows=block), size)
            res["stream"]["block_rows"] = block
            if "failed" not in res["stream"]:
                res["stream"]["peak_cache"] = mem["max"]
                res["stream"]["budget_seen"] = mem["budget"]
        for s in peers:
            res[s] = figures(job(s, dirs[s], budget=budget), size)
        for s, f in res.items():
            log(f"bigdata {share}%: {s}: {f}")
        out["budgets"][share] = {"budget": budget, **res}
        if "streaming" in dirs:  # py1e whose shuffle block holds what the budget holds (x and y rows)
            out["budgets"][share]["py1e_equal"] = py1e_order(dirs["streaming"], block=budget // row_bytes(source))
        st = res["stream"]
        what = f"{mib} MiB cold, budget {share}% ({budget / 2**20:.1f} MiB), 2 ranks"
        if "failed" in st:
            rows.append(Row(f"bigdata stream epoch 0, {what}: FAILED {st['failed'][:200]} (report only)", "s", 0.0))
            continue
        rows.append(Row(f"bigdata epoch 0 with start-up, stream vs lazy h5py, {what} (report only)", "s",
                        st["epoch0_s"], out.get("lazy", {}).get("epoch0_s"), limit=out["seq_s"],
                        higher_is_better=False))
        for s in peers:
            p = res[s]
            rows.append(Row(f"bigdata samples/s, stream vs {NAMES[s]}, {what} (report only)", "samples/s",
                            st["samples_s"], p.get("samples_s"), note=p.get("failed", "")[:300]))
        rows.append(Row(f"bigdata peak shared memory vs budget, {what} (report only)", "MiB",
                        st["peak_cache"] / 2**20, budget / 2**20, higher_is_better=False))
    return rows, out


# ----- training check ---------------------------------------------------------------------
def digits_file(directory: Path, repeat: int) -> tuple[Path, np.ndarray, np.ndarray]:
    """scikit-learn's digits (train split) repeated and sorted by label; the test split returned."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = d.data.astype(np.float32) / 16.0, d.target.astype(np.int64)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(y))
    test, train = order[: len(y) // 5], order[len(y) // 5:]
    xt, yt = np.tile(x[train], (repeat, 1)), np.tile(y[train], repeat)
    by = np.argsort(yt, kind="stable")
    path = directory / f"digits-sorted-{repeat}.h5"
    if not path.exists():
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=xt[by], chunks=(64, 64))
            f.create_dataset("y", data=yt[by], chunks=(64,))
    return path, x[test], y[test]


def train(path: Path, xt: np.ndarray, yt: np.ndarray, how: str, seed: int, epochs: tuple[int, ...] = TRAIN_EPOCHS,
          share: int = 10) -> dict[int, float]:
    """Test accuracy after each of ``epochs`` (one run of ``max(epochs)`` epochs)."""
    import torch

    from h5serve.client import SharedH5Dataset, make_loader

    torch.manual_seed(seed)
    with h5py.File(path, "r") as f:
        size = f["x"].size * 4
    kw: dict = ({"mode": "stream", "window": size * share // 100, "block_rows": 128} if how == "stream"
                else {"mode": "global"})
    ds = SharedH5Dataset(path, "x", "y", rank=0, world_size=1, runtime_dir="/nonexistent", **kw)
    loader = make_loader(ds, 64, seed=seed, shuffle=how != "file order")
    model = torch.nn.Linear(64, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    accuracy: dict[int, float] = {}
    for epoch in range(max(epochs)):
        for owner in (loader.batch_sampler, loader.sampler):
            if hasattr(owner, "set_epoch"):
                owner.set_epoch(epoch)
                break
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x.float()), y.long()).backward()
            opt.step()
        if epoch + 1 in epochs:
            with torch.no_grad():
                accuracy[epoch + 1] = float((model(torch.from_numpy(xt)).argmax(1).numpy() == yt).mean())
    ds.close()
    return accuracy


def training(data_dir: Path) -> dict:
    try:
        path, xt, yt = digits_file(data_dir, 20)
    except ImportError:
        return {"skipped": "scikit-learn is not installed"}
    out = {}
    for name, how, share in (("stream, 10% window", "stream", 10), ("stream, 25% window", "stream", 25),
                             ("global", "global", 0), ("file order", "file order", 0)):
        runs = [train(path, xt, yt, how, seed, share=share) for seed in range(TRAIN_SEEDS)]
        out[name] = {str(e): {"mean": float(np.mean([r[e] for r in runs])), "std": float(np.std([r[e] for r in runs],
                                                                                                ddof=1)),
                              "runs": [r[e] for r in runs]} for e in TRAIN_EPOCHS}
        log(f"bigdata training: {name}: {out[name]}")
    return out


# ----- first batch against size -----------------------------------------------------------
def first_batch(data_dir: Path, sizes: list[int]) -> dict:
    """Stream mode and global mode waiting for its load (bench/ready.py measures both, and
    global mode ready at once)."""
    from .ready import one

    out: dict = {}
    for mib in sizes:
        path = stream_file(data_dir, mib)
        for mode, system in (("stream", "stream"), ("global", "global-wait")):
            out[f"{mib} MiB {mode}"] = one(path, system)["first_s"]
            log(f"bigdata first batch {mib} MiB {mode}: {out[f'{mib} MiB {mode}']:.2f} s")
    return out


def bigdata(data_dir: Path, mib: int = 256, shares: tuple[int, ...] = (5, 10, 25), sizes: tuple[int, ...] = (256, 1024),
            report: dict | None = None, block_rows: int | None = None, systems: tuple[str, ...] = SYSTEMS,
            extras: bool = True) -> list[Row]:
    """``systems``: the jobs to run (h5serve stream always runs); ``extras``: the training check
    and the first batch against size too."""
    report = {} if report is None else report
    report["load"] = [os.getloadavg()[0]]
    found = versions()
    peers = [s for s, v in found.items() if not v.startswith("unavailable")]
    report["versions"] = found
    rows, report["big"] = big(data_dir, mib, list(shares), peers, block_rows, systems)
    if extras:
        report["training"] = training(data_dir)
        report["first_batch"] = first_batch(data_dir, list(sizes))
    report["load"].append(os.getloadavg()[0])
    return rows


def markdown(report: dict) -> str:
    """The docs tables of one run's report (``--json``): per budget and system, then the rest."""
    b = report["big"]
    lines = ["| budget | system | block | epoch 0 incl. start-up (s) | vs bare read | samples/s (rank 0) "
             "| samples/s after the first batch | steps waiting > 1 ms | time in next() | first batch (s) "
             "| disk reads / data | peak memory (MiB) | entropy (bits) | rank-0 overlap e0/e1 |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def line(budget: str, name: str, f: dict) -> None:
        if "failed" in f:
            lines.append(f"| {budget} | {name} | failed: {f['failed'][:160]} |" + " |" * 12)
            return
        peak = f"{f['peak_cache'] / 2**20:.1f}" if f["peak_cache"] else "— (process memory, not measured)"
        block = f"{f['block_rows']} rows" if "block_rows" in f else "—"
        if any(f.get("cut", [])):
            name += f" (epoch 0 cut at {MAX_EPOCH_S} s: {f['samples']:,} rows)"
        if f.get("others_cut"):
            ranks = ", ".join(map(str, f["others_cut"]))
            name += f" (rank 0's figures; rank {ranks} did not end an epoch within {MAX_EPOCH_S} s)"
        steady = f"{f['steady_s']:,.0f}" if "steady_s" in f else "—"
        lines.append(f"| {budget} | {name} | {block} | {f['epoch0_s']:.2f} | {b['seq_s'] / f['epoch0_s']:.3f}x | "
                     f"{f['samples_s']:,.0f} | {steady} | {f['wait_share']:.0%} | {f['wait_time_share']:.0%} | "
                     f"{f['first_s']:.2f} | "
                     f"{f['read_x']:.2f} | {peak} | {f['entropy']:.2f} | "
                     f"{'—' if f['overlap'] is None else format(f['overlap'], '.3f')} |")

    if "lazy" in b:
        line("—", "lazy h5py (global, no daemon)", b["lazy"])
    for share, res in b["budgets"].items():
        budget = f"{share}% ({res['budget'] / 2**20:.1f} MiB)"
        for s in ("stream", "streaming", "litdata"):
            if s in res:
                line(budget, "h5serve stream" if s == "stream" else NAMES[s], res[s])
    if "py1e_order" in b:
        o = b["py1e_order"]
        lines += ["", f"Streaming's py1e order over whole epochs ({o['shards']} shards, shuffle_block_size "
                  f"{o['shuffle_block_size']:,}): entropy {o['entropy']:.2f} bits, rank-0 overlap {o['overlap']:.3f}."]
    equal = [(share, res) for share, res in b["budgets"].items() if "py1e_equal" in res]
    if equal:
        lines += ["", "| budget | h5serve stream's entropy (bits) | py1e at equal memory: shuffle_block_size "
                  "| its entropy (bits) | its rank-0 overlap |", "|---|---:|---:|---:|---:|"]
        for share, res in equal:
            o, mine = res["py1e_equal"], res["stream"].get("entropy")
            lines.append(f"| {share}% | {'—' if mine is None else format(mine, '.2f')} | {o['shuffle_block_size']:,} | "
                         f"{o['entropy']:.2f} | {o['overlap']:.3f} |")
    t = report.get("training", {})
    epochs = sorted({int(e) for v in t.values() if isinstance(v, dict) for e in v})
    lines += ["", f"| order | test accuracy after {' / '.join(map(str, epochs))} epochs, mean ± sample std over "
              f"{TRAIN_SEEDS} seeds |", "|---|---|"]
    lines += [f"| {k} | " + " / ".join(f"{v[str(e)]['mean']:.3f} ± {v[str(e)]['std']:.3f}" for e in epochs) + " |"
              for k, v in t.items() if isinstance(v, dict)]
    lines += ["", "| file, mode | first batch, cold (s) |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in report.get("first_batch", {}).items()]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bigdata", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, default=Path("/tmp/h5serve-bench-data"))
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--budgets", default="5,10,25", help="budgets, percent of the data")
    p.add_argument("--sizes", default="256,1024", help="file sizes (MiB) of the first-batch figure")
    p.add_argument("--block-rows", type=int, default=None,
                   help="stream blocks (rows) at every budget (default: what inspect recommends for each budget)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help="jobs to run, of " + ",".join(SYSTEMS) + " (h5serve stream always runs)")
    p.add_argument("--no-extras", action="store_true", help="skip the training check and the first batch vs size")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None, help="print the docs tables of a saved --json, run nothing")
    a = p.parse_args()
    if a.markdown:
        print(markdown(json.loads(a.markdown.read_text())))
        return

    report: dict = {}
    rows = bigdata(a.data_dir, a.mib, tuple(int(s) for s in a.budgets.split(",")),
                   tuple(int(s) for s in a.sizes.split(",")), report=report, block_rows=a.block_rows,
                   systems=tuple({"stream", *a.systems.split(",")}), extras=not a.no_extras)
    print(table(rows))
    print(json.dumps(report, indent=1, default=str))
    if a.json:
        a.json.write_text(json.dumps({"rows": [r.as_dict() for r in rows], **report}, indent=1, default=str))


if __name__ == "__main__":
    main()
