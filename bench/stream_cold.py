"""Stream mode's cold epoch against HDF5's own limit: a 2 GiB file (524,288 rows of 4 KiB,
256-row chunks, int64 labels) out of the page cache, a daemon with ``--max-memory 512MiB``,
2 ranks (processes) from dataset construction to the end of epoch 0; beside it, in the same
run, a bare sequential read of the file and h5py's ``read_direct`` of all of ``x``, each from a
cold page cache.

    python -m bench.stream_cold [--mib 2048] [--budget 512MiB] [--ranks 2]

CPU is the whole machine's busy time over each step (``/proc/stat``), so that the daemon's
loaders count: quote it quiet.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

from .common import BenchDaemon, drop_page_cache, log

ROW_BYTES, CHUNK_ROWS = 4096, 256

_RANK = r"""
import sys, time
from pathlib import Path
from h5serve.client import SharedH5Dataset, make_loader
path, runtime_dir, rank, world, go = sys.argv[1:6]
while not Path(go).exists():
    time.sleep(0.001)
start = time.perf_counter()
ds = SharedH5Dataset(path, "x", "y", mode="stream", rank=int(rank), world_size=int(world), runtime_dir=runtime_dir,
                     fallback="error")
n = 0
for x, y in make_loader(ds, 256, seed=0):
    n += len(x)
print(time.perf_counter() - start, n, ds.backend, flush=True)
ds.close()
"""


def cold_file(directory: Path, mib: int) -> Path:
    rows = (mib << 20) // ROW_BYTES // CHUNK_ROWS * CHUNK_ROWS
    path = directory / f"cold-{rows}.h5"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    log(f"writing {path} ({rows} rows of {ROW_BYTES} B)")
    tmp = path.with_suffix(".tmp")
    with h5py.File(tmp, "w") as f:
        x = f.create_dataset("x", (rows, ROW_BYTES), dtype=np.uint8, chunks=(CHUNK_ROWS, ROW_BYTES))
        step = CHUNK_ROWS * 64
        for a in range(0, rows, step):
            b = min(rows, a + step)
            x[a:b] = np.broadcast_to((np.arange(a, b) % 251).astype(np.uint8)[:, None], (b - a, ROW_BYTES))
        f.create_dataset("y", data=np.arange(rows, dtype=np.int64), chunks=(CHUNK_ROWS * 64,))
    tmp.replace(path)
    return path


def _busy() -> float:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def bare_read(path: Path) -> tuple[float, float]:
    drop_page_cache(path)
    busy, start = _busy(), time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.read(fd, 8 << 20):
            pass
    finally:
        os.close(fd)
    return time.perf_counter() - start, _busy() - busy


def h5py_read(path: Path) -> tuple[float, float]:
    drop_page_cache(path)
    busy, start = _busy(), time.perf_counter()
    with h5py.File(path, "r") as f:
        x = f["x"]
        out = np.empty(x.shape, x.dtype)
        x.read_direct(out)
    elapsed = time.perf_counter() - start
    del out
    return elapsed, _busy() - busy


def stream_epoch(path: Path, budget: str, ranks: int) -> tuple[float, float, list[str]]:
    with BenchDaemon("--max-memory", budget) as daemon, tempfile.TemporaryDirectory() as tmp:
        go = Path(tmp) / "go"
        procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(path), str(daemon.runtime_dir), str(r), str(ranks),
                                   str(go)], stdout=subprocess.PIPE, text=True) for r in range(ranks)]
        try:
            time.sleep(3)  # the ranks have imported torch and h5serve
            drop_page_cache(path)
            busy = _busy()
            go.touch()
            outs = [p.communicate(timeout=900)[0].split() for p in procs]
            busy = _busy() - busy
        finally:
            for p in procs:
                p.kill()
    if any(len(o) != 3 or o[2] != "shm" for o in outs):
        raise RuntimeError(f"a rank did not stream from the daemon: {outs}")
    return max(float(o[0]) for o in outs), busy, [o[1] for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.stream_cold", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, default=Path("/tmp/h5serve-bench-data"))
    p.add_argument("--mib", type=int, default=2048)
    p.add_argument("--budget", default="512MiB")
    p.add_argument("--ranks", type=int, default=2)
    a = p.parse_args()
    path = cold_file(a.data_dir, a.mib)
    gib = os.path.getsize(path) / 2**30
    bare, bare_cpu = bare_read(path)
    direct, direct_cpu = h5py_read(path)
    epoch, epoch_cpu, rows = stream_epoch(path, a.budget, a.ranks)
    log(f"bare read {bare:.2f} s ({bare_cpu:.2f} s CPU), h5py read_direct {direct:.2f} s ({direct_cpu:.2f} s CPU), "
        f"stream epoch 0 from construction {epoch:.2f} s ({epoch_cpu:.2f} s CPU, machine-wide; rows per rank {rows})")
    print(f"| {gib:.1f} GiB cold, budget {a.budget}, {a.ranks} ranks | stream epoch 0 | {epoch:.2f} s | "
          f"vs h5py read_direct {direct / epoch:.2f}x | vs bare read {bare / epoch:.2f}x | "
          f"CPU/GiB stream {epoch_cpu / gib:.2f} s, h5py {direct_cpu / gib:.2f} s |")


if __name__ == "__main__":
    main()
