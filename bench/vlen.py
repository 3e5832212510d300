"""The ``vlen`` group: variable-length rows (1M rows of float32 sequences, mean length 32).

One file, ``vlen-1000000.h5`` in the data dir (made once): ``tokens``, a vlen float32 dataset
whose row lengths are uniform in 1..63, and ``label`` (int64). Rows:

- load, request to ready: a fresh daemon (loader processes warm) loads the whole dataset
  (world size 1) vs h5py reading the same rows (``dset[:]``: an object array of arrays, what
  any h5py user starts from);
- iterate: one shuffled epoch of ``make_loader(ds, 256)`` (``keys=["tokens", "label"]``, a
  list of tensors per batch; and ``ragged="pad"``) vs h5py per-batch fancy reads of the same
  rows in the same batches (sorted indices, as h5py needs them, then a tensor per row), timed
  over the first ``BASELINE_BATCHES`` batches;
- the lazy fallback (no daemon): the first batches (filling its block cache), a later epoch,
  and uncached per-batch reads (``cache_bytes=0``).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import h5py
import numpy as np
import torch

from h5serve.client import SharedH5Dataset, make_loader

from .common import BenchDaemon, Row, clock, log

ROWS = 1_000_000
MAX_LENGTH = 63  # lengths uniform in 1..63: mean 32
BATCH = 256
BASELINE_BATCHES = 200  # h5py fancy reads are slow: timed over this many batches (51,200 rows)
_WRITE_BLOCK = 65_536


def make_vlen_file(data_dir: Path, rows: int = ROWS) -> Path:
    """The bench's vlen file (made when missing)."""
    path = Path(data_dir) / f"vlen-{rows}.h5"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    log(f"writing {path} ({rows} vlen float32 rows, mean length {(MAX_LENGTH + 1) / 2:g})")
    rng = np.random.default_rng(0)
    tmp = path.with_suffix(".tmp")
    with h5py.File(tmp, "w") as f:
        tokens = f.create_dataset("tokens", (rows,), dtype=h5py.vlen_dtype(np.float32))
        f.create_dataset("label", data=rng.integers(0, 1000, rows).astype(np.int64))
        for a in range(0, rows, _WRITE_BLOCK):
            n = min(_WRITE_BLOCK, rows - a)
            lengths = rng.integers(1, MAX_LENGTH + 1, n)
            values = rng.standard_normal(int(lengths.sum()), dtype=np.float32)
            block = np.empty(n, dtype=object)
            block[:] = np.split(values, np.cumsum(lengths)[:-1])
            tokens[a:a + n] = block
    os.replace(tmp, path)
    return path


def _h5py_read_all(path: Path) -> float:
    t = clock()
    with h5py.File(path, "r") as f:
        f["tokens"][:]
    return clock() - t


def _batches(n: int, seed: int = 0) -> list[np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    return [order[i:i + BATCH] for i in range(0, n, BATCH)]


def _h5py_batches(path: Path, batches: list[np.ndarray]) -> float:
    """Samples/s of h5py fancy reads of ``batches`` (sorted per batch) and a tensor per row."""
    with h5py.File(path, "r") as f:
        tokens, label = f["tokens"], f["label"]
        t = clock()
        for batch in batches:
            rows = np.sort(batch)
            _ = [torch.from_numpy(r) for r in tokens[rows]]
            _ = torch.from_numpy(label[rows])
        return sum(len(b) for b in batches) / (clock() - t)


def _epoch_rate(ds: SharedH5Dataset, limit: int | None = None) -> float:
    loader = make_loader(ds, BATCH, seed=0)
    n = 0
    t = clock()
    for i, (_tokens, label) in enumerate(loader):
        n += len(label)
        if limit is not None and i + 1 >= limit:
            break
    return n / (clock() - t)


def vlen_rows(data_dir: Path) -> list[Row]:
    """The vlen group's rows (see the module docstring)."""
    path = make_vlen_file(data_dir)
    with h5py.File(path, "r") as f:
        lengths_mean = float(np.mean([len(r) for r in f["tokens"][:10_000]]))
    values_mb = ROWS * lengths_mean * 4 / 1e6
    _h5py_read_all(path)  # the page cache warm for both
    h5py_load = min(_h5py_read_all(path) for _ in range(2))
    rows: list[Row] = []
    with BenchDaemon() as daemon:
        warm = SharedH5Dataset(path, "label", runtime_dir=daemon.runtime_dir, fallback="error", timeout=600)
        warm.close()  # the loader processes are started (forkserver) and warm
        t = clock()
        ds = SharedH5Dataset(path, keys=["tokens", "label"], runtime_dir=daemon.runtime_dir, fallback="error",
                             timeout=600)
        load = clock() - t
        log(f"vlen load {load:.2f}s (h5py dset[:] {h5py_load:.2f}s)")
        rows.append(Row(f"vlen load: 1M rows x mean {lengths_mean:.0f} float32 ({values_mb:,.0f} MB of values), "
                        "request to ready vs h5py dset[:]", "s", load, h5py_load, higher_is_better=False,
                        note="one loader process; h5py's read gives an object array of arrays, not a shared segment"))
        t = clock()
        SharedH5Dataset(path, keys=["tokens", "label"], runtime_dir=daemon.runtime_dir, fallback="error").close()
        attach = clock() - t
        rows.append(Row("vlen ready: a second dataset attaching the loaded rows vs h5py dset[:]", "ms", attach * 1e3,
                        h5py_load * 1e3, higher_is_better=False))
        batches = _batches(len(ds))[:BASELINE_BATCHES]
        baseline = _h5py_batches(path, batches)
        listed = max(_epoch_rate(ds) for _ in range(2))
        rows.append(Row("vlen iterate shm, workers=0: make_loader(batch 256, shuffled), keys=[tokens, label], "
                        "list of tensors vs h5py sorted fancy reads per batch", "samples/s", listed, baseline,
                        note=f"h5py timed over {BASELINE_BATCHES} batches"))
        ds.close()
        pad = SharedH5Dataset(path, keys=["tokens", "label"], runtime_dir=daemon.runtime_dir, fallback="error",
                              ragged="pad")
        rows.append(Row("vlen iterate shm, workers=0: ragged='pad' (padded tensor + lengths)", "samples/s",
                        max(_epoch_rate(pad) for _ in range(2)), baseline))
        pad.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        lazy = SharedH5Dataset(path, keys=["tokens", "label"], runtime_dir=data_dir / "no-daemon-here")
    assert lazy.backend == "lazy"
    first = _epoch_rate(lazy, BASELINE_BATCHES)
    rows.append(Row(f"vlen lazy fallback, workers=0: first {BASELINE_BATCHES} batches (filling the block cache)",
                    "samples/s", first, baseline))
    rows.append(Row("vlen lazy fallback, workers=0: a later epoch (block cache full)", "samples/s",
                    _epoch_rate(lazy), baseline))
    lazy.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        uncached = SharedH5Dataset(path, keys=["tokens", "label"], runtime_dir=data_dir / "no-daemon-here",
                                   cache_bytes=0)
    rows.append(Row(f"vlen lazy fallback, cache_bytes=0 (uncached reads), first {BASELINE_BATCHES} batches",
                    "samples/s", _epoch_rate(uncached, BASELINE_BATCHES), baseline))
    uncached.close()
    return rows


if __name__ == "__main__":
    import sys

    for row in vlen_rows(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/h5serve-bench-data")):
        print(f"{row.scenario}: {row.h5serve:,.3f} {row.unit} (baseline {row.baseline:,.3f}, ratio "
              f"{row.ratio or 0:.2f}x) {row.note}")
