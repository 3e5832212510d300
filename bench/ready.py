"""First batch against file size, cold (report only): how long a fresh job waits for its first
batch as the file grows, in global mode waiting for the load (``wait_ready=True``, as before
ready at once), global mode ready at once (the default: h5py serves while the daemon loads,
client/backends/progressive.py) and stream mode.

    python -m bench.ready [--sizes 512,2048,8192] [--data-dir /tmp/h5serve-bench-data] [--json out.json]

For each size, the file (bench/stream.py's: uint8 rows of 3x32x32, chunks of 256 rows, int64
labels) is dropped from the page cache (``posix_fadvise(DONTNEED)`` after an fsync), then one
rank (world size 1) opens it against a fresh daemon warmed by one tiny load (as a node's
daemon is), builds ``make_loader(ds, 256)`` and takes its first batch: "first batch" is from
the constructor to that batch, after imports. Global mode runs under a budget of 4x the file
(at most 20 GiB), stream mode under 128 MiB with blocks of 512 rows (bench/bigdata.py's). For
ready at once the run goes on iterating until the dataset serves from shared memory: "on shm
after" is when the first batch from the segments came, and how many batches h5py served before.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from .common import BenchDaemon, drop_page_cache, log
from .stream import stream_file, warm_daemon

BATCH = 256
STREAM_BUDGET = "128MiB"
STREAM_BLOCK_ROWS = 512
SYSTEMS = ("global-wait", "global-ready", "stream")  # wait_ready=True; the default (ready at once); stream


def one(path: Path, system: str) -> dict:
    """Seconds from the constructor to the first batch of ``system`` on a cold ``path``."""
    from h5serve.client import SharedH5Dataset, make_loader

    size = os.path.getsize(path)
    budget = STREAM_BUDGET if system == "stream" else str(min(4 * size, 20 << 30))
    with BenchDaemon("--max-memory", budget) as daemon:
        warm_daemon(path.parent, daemon.runtime_dir)
        drop_page_cache(path)
        t = time.perf_counter()
        if system == "stream":
            kw: dict = {"mode": "stream", "block_rows": STREAM_BLOCK_ROWS, "fallback": "error"}
        else:
            kw = {"mode": "global", "wait_ready": True if system == "global-wait" else None}
        ds = SharedH5Dataset(path, "x", "y", rank=0, world_size=1, runtime_dir=daemon.runtime_dir, timeout=600, **kw)
        opened = time.perf_counter() - t
        backend = ds.backend
        loader = make_loader(ds, BATCH)
        batches = iter(loader)
        next(batches)
        out = {"first_s": time.perf_counter() - t, "open_s": opened, "backend": backend}
        if system == "global-ready":
            lazy = 0 if backend == "shm" else 1
            while ds.backend != "shm":
                if next(batches, None) is None:  # a small file: another epoch
                    batches = iter(loader)
                lazy += 1
            next(batches, None)
            out.update(shm_s=time.perf_counter() - t, lazy_batches=lazy)
        del batches, loader
        ds.close()
    return out


def first_batch(data_dir: Path, sizes: list[int], systems: tuple[str, ...] = SYSTEMS) -> dict:
    """``{"<MiB> MiB": {"bytes": file size, system: figures}}`` for every size."""
    out: dict = {}
    for mib in sizes:
        path = stream_file(data_dir, mib)
        row = out[f"{mib} MiB"] = {"bytes": os.path.getsize(path)}
        for system in systems:
            row[system] = one(path, system)
            log(f"ready: {mib} MiB {system}: {row[system]}")
    return out


def markdown(report: dict) -> str:
    lines = ["| file | global, waits for the load (s) | global, ready at once (s) | on shm after (s, batches "
             "from h5py before) | stream (s) |", "|---|---:|---:|---:|---:|"]
    for name, row in report["sizes"].items():
        wait, ready, stream = (row.get(s, {}) for s in SYSTEMS)
        shm = f"{ready['shm_s']:.2f} ({ready['lazy_batches']})" if "shm_s" in ready else "—"
        lines.append(f"| {name} ({row['bytes'] / 1e9:.2f} GB) | {wait.get('first_s', float('nan')):.2f} | "
                     f"{ready.get('first_s', float('nan')):.2f} | {shm} | {stream.get('first_s', float('nan')):.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.ready", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, default=Path("/tmp/h5serve-bench-data"))
    p.add_argument("--sizes", default="512,2048,8192", help="file sizes, MiB")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="some of " + ",".join(SYSTEMS))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None, help="print the table of a saved --json, run nothing")
    a = p.parse_args()
    if a.markdown:
        print(markdown(json.loads(a.markdown.read_text())))
        return
    report = first_batch(a.data_dir, [int(s) for s in a.sizes.split(",")], tuple(a.systems.split(",")))
    print(markdown({"sizes": report}))
    if a.json:
        a.json.write_text(json.dumps({"sizes": report, "load": os.getloadavg()[0]}, indent=1))


if __name__ == "__main__":
    main()
