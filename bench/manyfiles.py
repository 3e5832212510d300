"""Many small files as one dataset: from the request to ready segments, the files opened in the
daemon's parallel loader processes (``--load-processes 2`` vs 1), against h5py opening and
reading every file in one process.

    python -m bench.manyfiles [--files 1000] [--rows 16] [--repeat 3]

``many_files(data_dir, repeat)`` returns the rows for bench/run.py. Each measurement uses a
fresh daemon (started before the clock), so every one is a load, not a hit; the files are in
the page cache (just written, then read once).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

import h5py
import numpy as np

if not __package__:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

from .common import ROW_SHAPE, BenchDaemon, Row, clock, log

__all__ = ["make_many_files", "many_files"]


def make_many_files(directory: Path, files: int = 1000, rows: int = 16) -> str:
    """``files`` HDF5 files of ``rows`` uint8 images (x) and int64 labels (y) each, made once;
    returns their glob pattern."""
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        path = directory / f"part_{i:05d}.h5"
        if path.exists():
            continue
        rng = np.random.default_rng(i)
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=rng.integers(0, 255, (rows, *ROW_SHAPE), dtype=np.uint8))
            f.create_dataset("y", data=np.arange(i * rows, (i + 1) * rows, dtype=np.int64))
    return str(directory / "part_*.h5")


def _h5py_read_all(pattern: str) -> float:
    """Seconds to open every file with h5py in this process and read x and y."""
    from glob import glob

    t = clock()
    xs, ys = [], []
    for path in sorted(glob(pattern)):
        with h5py.File(path, "r") as f:
            xs.append(f["x"][...])
            ys.append(f["y"][...])
    np.concatenate(xs), np.concatenate(ys)
    return clock() - t


def _request_to_ready(pattern: str, processes: int) -> float:
    """Seconds from SharedH5Dataset(pattern) to its x and y segments attached, on a fresh daemon."""
    from h5serve.client import SharedH5Dataset

    with BenchDaemon("--load-processes", str(processes), "--keep-page-cache") as daemon:
        t = clock()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback to lazy reads would measure the wrong thing
            ds = SharedH5Dataset(pattern, "x", "y", mode="global", runtime_dir=daemon.runtime_dir, fallback="error")
        elapsed = clock() - t
        parts = {s["load_parts"] for s in _segments(daemon)}
        ds.close()
    log(f"  {processes} load process(es): {elapsed:.2f}s (parts {sorted(parts)})")
    return elapsed


def _segments(daemon: BenchDaemon) -> list[dict]:
    import json

    return json.loads(daemon.cli("status", "--json").stdout)["segments"]


def many_files(data_dir: Path, repeat: int = 3, files: int = 1000, rows: int = 16) -> list[Row]:
    """Rows: request to ready with 2 and 1 load processes, against h5py reading every file."""
    pattern = make_many_files(data_dir / f"many_{files}x{rows}", files, rows)
    _h5py_read_all(pattern)  # every file in the page cache
    baseline = statistics.median(_h5py_read_all(pattern) for _ in range(repeat))
    two = statistics.median(_request_to_ready(pattern, 2) for _ in range(repeat))
    one = statistics.median(_request_to_ready(pattern, 1) for _ in range(repeat))
    note = (f"{files} files x {rows} rows (x uint8 {ROW_SHAPE}, y int64), global mode: resolving every file, "
            "loading x and y, attaching; baseline: h5py opens and reads every file in one process")
    return [
        Row(f"{files} small files, request to ready, --load-processes 2", "s", two, baseline, higher_is_better=False,
            note=note, extra={"load_processes_1_s": one}),
        Row(f"{files} small files, request to ready, --load-processes 1", "s", one, baseline, higher_is_better=False,
            note=note),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default="/tmp/h5serve-bench-data")
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    for row in many_files(Path(args.data_dir), args.repeat, args.files, args.rows):
        print(f"{row.scenario}: {row.h5serve:.2f} {row.unit} (h5py in one process: {row.baseline:.2f} {row.unit}, "
              f"ratio {row.ratio:.2f}x)")


if __name__ == "__main__":
    main()
