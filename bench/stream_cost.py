"""A rank's CPU per epoch in stream mode against global mode on the same file in the page
cache, one process, no workers, at windows of 5%, 25% and 100% of the file: blocks gathered a
block at a time (``H5SERVE_ARENA=0 H5SERVE_STITCH=0``, a segment per block), stitched
(``H5SERVE_ARENA=0``: a segment per block, one gather per key a batch) and from the daemon's
stream arenas (the default: each key mapped once, a block a slot leased by an OFD lock;
docs/architecture.md, *Stream arena*).

    python -m bench.stream_cost [--mib 256] [--epochs 3]

Each stream figure is the rank's CPU (``time.process_time``) for its best epoch after the first
(the daemon's loads are its own process); "second epoch pace" is samples/s of epoch 1 with the
whole file in the window (nothing to load again) against global mode's. One daemon, budget
1.25x the file; global mode reads the file's one segment.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from .common import BenchDaemon, Row, log, table, warm_page_cache
from .stream import BATCH, stream_file, warm_daemon


def _epochs(path: Path, runtime_dir: Path, epochs: int, **kwargs: object) -> list[tuple[float, float]]:
    """(CPU seconds, samples/s) of each epoch of one rank."""
    from h5serve.client import SharedH5Dataset, make_loader

    warm_page_cache(path)
    ds = SharedH5Dataset(path, "x", "y", rank=0, world_size=1, runtime_dir=runtime_dir, fallback="error",
                         **kwargs)  # type: ignore[arg-type]
    try:
        loader = make_loader(ds, BATCH, seed=0)
        out = []
        for epoch in range(epochs):
            loader.batch_sampler.set_epoch(epoch)  # type: ignore[union-attr]
            cpu, wall, n = time.process_time(), time.perf_counter(), 0
            for x, _ in loader:
                n += len(x)
            out.append((time.process_time() - cpu, n / (time.perf_counter() - wall)))
        assert ds.backend == "shm", ds.backend
        return out
    finally:
        ds.close()


def stream_cost(data_dir: Path, mib: int = 256, epochs: int = 3) -> list[Row]:
    path = stream_file(data_dir, mib)
    size = os.path.getsize(path)
    rows: list[Row] = []
    with BenchDaemon("--max-memory", str(int(size * 1.25))) as daemon:
        warm_daemon(data_dir, daemon.runtime_dir)
        glob = _epochs(path, daemon.runtime_dir, epochs, mode="global")
        g_cpu, g_pace = min(c for c, _ in glob[1:]), glob[1][1]
        log(f"global: {g_cpu:.2f} s CPU an epoch, {g_pace:,.0f} samples/s")
        for share in (0.05, 0.25, 1.0):
            window = str(int(size * share)) if share < 1 else str(int(size * 1.05))
            found = {}
            for stitch in ("0", "1", "arena"):  # the client's choice; the daemon offers arenas
                os.environ["H5SERVE_ARENA"] = "1" if stitch == "arena" else "0"
                os.environ["H5SERVE_STITCH"] = "0" if stitch == "0" else "1"
                try:
                    found[stitch] = _epochs(path, daemon.runtime_dir, epochs, mode="stream", window=window)
                finally:
                    os.environ.pop("H5SERVE_ARENA", None)
                    os.environ.pop("H5SERVE_STITCH", None)
            before, after, arena = (min(c for c, _ in found[k][1:]) for k in ("0", "1", "arena"))
            log(f"window {share:.0%}: CPU an epoch {before:.2f} s block by block, {after:.2f} s stitched, "
                f"{arena:.2f} s arena (global {g_cpu:.2f} s); second epoch {found['0'][1][1]:,.0f} / "
                f"{found['1'][1][1]:,.0f} / {found['arena'][1][1]:,.0f} samples/s; each epoch's CPU "
                + " | ".join(f"{k}: " + " ".join(f"{c:.2f}" for c, _ in found[k]) for k in found))
            what = f"{mib} MiB cached, window {share:.0%} of the file, batch {BATCH}, 1 rank, no workers"
            rows.append(Row(f"stream CPU an epoch, stitched vs block by block, {what}", "s", after, before,
                            higher_is_better=False))
            rows.append(Row(f"stream CPU an epoch, stitched vs global mode, {what}", "s", after, g_cpu,
                            higher_is_better=False))
            rows.append(Row(f"stream CPU an epoch, arena vs global mode, {what}", "s", arena, g_cpu,
                            higher_is_better=False))
            rows.append(Row(f"stream CPU an epoch, arena vs stitched, {what}", "s", arena, after,
                            higher_is_better=False))
            if share == 1.0:
                rows.append(Row(f"stream second epoch pace, stitched vs global mode, {what}", "samples/s",
                                found["1"][1][1], g_pace))
                rows.append(Row(f"stream second epoch pace, block by block vs global mode, {what}", "samples/s",
                                found["0"][1][1], g_pace))
                rows.append(Row(f"stream second epoch pace, arena vs global mode, {what}", "samples/s",
                                found["arena"][1][1], g_pace))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.stream_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, default=Path("/tmp/h5serve-bench-data"))
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--epochs", type=int, default=3)
    a = p.parse_args()

    print(table(stream_cost(a.data_dir, a.mib, a.epochs)))


if __name__ == "__main__":
    main()
