"""A DDP job for tests/integration/test_ready.py, run under torchrun (gloo): ``mode="global"``
with ``wait_ready=False`` while the test holds the daemon's loader stopped.

Each rank trains over one epoch of make_loader's batches (workers=0); after its fourth batch it
leaves ``<out>/lazy<rank>`` (the test then resumes the loader) and waits, up to 60 s, until the
dataset serves from shared memory, then finishes the epoch. Writes ``<out>/rank<N>.json``: the
backend at every batch, the labels (= row ids) it saw, and whether every batch's x equals h5py's.
"""

import argparse
import datetime
import json
import time
from pathlib import Path

import h5py
import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from h5serve.client import SharedH5Dataset, make_loader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("out")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    rank = dist.get_rank()
    ds = SharedH5Dataset(args.path, "x", "y", mode="global", wait_ready=False)
    with h5py.File(args.path) as f:
        x_file = f["x"][:]
    loader = make_loader(ds, 64, seed=3)
    loader.batch_sampler.set_epoch(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Flatten(), nn.Linear(48, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    backends, labels, equal = [], [], True
    for step, (x, y) in enumerate(loader):
        backends.append(ds.backend)
        labels += y.tolist()
        equal = equal and np.array_equal(x.numpy(), x_file[y.numpy()])
        optimizer.zero_grad()
        model(x.float()).sum().backward()  # all-reduced: every rank takes every step
        optimizer.step()
        if step == 3:
            Path(args.out, f"lazy{rank}").touch()
            end = time.monotonic() + 60
            while ds.backend != "shm" and time.monotonic() < end:
                time.sleep(0.02)
    with open(f"{args.out}/rank{rank}.json", "w") as f:
        json.dump({"backends": backends, "labels": labels, "equal": bool(equal)}, f)
    ds.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
