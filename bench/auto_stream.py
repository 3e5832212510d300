"""Automatic stream mode's pace (report only): a global dataset of bench/stream.py's file under a
daemon of a share of it, so that it is streamed automatically; one process, samples/s of each
epoch after its first batch.

    python -m bench.auto_stream [--mib 256] [--share 10] [--epochs 3]

To compare two versions, run it from each tree in turn (``PYTHONPATH=TREE python -m
bench.auto_stream``, a ``git worktree`` of the old commit), alternating.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

from .common import BenchDaemon
from .stream import stream_file


def pace(mib: int, share: int, epochs: int, data_dir: Path) -> dict:
    from h5serve.client import SharedH5Dataset, make_loader

    path = stream_file(data_dir, mib)
    out: dict = {"samples_s": []}
    with BenchDaemon("--max-memory", str(mib * 2**20 * share // 100), "--loaders", "2") as d:
        for epoch in range(epochs):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the one warning that says it is streamed
                ds = SharedH5Dataset(path, "x", "y", mode="global", rank=0, world_size=1, runtime_dir=d.runtime_dir)
            try:
                out["mode"], out["backend"] = ds.mode, ds.backend
                out["whole"] = list(getattr(ds.auto_streamed, "whole", ()) or ())
                it = iter(make_loader(ds, 256, seed=epoch))
                next(it)
                start, rows = time.perf_counter(), 0
                for _, y in it:
                    rows += len(y)
                out["samples_s"].append(rows / (time.perf_counter() - start))
            finally:
                ds.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.auto_stream", description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--share", type=int, default=10, help="the daemon's budget, percent of the data")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--data-dir", type=Path, default=Path("/tmp/h5serve-bench-data"))
    a = p.parse_args()
    r = pace(a.mib, a.share, a.epochs, a.data_dir)
    print(f"{r['mode']} ({r['backend']}), held whole {r['whole']}: samples/s after the first batch "
          + " / ".join(f"{v:,.0f}" for v in r["samples_s"]))


if __name__ == "__main__":
    main()
