"""Processes the peers group launches: ``python -m bench.peer_jobs COMMAND ...``.

- ``write-mds SRC OUT`` / ``write-litdata SRC OUT``: the rows of SRC (x uint8, y = row ids)
  written with MosaicML Streaming's ``MDSWriter`` / LitData's ``optimize`` into OUT.
- ``run SYSTEM DATA`` (under ``torchrun --nproc-per-node 2``): each rank builds SYSTEM's loader as
  its docs recommend for local data, shuffled, batch 256, and iterates; rank 0 prints one
  ``result {json}`` line: its epoch times, its first batch's wall-clock time and the correctness
  checks of epoch 0. ``--hold FILE``: after the epochs print ``ready`` and wait until FILE exists
  (the parent measures memory meanwhile).
- ``clean``: Streaming's ``clean_stale_shared_memory`` (its shared memory left by a killed job).
- ``versions``: the peers' versions, or why each cannot be imported, as JSON.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import os
import sys
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

import h5py
import numpy as np

BATCH = 256
SYSTEMS = ("h5serve", "streaming", "litdata")
PEERS = {"streaming": "mosaicml-streaming", "litdata": "litdata"}
MDS_COLUMNS = {"x": "ndarray:uint8:3,32,32", "y": "int64"}
LITDATA_CHUNK_BYTES = "64MB"  # LitData's default, as its README writes it
WRITE_BLOCK = 4096


def import_streaming() -> types.ModuleType:
    """``import streaming``, around a torchvision that cannot load.

    Streaming imports torchvision at import time, for its vision datasets only (``VisionDataset``
    as a base class, ``to_tensor``). The only torchvision release that declares torch 2.13 is, on
    PyPI, a CUDA build whose ops do not load against the CPU torch ("operator torchvision::nms does
    not exist"). Then those two names come from a stand-in module: the bench uses none of the
    vision datasets, and nothing else of torchvision is touched.
    """
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - RuntimeError from its ops, ImportError, OSError from its .so
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        stub, datasets, transforms, functional = (types.ModuleType(f"torchvision{s}") for s in
                                                  ("", ".datasets", ".transforms", ".transforms.functional"))

        class VisionDataset:  # only a base class of Streaming's vision datasets
            pass

        def to_tensor(*args: object, **kwargs: object) -> None:
            raise RuntimeError("torchvision could not be imported (the bench imports Streaming around it)")

        datasets.VisionDataset, functional.to_tensor = VisionDataset, to_tensor
        stub.datasets, stub.transforms, transforms.functional = datasets, transforms, functional
        stub.__version__ = "unavailable (bench stand-in)"
        for module in (stub, datasets, transforms, functional):  # importlib.util.find_spec (transformers) needs one
            module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
        sys.modules.update({"torchvision": stub, "torchvision.datasets": datasets, "torchvision.transforms": transforms,
                            "torchvision.transforms.functional": functional})
    import streaming

    return streaming


def versions() -> dict[str, str]:
    """Each peer's version, or ``"unavailable: <why>"``."""
    out = {}
    for system, dist in PEERS.items():
        try:
            module = import_streaming() if system == "streaming" else __import__(system)
            out[system] = f"{dist} {module.__version__}"
        except Exception as e:  # noqa: BLE001 - any import failure makes the peer unavailable
            out[system] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return out


# ----- writing ----------------------------------------------------------------------------
def write_mds(src: Path, out: Path, size_limit: int | None = None) -> None:
    """``size_limit``: MDSWriter's shard size limit in bytes (None: its default, 67 MB)."""
    from_streaming = import_streaming()
    kw = {} if size_limit is None else {"size_limit": size_limit}
    with h5py.File(src, "r") as f, from_streaming.MDSWriter(out=str(out), columns=MDS_COLUMNS, **kw) as writer:
        x, y = f["x"], f["y"]
        for a in range(0, len(y), WRITE_BLOCK):
            xs, ys = x[a : a + WRITE_BLOCK], y[a : a + WRITE_BLOCK]
            for i in range(len(ys)):
                writer.write({"x": xs[i], "y": ys[i]})


def _litdata_rows(block: tuple[str, int, int]):
    path, a, b = block
    with h5py.File(path, "r") as f:
        xs, ys = f["x"][a:b], f["y"][a:b]
    for i in range(len(ys)):
        yield {"x": xs[i], "y": int(ys[i])}


def write_litdata(src: Path, out: Path, chunk_bytes: int | None = None) -> None:
    """``chunk_bytes``: LitData's chunk size in bytes (None: the 64 MB of its docs' examples)."""
    import litdata

    with h5py.File(src, "r") as f:
        n = len(f["y"])
    blocks = [(str(src), a, min(a + WRITE_BLOCK, n)) for a in range(0, n, WRITE_BLOCK)]
    litdata.optimize(fn=_litdata_rows, inputs=blocks, output_dir=str(out),
                     chunk_bytes=chunk_bytes or LITDATA_CHUNK_BYTES, num_workers=min(2, len(blocks)))


# ----- a 2-rank job -----------------------------------------------------------------------
@dataclass
class Checks:
    """What rank 0 saw in epoch 0, and which checks failed (empty: all passed)."""

    rows: int = 0
    samples: int = 0
    distinct: int = 0
    missing_on_node: int = 0
    bytes_checked: int = 0
    failed: list[str] = field(default_factory=list)


def build(system: str, data: str, workers: int, runtime_dir: str | None):
    """SYSTEM's loader for this rank, as its docs recommend for local data (shuffled, batch 256)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    extra = {"persistent_workers": True} if workers else {}
    if system == "h5serve":
        from h5serve.client import SharedH5Dataset, make_loader

        ds = SharedH5Dataset(data, "x", "y", mode="global", rank=rank, world_size=world, runtime_dir=runtime_dir,
                             fallback="error", timeout=600)
        return make_loader(ds, BATCH, num_workers=workers)
    if system == "streaming":
        from torch.utils.data import DataLoader

        ds = import_streaming().StreamingDataset(local=data, remote=None, batch_size=BATCH, shuffle=True)
        return DataLoader(ds, batch_size=BATCH, num_workers=workers, **extra)
    import litdata

    os.environ["GLOBAL_RANK"] = str(rank)  # LitData's DataLoader workers read GLOBAL_RANK, not RANK
    ds = litdata.StreamingDataset(data, shuffle=True, drop_last=True)
    return litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers, **extra)


def xy(batch) -> tuple:
    return (batch["x"], batch["y"]) if isinstance(batch, dict) else (batch[0], batch[1])


def check(labels: list[np.ndarray], kept: list[tuple[np.ndarray, np.ndarray]], source: str, world: int) -> Checks:
    """Rank 0's epoch 0: labels are row ids of a share of 1/world of the rows (duplicates only as
    padding), the ranks together cover the file (up to one batch per rank dropped), the order is
    shuffled, and the image bytes of the kept batches are the file's rows for their labels."""
    with h5py.File(source, "r") as f:
        n = len(f["y"])
        ids = f["y"][...]
        c = Checks(rows=n)
        mine = labels[0]
        c.samples, c.distinct = len(mine), len(np.unique(mine))
        if not np.array_equal(ids, np.arange(n)):
            c.failed.append("the source's labels are not row ids")
        if len(mine) == 0 or mine.min() < 0 or mine.max() >= n:
            c.failed.append("labels outside 0..rows-1")
            return c
        share = -(-n // world)
        if not share - BATCH <= c.samples <= share:
            c.failed.append(f"rank 0 got {c.samples} samples, its share is {share}")
        if c.samples - c.distinct > share * world - n:
            c.failed.append(f"{c.samples - c.distinct} duplicate labels (padding allows {share * world - n})")
        c.missing_on_node = n - len(np.unique(np.concatenate(labels)))
        if c.missing_on_node > BATCH * world:
            c.failed.append(f"{c.missing_on_node} rows seen by no rank")
        if np.mean(np.diff(mine) > 0) > 0.9:
            c.failed.append("labels come in file order (not shuffled)")
        for x, y in kept:
            order = np.argsort(y)
            if not np.array_equal(x[order], f["x"][np.sort(y)]):
                c.failed.append("image bytes differ from the file's rows for their labels")
                break
            c.bytes_checked += len(y)
    return c


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    if args.threads:
        torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = build(args.system, args.data, args.workers, args.runtime_dir)
    first, times, labels, kept = 0.0, [], [], []
    for epoch in range(max(args.epochs, 1)):
        if hasattr(loader, "batch_sampler") and hasattr(loader.batch_sampler, "set_epoch"):
            loader.batch_sampler.set_epoch(epoch)
        seen, start = [], time.perf_counter()
        for i, batch in enumerate(loader):
            x, y = xy(batch)
            if not first:
                first = time.time()
                if args.epochs == 0:
                    break
            if epoch == 0:
                seen.append(y.numpy().copy())
                if i in (0, 7):
                    kept.append((x.numpy().copy(), y.numpy().copy()))
        times.append(time.perf_counter() - start)
        if epoch == 0 and args.epochs:
            gathered = [None] * world
            dist.all_gather_object(gathered, np.concatenate(seen) if seen else np.empty(0, np.int64))
            labels = gathered
    if args.hold:
        sys.stdout.write("ready\n")  # one write: under torchrun (python -u) print's two writes of 2 ranks interleave
        sys.stdout.flush()
        while not os.path.exists(args.hold):
            time.sleep(0.1)
    # after the hold: the checks read the source file, whose page cache the parent counts for h5serve
    checks = check(labels, kept, args.source, world) if rank == 0 and args.epochs else Checks()
    dist.barrier()
    if rank == 0:
        print("result " + json.dumps({"first_batch": first, "epoch_times": times,
                                      "samples": int(checks.samples), "checks": asdict(checks)}), flush=True)
    dist.destroy_process_group()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peer_jobs")
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("write-mds", "write-litdata"):
        w = sub.add_parser(name)
        w.add_argument("src", type=Path)
        w.add_argument("out", type=Path)
        w.add_argument("--size-limit", type=int, default=None, help="MDS shard size limit / LitData chunk size, bytes")
    r = sub.add_parser("run")
    r.add_argument("system", choices=SYSTEMS)
    r.add_argument("data", help="h5serve: the HDF5 file; a peer: its dataset directory")
    r.add_argument("--source", required=True, help="the HDF5 file the rows came from (for the checks)")
    r.add_argument("--runtime-dir")
    r.add_argument("--workers", type=int, default=0)
    r.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as launched)")
    r.add_argument("--epochs", type=int, default=2, help="0: stop at the first batch")
    r.add_argument("--hold", help="print ready after the epochs, then wait until this file exists")
    sub.add_parser("clean")
    sub.add_parser("versions")
    args = p.parse_args()
    if args.command == "write-mds":
        write_mds(args.src, args.out, args.size_limit)
    elif args.command == "write-litdata":
        write_litdata(args.src, args.out, args.size_limit)
    elif args.command == "run":
        return run(args)
    elif args.command == "clean":
        import_streaming()
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
    else:
        print(json.dumps(versions()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
