"""What every scenario shares: the data files, a real daemon, clocks and the result rows."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from h5serve.demo.daemon import DaemonProcess
from h5serve.util.units import row_nbytes

CHUNK_ROWS = 256
ROW_SHAPE = (3, 32, 32)


@dataclass
class Row:
    """One line of the table. ``higher_is_better``: rates (samples/s, MB/s) vs times (ms)."""

    scenario: str
    unit: str
    h5serve: float
    baseline: float | None = None
    limit: float | None = None
    higher_is_better: bool = True
    target: str = ""  # e.g. ">= 10x baseline"
    target_ratio: float | None = None  # on ``ratio`` (speedup over the baseline)
    target_vs_limit: float | None = None  # on ``vs_limit``
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if not self.baseline or not self.h5serve:
            return None
        return self.h5serve / self.baseline if self.higher_is_better else self.baseline / self.h5serve

    @property
    def vs_limit(self) -> float | None:
        if not self.limit or not self.h5serve:
            return None
        return self.h5serve / self.limit if self.higher_is_better else self.limit / self.h5serve

    @property
    def met(self) -> bool | None:
        checks = []
        if self.target_ratio is not None and self.ratio is not None:
            checks.append(self.ratio >= self.target_ratio)
        if self.target_vs_limit is not None and self.vs_limit is not None:
            checks.append(self.vs_limit >= self.target_vs_limit)
        return all(checks) if checks else None

    def as_dict(self) -> dict:
        return {"scenario": self.scenario, "unit": self.unit, "h5serve": self.h5serve, "baseline": self.baseline,
                "limit": self.limit, "ratio": self.ratio, "vs_limit": self.vs_limit, "target": self.target,
                "met": self.met, "note": self.note, **self.extra}


def clock() -> float:
    return time.perf_counter()


def median_time(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = clock()
        fn()
        times.append(clock() - t)
    return statistics.median(times)


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ----- data -------------------------------------------------------------------------------
def _image_rows(start: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """Image-like uint8 rows: smooth gradients plus a little noise (gzip gets ~2-3x on them)."""
    yy, xx = np.mgrid[0:ROW_SHAPE[1], 0:ROW_SHAPE[2]]
    base = (xx * 3 + yy * 5).astype(np.int64)
    ids = np.arange(start, start + count, dtype=np.int64)[:, None, None, None]
    channel = np.arange(ROW_SHAPE[0])[None, :, None, None] * 40
    noise = rng.integers(0, 8, (count, *ROW_SHAPE))
    return ((base[None, None] + ids * 7 + channel + noise) % 256).astype(np.uint8)


def make_files(directory: Path, rows: int, float_rows: int) -> dict[str, Path]:
    """plain (uint8, chunked 256 rows), gzip (the same with shuffle+gzip), float32 (fewer rows,
    the same bytes), each with int64 labels. Kept between runs: made again when missing."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {"plain": directory / f"plain-{rows}.h5", "gzip": directory / f"gzip-{rows}.h5",
             "float32": directory / f"float32-{float_rows}.h5"}
    specs = {"plain": (rows, "uint8", {}), "gzip": (rows, "uint8", {"compression": "gzip", "shuffle": True}),
             "float32": (float_rows, "float32", {})}
    for name, path in files.items():
        if path.exists():
            continue
        n, dtype, options = specs[name]
        log(f"writing {path} ({n} rows, {dtype}{', shuffle+gzip' if options else ''})")
        rng = np.random.default_rng(0)
        tmp = path.with_suffix(".tmp")
        with h5py.File(tmp, "w") as f:
            x = f.create_dataset("x", (n, *ROW_SHAPE), dtype=dtype, chunks=(CHUNK_ROWS, *ROW_SHAPE), **options)
            f.create_dataset("y", data=rng.integers(0, 1000, n).astype(np.int64), chunks=(CHUNK_ROWS,), **options)
            step = CHUNK_ROWS * 100
            for a in range(0, n, step):
                rows_ = _image_rows(a, min(step, n - a), rng)
                x[a : a + len(rows_)] = rows_ if dtype == "uint8" else rows_.astype(np.float32) / 255
        os.replace(tmp, path)
    return files


def nbytes_of(path: Path, key: str = "x", rows: slice | None = None) -> int:
    with h5py.File(path, "r") as f:
        d = f[key]
        n = d.shape[0] if rows is None else len(range(*rows.indices(d.shape[0])))
        return n * row_nbytes(d.shape[1:], d.dtype)


def warm_page_cache(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def cached_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache now (``fincore``: mincore over a read-only mapping,
    which faults nothing in). Every page cached file counts, whoever read it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * mmap.PAGESIZE


def drop_page_cache(path: Path) -> None:
    """Evict ``path``'s clean pages from the page cache (a cold-cache read, no root needed:
    ``posix_fadvise(DONTNEED)`` on the file, after an fsync so every page is clean)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@contextlib.contextmanager
def busy_process() -> Iterator[None]:
    """One other process spinning on a core for the duration (a rank, a worker, another job):
    what a training node always has. Killed on exit."""
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # scheduled and spinning
        yield
    finally:
        spin.kill()
        spin.wait()


# ----- a real daemon ----------------------------------------------------------------------
class BenchDaemon(DaemonProcess):
    """``h5serve start`` on a private runtime dir; stopped (and killed if need be) on exit."""

    def __init__(self, *flags: str) -> None:
        super().__init__(Path(tempfile.mkdtemp(prefix="h5s-bench-", dir="/tmp")), flags)

    def __enter__(self) -> BenchDaemon:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop(timeout=60)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "—"
    if unit in ("samples/s", "MB/s"):
        return f"{value:,.0f}"
    if unit == "x native":
        return f"{value:.2f}x"
    if unit == "x file":  # the remote group's GET bytes over the object's size
        return f"{value:.3f}x"
    return f"{value:,.3g}" if value < 100 else f"{value:,.0f}"


def table(rows: list[Row]) -> str:
    """The rows as the markdown table docs/benchmarks.md and every group's command line print."""
    lines = ["| scenario | unit | h5serve | baseline | ratio | limit | vs limit | target | met |",
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        met = {True: "yes", False: "**no**", None: ""}[r.met]
        lines.append(
            f"| {r.scenario} | {r.unit} | {_fmt(r.h5serve, r.unit)} | {_fmt(r.baseline, r.unit)} | "
            f"{'—' if r.ratio is None else f'{r.ratio:.2f}x'} | {_fmt(r.limit, r.unit)} | "
            f"{'—' if r.vs_limit is None else f'{r.vs_limit:.2f}'} | {r.target} | {met} |")
    return "\n".join(lines)
