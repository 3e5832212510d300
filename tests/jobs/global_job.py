"""A DDP training job for tests/integration/test_global_mode.py, run under torchrun (gloo).

Every rank opens the same file in ``mode="global"`` (the whole file, one segment set per node)
and trains a tiny DDP model for ``--epochs`` epochs with each sampler given in ``--samplers``:
``make:W`` is ``make_loader`` (h5serve's DistributedShuffleSampler) with ``W`` workers, ``torch``
a plain DataLoader over ``torch.utils.data.DistributedSampler``. Every batch's backward
all-reduces the gradients, so unequal batch counts hang until ``--collective-timeout``.

Writes ``<out>/rank<N>.json``: per sampler, per epoch, the labels (= global row ids) of each
batch this rank saw; the dataset's backend, length and indices.
"""

import argparse
import datetime
import gc
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from h5serve.client import SharedH5Dataset, make_loader


def build(ds: SharedH5Dataset, name: str, batch_size: int) -> tuple[DataLoader, object]:
    """The loader and the object whose ``set_epoch`` starts an epoch."""
    if name == "torch":
        sampler = DistributedSampler(ds, shuffle=True, seed=42)
        return DataLoader(ds, batch_size=batch_size, sampler=sampler), sampler
    workers = int(name.split(":")[1])
    loader = make_loader(ds, batch_size, seed=42, num_workers=workers, timeout=120 if workers else 0)
    return loader, loader.batch_sampler


def train(ds: SharedH5Dataset, name: str, args: argparse.Namespace) -> list:
    loader, epochs_of = build(ds, name, args.batch_size)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Flatten(), nn.Linear(48, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    epochs = []
    for epoch in range(args.epochs):
        epochs_of.set_epoch(epoch)
        batches = []
        for x, y in loader:
            optimizer.zero_grad()
            model(x.float()).sum().backward()  # all-reduced over gloo: every rank must take part
            optimizer.step()
            batches.append(y.tolist())
        epochs.append(batches)
    del loader, model, optimizer
    gc.collect()
    return epochs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("out")
    parser.add_argument("--samplers", default="make:0,make:2,torch")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--collective-timeout", type=float, default=60)
    parser.add_argument("--mode", default="global")
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.collective_timeout))
    ds = SharedH5Dataset(args.path, x_key="x", y_key="y", mode=args.mode, fallback="error")
    report: dict = {"rank": dist.get_rank(), "backend": ds.backend, "len": len(ds),
                    "indices": ds.indices.tolist(), "runs": {}}
    for name in args.samplers.split(","):
        report["runs"][name] = train(ds, name, args)
    with open(f"{args.out}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(report, f)
    ds.close()
    gc.collect()
    dist.barrier()  # every rank is done with gloo before any tears it down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
