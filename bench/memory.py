"""Node memory of 2 jobs x 2 ranks x 2 DataLoader workers on the same file and shard plan.

Memory is PSS (each shared page divided among the processes that map it), summed over every
rank, worker and the daemon; h5serve's segment files are counted once, whole, whether mapped
or not; the page cache the data file holds while they run counts too (a reader that leaves
the file cached holds the data twice). Interpreter, torch and library overhead is taken out by running the same
topology on
a tiny file of the same row shape (the control), so what is left is what the data costs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import h5py

from h5serve.segments import segment_prefix
from h5serve.wire.runtime import resolve_runtime

from .common import ROW_SHAPE, BenchDaemon, Row, cached_bytes, drop_page_cache, log

JOBS, RANKS = 2, 2


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        todo += _children(p)
    return pids


def _pss(pid: int, skip_prefix: str) -> int:
    """PSS of ``pid`` in bytes, leaving out mappings of files under ``skip_prefix``."""
    total, skipping = 0, False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if not line[0].isupper() or ":" not in line.split()[0]:  # a mapping header line
                    parts = line.split()
                    skipping = len(parts) >= 6 and parts[5].startswith(skip_prefix)
                elif line.startswith("Pss:") and not skipping:
                    total += int(line.split()[1]) * 1024
    except OSError:
        pass
    return total


def _segments_bytes(prefix: str) -> int:
    total = 0
    for name in os.listdir("/dev/shm"):
        if name.startswith(prefix):
            total += os.stat(f"/dev/shm/{name}").st_blocks * 512
    return total


def measure(kind: str, path: Path) -> int:
    """Total node memory (bytes) of the topology on ``path`` while every process is alive: PSS
    of every process, the segments, and the page cache the data file holds. The file starts
    out of the page cache (as on a cluster node before a job), so whatever a reader leaves
    cached is counted."""
    drop_page_cache(path)
    with BenchDaemon() as daemon:
        prefix = segment_prefix(resolve_runtime(daemon.runtime_dir).namespace)
        procs = []
        try:
            for _job in range(JOBS):
                for rank in range(RANKS):
                    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(RANKS)}
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "bench.jobs", kind, str(path), str(daemon.runtime_dir), "--hold"],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                        cwd=Path(__file__).resolve().parent.parent))
            for p in procs:
                line = p.stdout.readline()
                if line.strip() != "ready":
                    raise RuntimeError(f"a {kind} rank did not get ready (exit {p.poll()})")
            time.sleep(0.5)
            pids = [pid for p in procs for pid in _tree(p.pid)] + (_tree(daemon.pid) if kind == "h5serve" else [])
            shm = f"/dev/shm/{prefix}"
            return sum(_pss(pid, shm) for pid in pids) + _segments_bytes(prefix) + cached_bytes(path)
        finally:
            for p in procs:
                try:
                    p.stdin.close()
                except OSError:
                    pass
            for p in procs:
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def tiny_copy(path: Path, rows: int = 1024) -> Path:
    control = path.with_name(f"control-{rows}.h5")
    if not control.exists():
        with h5py.File(path, "r") as src, h5py.File(control, "w") as dst:
            dst.create_dataset("x", data=src["x"][:rows], chunks=(256, *ROW_SHAPE))
            dst.create_dataset("y", data=src["y"][:rows], chunks=(256,))
    return control


# 2,048 rows a rank: 8 batches of 256, so every DataLoader worker fills its prefetch buffers
# (make_loader's ring slots, torch's queue) in the control as it does on the data: those are
# per-worker constants, like the interpreter and torch, not copies of the data
CONTROL_ROWS = 4096


def memory(files: dict[str, Path]) -> list[Row]:
    path = files["plain"]
    control = tiny_copy(path, CONTROL_ROWS)
    with h5py.File(path, "r") as f:
        row_native = f["x"][0].nbytes + f["y"].dtype.itemsize
        # data minus control: each holds its own rows once, so the difference is this many rows
        native = (len(f["y"]) - CONTROL_ROWS) * row_native
    results = {}
    for kind in ("h5serve", "seed"):
        log(f"memory: {kind} ({JOBS} jobs x {RANKS} ranks x 2 workers), data and control")
        data, base = measure(kind, path), measure(kind, control)
        results[kind] = (data - base, data, base)
    h5, seed = results["h5serve"][0], results["seed"][0]
    mib = 1024**2
    return [Row("memory: 2 jobs x 2 ranks x 2 workers, float32 out, incl. page cache (x of the data's native size)",
                "x native",
                h5 / native, seed / native, 1.0, higher_is_better=False, target="<= 1.1x native",
                target_vs_limit=1 / 1.1,
                note=(f"PSS + /dev/shm segments + the data file's page cache; native {native / mib:,.0f} MiB; "
                      f"h5serve {h5 / mib:,.0f} MiB, seed {seed / mib:,.0f} MiB "
                      f"(totals minus a {CONTROL_ROWS:,}-row control, same topology: "
                      f"{results['h5serve'][2] / mib:,.0f} / "
                      f"{results['seed'][2] / mib:,.0f} MiB)"))]
