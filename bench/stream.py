"""Stream mode on a cached file, one rank: the daemon's blocks against the lazy block reads
(no daemon) and global mode's lazy row reads (report only).

    python -m bench --only stream
    python -m bench.stream [--mib 256] [--budget 64MiB] [--window 32MiB] [--block-mib 8] [--flags "--loaders 2"]

The file (uint8 rows of 3x32x32, chunks of 256 rows) is made once under --data-dir and read
into the page cache before every measurement. Each figure is the best of ``epochs`` epochs
(samples/s over the whole epoch, the first batch included); "first batch" is from opening the
dataset to the first batch of the first epoch (the daemon is warm: it has loaded another
file, as a node's daemon has); loads and peak memory come from the daemon's
``status`` (sampled every 50 ms).
"""

from __future__ import annotations

import argparse
import shlex
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import h5py
import numpy as np

from h5serve.util.units import parse_size
from h5serve.wire.connection import DaemonClient

from .common import CHUNK_ROWS, ROW_SHAPE, BenchDaemon, Row, _image_rows, log, table, warm_page_cache

ROW_BYTES = int(np.prod(ROW_SHAPE))
BATCH = 256


def stream_file(directory: Path, mib: int) -> Path:
    """A plain uint8 file of about ``mib`` MiB of x (whole chunks), int64 labels; kept between runs."""
    rows = (mib << 20) // ROW_BYTES // CHUNK_ROWS * CHUNK_ROWS
    path = directory / f"stream-{rows}.h5"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        log(f"writing {path} ({rows} rows)")
        rng = np.random.default_rng(0)
        tmp = path.with_suffix(".tmp")
        with h5py.File(tmp, "w") as f:
            x = f.create_dataset("x", (rows, *ROW_SHAPE), dtype="uint8", chunks=(CHUNK_ROWS, *ROW_SHAPE))
            f.create_dataset("y", data=rng.integers(0, 1000, rows).astype(np.int64), chunks=(CHUNK_ROWS,))
            step = CHUNK_ROWS * 100
            for a in range(0, rows, step):
                x[a: a + min(step, rows - a)] = _image_rows(a, min(step, rows - a), rng)
        tmp.replace(path)
    return path


def warm_daemon(directory: Path, runtime_dir: Path) -> None:
    """One load of a tiny file, so that the measured job meets a daemon already running (its
    loaders' forkserver has imported numpy and h5py), as a node's daemon is."""
    from h5serve.client import SharedH5Dataset

    path = directory / "stream-warm.h5"
    if not path.exists():
        with h5py.File(path, "w") as f:
            f["x"] = np.zeros((4, 4), np.float32)
    ds = SharedH5Dataset(path, "x", rank=0, world_size=1, runtime_dir=runtime_dir, fallback="error")
    try:
        ds[0]
    finally:
        ds.close()


@contextmanager
def memory_peak(runtime_dir: Path) -> Iterator[dict[str, int]]:
    """The daemon's used shared memory, sampled every 50 ms: ``{"max", "budget"}``. By ``ping``,
    which says the totals: ``status`` lists every segment, and polling it took a third of the
    daemon's loop in a stream job of 1.5 MiB blocks."""
    seen = {"max": 0, "budget": 0}
    stop = threading.Event()

    def sample() -> None:
        with DaemonClient(runtime_dir) as client:
            while not stop.is_set():
                memory = client.ping()
                seen["max"], seen["budget"] = max(seen["max"], memory["used"]), memory["budget"]
                stop.wait(0.05)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(30)


def run_epochs(path: Path, runtime_dir: Path | str, epochs: int, **kwargs: object) -> tuple[float, float, str]:
    """(best samples/s over ``epochs``, seconds to the first batch, backend) of one rank."""
    from h5serve.client import SharedH5Dataset, make_loader

    warm_page_cache(path)
    opened = time.perf_counter()
    ds = SharedH5Dataset(path, "x", "y", rank=0, world_size=1, runtime_dir=runtime_dir, **kwargs)  # type: ignore[arg-type]
    try:
        loader = make_loader(ds, BATCH, seed=0)
        first, rates = 0.0, []
        for epoch in range(epochs):
            if hasattr(loader.sampler, "set_epoch"):
                loader.sampler.set_epoch(epoch)
            start, n = time.perf_counter(), 0
            for x, _ in loader:
                if not first:
                    first = time.perf_counter() - opened
                n += len(x)
            rates.append(n / (time.perf_counter() - start))
        return max(rates), first, ds.backend
    finally:
        ds.close()


def stream(data_dir: Path, mib: int = 256, budget: str = "64MiB", window: str = "32MiB", block_mib: int | None = 8,
           epochs: int = 3, flags: tuple[str, ...] = ()) -> list[Row]:
    path = stream_file(data_dir, mib)
    block_rows = None if block_mib is None else (block_mib << 20) // ROW_BYTES // CHUNK_ROWS * CHUNK_ROWS
    args = {"mode": "stream", "window": window, "block_rows": block_rows}
    blocks = "default blocks" if block_mib is None else f"{block_mib} MiB blocks"
    what = f"{mib} MiB cached, window {window}, {blocks}, batch {BATCH}, 1 rank"
    with BenchDaemon("--max-memory", budget, *flags) as daemon:
        warm_daemon(data_dir, daemon.runtime_dir)
        with DaemonClient(daemon.runtime_dir) as client:
            loads0 = client.status()["counters"]["loads"]
        with memory_peak(daemon.runtime_dir) as memory:
            rate, first, backend = run_epochs(path, daemon.runtime_dir, epochs, fallback="error", **args)
        with DaemonClient(daemon.runtime_dir) as client:
            loads = (client.status()["counters"]["loads"] - loads0) / epochs
    assert backend == "shm", backend
    lazy, lazy_first, lazy_backend = run_epochs(path, "/nonexistent", epochs, **args)
    rows, rows_first, _ = run_epochs(path, "/nonexistent", 1, mode="global")
    log(f"stream: daemon {rate:,.0f}/s (first {first * 1e3:.0f} ms), lazy blocks ({lazy_backend}) {lazy:,.0f}/s "
        f"(first {lazy_first * 1e3:.0f} ms), global lazy rows {rows:,.0f}/s; {loads:.1f} loads/epoch; "
        f"peak {memory['max'] / 2**20:.1f} of {memory['budget'] / 2**20:.1f} MiB")
    flag_note = f" (daemon {' '.join(flags)})" if flags else ""
    return [
        Row(f"stream from the daemon vs lazy blocks, {what}{flag_note} (report only)", "samples/s", rate, lazy),
        Row(f"stream from the daemon vs global lazy rows, {what} (report only)", "samples/s", rate, rows),
        Row(f"stream first batch, daemon vs lazy blocks, {what} (report only)", "ms", first * 1e3,
            lazy_first * 1e3, higher_is_better=False),
        Row(f"stream daemon loads per epoch (blocks x keys), {what} (report only)", "loads", loads, None,
            higher_is_better=False),
        Row(f"stream peak daemon memory vs its budget, {what} (report only)", "MiB", memory["max"] / 2**20,
            memory["budget"] / 2**20, higher_is_better=False),
    ]


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.stream", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, default=Path("/tmp/h5serve-bench-data"))
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--budget", default="64MiB")
    p.add_argument("--window", default="32MiB")
    p.add_argument("--block-mib", type=int, default=8, help="0: the default block size")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--flags", default="", help="extra daemon flags, e.g. '--loaders 4'")
    a = p.parse_args()
    parse_size(a.budget)

    print(table(stream(a.data_dir, a.mib, a.budget, a.window, a.block_mib or None, a.epochs,
                       tuple(shlex.split(a.flags)))))


if __name__ == "__main__":
    main()
