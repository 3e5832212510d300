"""Processes the memory and first-batch scenarios launch: ``python -m bench.jobs KIND PATH RUNTIME_DIR``.

KIND is ``h5serve`` or ``seed``; RANK and WORLD_SIZE come from the environment (torchrun sets
them). ``--hold``: iterate one epoch with 2 workers, print ``ready`` and wait for stdin to close
(the parent measures memory meanwhile). ``--first-batch``: print the wall-clock time at which
the first batch arrived, then exit.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch.distributed as dist
from torch.utils.data import DataLoader

from h5serve.client import EpochShuffleSampler, SharedH5Dataset, make_loader

from .baselines import SeedRankMemCachedDataset


def build(kind: str, path: str, runtime_dir: str, workers: int):
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if kind == "h5serve":
        ds = SharedH5Dataset(path, "x", "y", rank=rank, world_size=world, dtype_x=np.float32,
                             runtime_dir=runtime_dir, fallback="error", timeout=600)
        return make_loader(ds, 256, num_workers=workers)
    ds = SeedRankMemCachedDataset(path, "x", "y", rank=rank, world_size=world)
    extra = {"persistent_workers": True, "prefetch_factor": 2} if workers else {}
    return DataLoader(ds, batch_size=256, sampler=EpochShuffleSampler(len(ds)), num_workers=workers, **extra)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["h5serve", "seed"])
    p.add_argument("path")
    p.add_argument("runtime_dir")
    p.add_argument("--hold", action="store_true")
    p.add_argument("--first-batch", action="store_true")
    args = p.parse_args()
    if args.first_batch:
        dist.init_process_group("gloo")
        loader = build(args.kind, args.path, args.runtime_dir, workers=0)
        next(iter(loader))
        if dist.get_rank() == 0:
            print(f"first-batch {time.time():.6f}", flush=True)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    loader = build(args.kind, args.path, args.runtime_dir, workers=2)
    for _ in loader:
        pass
    print("ready", flush=True)
    sys.stdin.read()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
