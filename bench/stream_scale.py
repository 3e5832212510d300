"""Stream mode at scale: a window of very many small blocks (one chunk each) streamed for a
full epoch by N ranks from one daemon, every row checked once; the peak of the rank's
mappings (``/proc/self/maps`` lines) and descriptors, the epoch's time and both processes' CPU.

    python -m bench.stream_scale [--blocks 150000] [--block-kib 32] [--ranks 2]

Each rank is a process of its own (rank i of N, spawned, no process group needed: the sampler
deals the blocks by rank); rank CPU and peaks are the largest over the ranks, daemon CPU its
own (loaders are its children: counted once reaped).

A node with a budget of hundreds of GiB and files of small chunks is where stream mode is used;
a block per segment and a mapping per block would reach ``vm.max_map_count`` (65,530) there.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from multiprocessing import Queue, get_context
from pathlib import Path

import h5py
import numpy as np

from .common import BenchDaemon, log

ROW_BYTES = 1024


def scale_file(data_dir: Path, blocks: int, block_rows: int) -> Path:
    path = data_dir / f"scale-{blocks}x{block_rows}.h5"
    if path.exists():
        return path
    rows = blocks * block_rows
    # libver="latest": a fixed-size dataset's chunks indexed by a fixed array (the v1 B-tree made
    # 150,000 chunks take an hour to write); whole rows written, not broadcast by h5py
    with h5py.File(path.with_suffix(".tmp"), "w", libver="latest") as f:
        x = f.create_dataset("x", (rows, ROW_BYTES), dtype=np.uint8, chunks=(block_rows, ROW_BYTES))
        step = 65536
        for a in range(0, rows, step):
            b = min(rows, a + step)
            column = (np.arange(a, b, dtype=np.int64) % 251).astype(np.uint8)[:, None]
            x[a:b] = np.ascontiguousarray(np.broadcast_to(column, (b - a, ROW_BYTES)))
        f.create_dataset("y", data=np.arange(rows, dtype=np.int64))
    path.with_suffix(".tmp").rename(path)
    return path


def _count(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def _rank_epoch(path: Path, runtime_dir: Path, rank: int, ranks: int, block_rows: int,
                out: Queue) -> None:  # type: ignore[type-arg]
    """One rank's epoch (a process of its own): the rows it got, its CPU and its peaks."""
    from h5serve.client import SharedH5Dataset, make_loader

    ds = SharedH5Dataset(path, "x", "y", mode="stream", block_rows=block_rows, rank=rank, world_size=ranks,
                         runtime_dir=runtime_dir, fallback="error")
    try:
        maps0, fds0 = _count("/proc/self/maps"), len(os.listdir("/proc/self/fd"))
        peak_maps, peak_fds = maps0, fds0
        got = []
        wall, cpu = time.perf_counter(), time.process_time()
        for i, (xb, yb) in enumerate(make_loader(ds, 256, seed=0)):
            y = yb.numpy()
            got.append(y.copy())
            if not np.array_equal(xb.numpy()[:, 0], (y % 251).astype(np.uint8)):
                raise AssertionError(f"rank {rank} batch {i}: wrong rows")
            if i % 64 == 0:
                peak_maps = max(peak_maps, _count("/proc/self/maps"))
                peak_fds = max(peak_fds, len(os.listdir("/proc/self/fd")))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        window = ds._backend.config.capacity if hasattr(ds, "_backend") else -1  # noqa: SLF001
    finally:
        ds.close()
    out.put({"rank": rank, "rows": np.concatenate(got) if got else np.zeros(0, np.int64), "epoch_s": wall,
             "cpu_s": cpu, "maps_before": maps0, "maps_peak": peak_maps, "fds_before": fds0, "fds_peak": peak_fds,
             "window_blocks": window})


def stream_scale(data_dir: Path, blocks: int, block_kib: int, ranks: int = 1) -> dict[str, float]:
    """An epoch of ``ranks`` processes (rank i of ``ranks``, spawned) streaming ``blocks`` blocks
    of ``block_kib`` KiB from one daemon whose budget holds them all: every row once across the
    ranks, and each rank's peak mappings and descriptors."""
    block_rows = block_kib * 1024 // ROW_BYTES
    path = scale_file(data_dir, blocks, block_rows)
    budget = int(blocks * (block_kib + 4) * 1024 * 1.1) + (64 << 20)
    ctx = get_context("spawn")
    with BenchDaemon("--max-memory", str(budget)) as daemon:
        queue = ctx.Queue()
        procs = [ctx.Process(target=_rank_epoch, args=(path, daemon.runtime_dir, r, ranks, block_rows, queue))
                 for r in range(ranks)]
        wall = time.perf_counter()
        for proc in procs:
            proc.start()
        try:
            results = [queue.get(timeout=7200) for _ in procs]
        finally:
            for proc in procs:
                proc.join(timeout=60)
                if proc.is_alive():
                    proc.kill()
        wall = time.perf_counter() - wall
        daemon_cpu = _proc_cpu(daemon.pid)
    seen = np.bincount(np.concatenate([r["rows"] for r in results]), minlength=blocks * block_rows)
    assert (seen == 1).all(), "a row came more or less than once across the ranks"
    out = {"blocks": blocks, "block_kib": block_kib, "ranks": ranks,
           "window_blocks": max(r["window_blocks"] for r in results), "epoch_s": wall,
           "slowest_rank_s": max(r["epoch_s"] for r in results), "rank_cpu_s": max(r["cpu_s"] for r in results),
           "daemon_cpu_s": daemon_cpu, "maps_before": max(r["maps_before"] for r in results),
           "maps_peak": max(r["maps_peak"] for r in results), "fds_before": max(r["fds_before"] for r in results),
           "fds_peak": max(r["fds_peak"] for r in results), "max_map_count": _count_int("/proc/sys/vm/max_map_count"),
           "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}
    log(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in out.items()))
    return out


def _count_int(path: str) -> int:
    with open(path) as f:
        return int(f.read())


def _proc_cpu(pid: int | None) -> float:
    if pid is None:
        return -1.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return -1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=150_000)
    parser.add_argument("--block-kib", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=2, help="processes, rank i of N each (default 2)")
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/h5serve-bench-scale"))
    args = parser.parse_args()
    args.data_dir.mkdir(parents=True, exist_ok=True)
    stream_scale(args.data_dir, args.blocks, args.block_kib, args.ranks)


if __name__ == "__main__":
    main()
