"""A DDP training job for the namespace cluster's tests (tests/cluster/test_multinode.py), run by
one ``torchrun --nnodes=N`` per node (gloo, c10d rendezvous on node 0).

For each mode in ``--modes`` every rank opens the file (``fallback=--fallback``) and trains a tiny
DDP model (every batch's backward all-reduces over gloo, so unequal batch counts across ranks
hang until ``--collective-timeout``) for ``--epochs`` epochs with make_loader, checking each
batch's x against h5py's rows. ``--checkpoint-at K`` saves the sampler state after K batches of
epoch 1 (``<out>/state-<mode>.json``, rank 0's). ``--resume-from DIR`` instead loads DIR's state
into a fresh loader (with ``next_epoch=True`` when a mid-epoch resume is refused, recording the
refusal) and trains one pass. ``--pause MODE`` makes every rank stop after epoch 0 of MODE, write
``<out>/paused-rank<N>`` and wait for ``--go-file``.

Writes ``<out>/rank<N>.json``: rank, world size, host name; per mode the backend, the rows of
the dataset (``selection``), per epoch the labels (= row ids) of each batch and a crc32 of its x
bytes in order, batches whose bytes differed from h5py's, and the resumed pass.
"""

import argparse
import datetime
import gc
import json
import os
import socket
import time
import zlib

import h5py
import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from h5serve.client import SharedH5Dataset, make_loader
from h5serve.errors import ConfigError

SEED = 42


def open_dataset(args: argparse.Namespace, mode: str) -> SharedH5Dataset:
    extra = {"window": args.window, "block_rows": args.block_rows} if mode == "stream" else {}
    return SharedH5Dataset(args.path, x_key="x", y_key="y", mode=mode, fallback=args.fallback, **extra)


class Pass:
    """One pass over a loader: the labels of each batch, how many batches' x differed from
    h5py's rows of the file this rank opened, and a crc32 of all the x bytes in order (for the
    test to check against its own reading of the file it meant)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.differed = 0
        self.crc = 0

    def step(self, x: torch.Tensor, y: torch.Tensor, model, optimizer, x_all: np.ndarray) -> None:
        self.differed += not np.array_equal(x.numpy(), x_all[y.numpy()])
        self.crc = zlib.crc32(np.ascontiguousarray(x.numpy()).tobytes(), self.crc)
        optimizer.zero_grad()
        model(x.float()).sum().backward()  # all-reduced over gloo: every rank must take part
        optimizer.step()
        self.batches.append(y.tolist())


def wait_for_go(args: argparse.Namespace) -> None:
    with open(os.path.join(args.out, f"paused-rank{dist.get_rank()}"), "w"):
        pass
    deadline = time.monotonic() + 120
    while not os.path.exists(args.go_file):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{args.go_file} did not appear within 120 s")
        time.sleep(0.05)


def run_mode(args: argparse.Namespace, mode: str, x_all: np.ndarray) -> dict:
    ds = open_dataset(args, mode)
    report: dict = {"backend": ds.backend, "len": len(ds),
                    "selection": str(ds.spec.selection.rows(ds.total_rows)), "differed": 0}
    loader = make_loader(ds, args.batch_size, seed=SEED)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Flatten(), nn.Linear(x_all[0].size, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if args.resume_from:
        with open(os.path.join(args.resume_from, f"state-{mode}.json")) as f:
            state = json.load(f)
        try:
            loader.batch_sampler.load_state_dict(state)
            report["refused"] = None
        except ConfigError as exc:  # node mode, another layout: what the docs promise
            report["refused"] = str(exc)
            loader.batch_sampler.load_state_dict(state, next_epoch=True)
        report["resumed_epoch"] = loader.batch_sampler.epoch
        done = Pass()
        for x, y in loader:
            done.step(x, y, model, optimizer, x_all)
        report["resumed"], report["differed"], report["resumed_crc"] = done.batches, done.differed, done.crc
    else:
        report["epochs"], report["crcs"] = [], []
        for epoch in range(args.epochs):
            loader.batch_sampler.set_epoch(epoch)
            done = Pass()
            for step, (x, y) in enumerate(loader):
                done.step(x, y, model, optimizer, x_all)
                if epoch == 1 and step + 1 == args.checkpoint_at:
                    report["state"] = loader.batch_sampler.state_dict(consumed=(step + 1) * args.batch_size)
            report["epochs"].append(done.batches)
            report["crcs"].append(done.crc)
            report["differed"] += done.differed
            if epoch == 0 and args.pause == mode:
                wait_for_go(args)
        if "state" in report and dist.get_rank() == 0:
            with open(os.path.join(args.out, f"state-{mode}.json"), "w") as f:
                json.dump(report["state"], f)
    del loader, model, optimizer
    ds.close()
    gc.collect()
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("out")
    parser.add_argument("--modes", default="global,node,contiguous,interleave,stream")
    parser.add_argument("--fallback", default="error")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--window", default="96KiB")
    parser.add_argument("--block-rows", type=int, default=128)
    parser.add_argument("--checkpoint-at", type=int, default=0)
    parser.add_argument("--resume-from", default="")
    parser.add_argument("--pause", default="")
    parser.add_argument("--go-file", default="")
    parser.add_argument("--collective-timeout", type=float, default=60)
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.collective_timeout))
    with h5py.File(args.path) as f:
        x_all = f["x"][:]
    report: dict = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "host": socket.gethostname(),
                    "modes": {}}
    for mode in args.modes.split(","):
        report["modes"][mode] = run_mode(args, mode, x_all)
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f)
    gc.collect()
    dist.barrier()  # every rank is done with gloo before any tears it down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
