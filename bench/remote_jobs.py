"""Processes the ``remote`` group launches (bench/remote.py), every one reading from the loopback
S3 server named by ``AWS_ENDPOINT_URL``:

- ``run SYSTEM URL --source FILE`` under ``torchrun --nproc-per-node 2`` (gloo): with SYSTEM's
  package imported, after a barrier, each rank takes the time, builds SYSTEM's loader on the
  object(s) at URL and iterates epoch 0 (batch 256, ``num_workers=0``, no model step: the
  loader's pace). SYSTEM is ``global`` or ``stream`` (h5serve through the node's daemon at
  ``--runtime-dir``, ``fallback="error"``), ``streaming`` (MosaicML Streaming, ``remote=URL``, a
  node-wide local cache) or ``litdata`` (LitData, ``Dir(path=cache, url=URL)``, plain http
  allowed: ``allow_plain_http``). Rank 0 prints ``result {json}``: every rank's construction
  start and end, first batch and epoch end (wall clock) and bench/peer_jobs.py's checks of epoch
  0 against the local source (labels are row ids, shares, coverage, image bytes).
  ``--first-only``: stop at the first batch (no checks).
- ``download URL``: the bare parallel download, with the same s3fs: the object's bytes as
  ``--range-bytes`` ranges, ``--concurrency`` in flight (``fs.cat_ranges``), or with
  ``--range-bytes 0`` in one GET (``fs.cat_file``); prints ``result``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from typing import Any

import numpy as np

from .peer_jobs import BATCH, Checks, check, import_streaming, xy

SYSTEMS = ("global", "stream", "streaming", "litdata")


def imported(system: str) -> None:
    """The system's package imported before the clock starts, as a training script's imports at
    its top are; what the package imports lazily on first use (fsspec and s3fs for h5serve) is
    counted."""
    if system in ("global", "stream"):
        import h5serve.client  # noqa: F401
    elif system == "streaming":
        import_streaming()
    else:
        import litdata  # noqa: F401


def allow_plain_http(litdata: Any) -> None:
    """LitData fetches its chunks through obstore (Rust object_store), which refuses a plain
    http:// endpoint ("Generic S3 error: ... HTTP error: builder error", reqwest's BadScheme)
    unless told ``allow_http``. object_store reads that from AWS_ALLOW_HTTP, but LitData builds
    its S3Store with client options of its own (``_OBSTORE_CLIENT_OPTIONS``), which replace the
    environment's, and takes none from ``storage_options``: so the flag is added to that private
    constant here. An https endpoint (any real store) needs nothing."""
    downloader = litdata.streaming.downloader
    downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": True}


def build(args: argparse.Namespace, rank: int, world: int):
    if args.system in ("global", "stream"):
        from h5serve.client import SharedH5Dataset, make_loader

        stream = {"block_rows": args.block_rows} if args.system == "stream" else {}
        ds = SharedH5Dataset(args.url, "x", "y", mode=args.system, rank=rank, world_size=world,
                             runtime_dir=args.runtime_dir, fallback="error", timeout=600, **stream)
        if ds.backend != "shm":
            raise RuntimeError(f"h5serve {args.system}: backend {ds.backend}, not the daemon's segments")
        return make_loader(ds, BATCH, seed=0)
    if args.system == "streaming":
        from torch.utils.data import DataLoader

        ds = import_streaming().StreamingDataset(remote=args.url, local=args.cache, batch_size=BATCH, shuffle=True)
        return DataLoader(ds, batch_size=BATCH, num_workers=0)
    import litdata

    os.environ["GLOBAL_RANK"] = str(rank)
    endpoint = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}
    if endpoint["endpoint_url"].startswith("http://"):
        allow_plain_http(litdata)
    ds = litdata.StreamingDataset(litdata.streaming.resolver.Dir(path=args.cache, url=args.url), shuffle=True,
                                  drop_last=True, storage_options=endpoint)
    return litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=0)


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    imported(args.system)
    dist.barrier()
    built = time.time()
    loader = build(args, rank, world)
    ready = time.time()
    first, seen, kept = 0.0, [], []
    for i, batch in enumerate(loader):
        x, y = xy(batch)
        if not first:
            first = time.time()
            if args.first_only:
                break
        seen.append(np.asarray(y).astype(np.int64).ravel())
        if i in (0, 7):
            kept.append((np.asarray(x).copy(), np.asarray(y).astype(np.int64).copy()))
    end = time.time()
    mine = {"built": built, "ready": ready, "first": first, "end": end,
            "labels": np.concatenate(seen) if seen else np.empty(0, np.int64)}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        checks = Checks() if args.first_only else check([e["labels"] for e in every], kept, args.source, world)
        times = {k: [e[k] for e in every] for k in ("built", "ready", "first", "end")}
        print("result " + json.dumps({**times, "samples": [len(e["labels"]) for e in every],
                                      "checks": asdict(checks)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def download(args: argparse.Namespace) -> int:
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}, skip_instance_cache=True)
    path = args.url.removeprefix("s3://")
    size = int(fs.size(path))
    starts = list(range(0, size, args.range_bytes or size))
    ends = [min(a + (args.range_bytes or size), size) for a in starts]
    t = time.perf_counter()
    if args.range_bytes:
        got = fs.cat_ranges([path] * len(starts), starts, ends, batch_size=args.concurrency)
    else:
        got = [fs.cat_file(path)]
    took = time.perf_counter() - t
    failed = [g for g in got if isinstance(g, Exception)]
    if failed:
        raise RuntimeError(f"{len(failed)} ranges failed: {failed[0]!r}")
    print("result " + json.dumps({"seconds": took, "bytes": sum(len(g) for g in got), "size": size,
                                  "ranges": len(starts)}), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.remote_jobs")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("system", choices=SYSTEMS)
    r.add_argument("url")
    r.add_argument("--source", required=True, help="the local HDF5 file the rows came from (the checks)")
    r.add_argument("--runtime-dir")
    r.add_argument("--block-rows", type=int, default=None)
    r.add_argument("--cache", default="", help="the peers' local cache directory")
    r.add_argument("--first-only", action="store_true")
    d = sub.add_parser("download")
    d.add_argument("url")
    d.add_argument("--range-bytes", type=int, default=8 << 20, help="0: the whole object in one GET")
    d.add_argument("--concurrency", type=int, default=16)
    args = p.parse_args()
    return run(args) if args.command == "run" else download(args)


if __name__ == "__main__":
    raise SystemExit(main())
