"""What each rank of ``h5serve demo``'s torchrun jobs runs (DDP on gloo). Each rank writes its
reports to ``<report-dir>/rank<N>.json`` and ``predecessor<N>.json`` (files, not stdout:
torchrun interleaves the ranks' output).

Both kinds start with a ``SharedH5Dataset`` in global mode (the whole file, one copy per
node, from the daemon): the time to a ready dataset, the rank's memory, a few DDP training
steps. ``--kind load`` (job 1) stops there. ``--kind compare`` (job 2) also measures data
loading alone for ``--seconds`` (``make_loader``, no model), then closes the dataset and does
it the predecessor's way (``predecessor.py``, no daemon involved): every row preloaded into
this rank's memory (what a whole-file shuffle took), its time and memory; then the lazy
per-item reader, data loading alone for ``--seconds``.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from h5serve.client import DistributedShuffleSampler, SharedH5Dataset, make_loader
from h5serve.wire.runtime import resolve_shm_dir

from .predecessor import PredecessorLazy, PredecessorPreload

X_KEY, Y_KEY = "images", "labels"
SEED = 42

__all__ = ["main"]


def pss_bytes(skip_prefix: str) -> int:
    """This process's proportional set size (each shared page divided among the processes
    mapping it), leaving out mappings of files whose path starts with ``skip_prefix`` (the
    daemon's segments: the demo counts them once, whole)."""
    total, skipping = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if not head.endswith(":"):  # a mapping's header: address range, perms, ..., path
                parts = line.split()
                skipping = len(parts) >= 6 and parts[5].startswith(skip_prefix)
            elif head == "Pss:" and not skipping:
                total += int(line.split()[1]) * 1024
    return total


def draw(loader: DataLoader, seconds: float, set_epoch: Any = None) -> int:
    """Samples/s of loading batches alone (no model) for ``seconds`` (at least one batch)."""
    seen, epoch, start = 0, 0, time.perf_counter()
    while True:
        if set_epoch is not None:
            set_epoch(epoch)
        for _x, y in loader:
            seen += len(y)
            if time.perf_counter() - start >= seconds:
                return round(seen / (time.perf_counter() - start))
        epoch += 1


def train_steps(batches: Iterable[tuple[torch.Tensor, torch.Tensor]], features: int, steps: int) -> float:
    """A few DDP steps of a linear classifier: the loss after them (the same rows in the same
    order give the same loss in every job)."""
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Flatten(), nn.Linear(features, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss = torch.tensor(0.0)
    for step, (x, y) in enumerate(batches):
        if step >= steps:
            break
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x / 255.0), y)
        loss.backward()
        optimizer.step()
    return round(float(loss.detach()), 4)


def run_shm(args: argparse.Namespace, skip: str, measure_rate: bool) -> tuple[dict[str, Any], Any]:
    """The h5serve dataset: ready time, data rate (``measure_rate``), memory, a few DDP steps.
    Returns the report and the dataset (still held, so its segments stay mapped)."""
    before = pss_bytes(skip)
    dist.barrier()  # every rank starts the clock together
    t0 = time.perf_counter()
    ds = SharedH5Dataset(args.path, x_key=X_KEY, y_key=Y_KEY, mode="global", dtype_x=np.float32)
    ready_s = time.perf_counter() - t0
    loader = make_loader(ds, args.batch_size, seed=SEED)
    batches = loader.batch_sampler
    assert isinstance(batches, DistributedShuffleSampler)  # make_loader's, for a global-mode dataset
    rate = None
    if measure_rate:
        dist.barrier()  # the ranks draw at the same time, as in training
        rate = draw(loader, args.seconds, batches.set_epoch)
    grown = pss_bytes(skip) - before
    batches.set_epoch(0)
    loss = train_steps(loader, int(np.prod(ds[0][0].shape)), args.steps)
    report = {"backend": ds.backend, "rows": len(ds), "ready_s": ready_s, "samples_per_s": rate,
              "pss_growth": grown, "loss": loss}
    return report, ds


def run_predecessor(args: argparse.Namespace, skip: str) -> dict[str, Any]:
    """The predecessor's way: every row preloaded (ready time, memory), then lazy per-item reads."""
    before = pss_bytes(skip)
    dist.barrier()
    t0 = time.perf_counter()
    preloaded = PredecessorPreload(args.path, X_KEY, Y_KEY)  # every row: what a global-mode rank holds
    ready_s = time.perf_counter() - t0
    rows = len(preloaded)
    grown = pss_bytes(skip) - before
    del preloaded
    gc.collect()
    lazy = PredecessorLazy(args.path, X_KEY, Y_KEY)
    sampler: DistributedSampler[int] = DistributedSampler(lazy, shuffle=True, seed=SEED)
    loader = DataLoader(lazy, batch_size=args.batch_size, sampler=sampler)
    dist.barrier()
    rate = draw(loader, args.seconds, sampler.set_epoch)
    lazy.close()
    return {"backend": "predecessor", "rows": rows, "ready_s": ready_s, "samples_per_s": rate,
            "pss_growth": grown, "loss": None}


def _write(report_dir: str, name: str, report: dict[str, Any]) -> None:
    with open(f"{report_dir}/{name}.json", "w") as f:
        json.dump({**report, "rank": dist.get_rank()}, f)


def run(args: argparse.Namespace) -> None:
    skip = f"{resolve_shm_dir()}/h5serve-"
    report, ds = run_shm(args, skip, measure_rate=args.kind == "compare")
    _write(args.report_dir, f"rank{dist.get_rank()}", report)
    if args.kind == "compare":
        ds.close()  # the predecessor's way has no daemon: nothing of h5serve stays mapped
        del ds
        gc.collect()
        _write(args.report_dir, f"predecessor{dist.get_rank()}", run_predecessor(args, skip))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--kind", choices=["load", "compare"], required=True)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--report-dir", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    run(args)
    # The DDP model holds the process group; if it is still alive when the interpreter exits,
    # gloo's threads are torn down during finalization and abort the rank now and then
    # ("terminate called without an active exception"). So: model gone (it lived in a
    # function), then a barrier (every rank is done with gloo), then destroy, all before exit.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
