"""A DDP training job for tests/integration/test_ddp.py, run under torchrun (gloo).

Writes ``<out>/rank<N>.json``: the backend and, per epoch, the labels (= global row ids) in
the order this rank saw them.

``--keys image=img,mask=mask,label=label``: several fields (dict batches) through
``make_loader`` (global mode: its DistributedShuffleSampler); the model trains on ``--feature``,
the labels are field ``label``, and every field's rows of each epoch are also written to
``<out>/rank<N>_epoch<E>.npz`` in the order seen, for the test to compare with h5py.
"""

import argparse
import gc
import json
import os
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from h5serve.client import EpochShuffleSampler, SharedH5Dataset, make_loader


def train_fields(args: argparse.Namespace) -> dict:
    """Dict batches of several fields, in make_loader's order."""
    keys = dict(pair.split("=", 1) for pair in args.keys.split(","))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = SharedH5Dataset(args.path, keys=keys, mode=args.mode)
    loader = make_loader(ds, 64, seed=42, num_workers=args.workers, timeout=120 if args.workers else 0)
    features = ds[0][args.feature].numel()
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Flatten(), nn.Linear(features, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    epochs = []
    for epoch in range(args.epochs):
        loader.batch_sampler.set_epoch(epoch)
        seen: dict[str, list] = {name: [] for name in keys}
        for batch in loader:
            optimizer.zero_grad()
            model(batch[args.feature].float()).sum().backward()  # gradients all-reduced over gloo
            optimizer.step()
            for name in keys:
                seen[name].append(batch[name].numpy())
        np.savez(f"{args.out}/rank{dist.get_rank()}_epoch{epoch}.npz",
                 **{name: np.concatenate(parts) for name, parts in seen.items()})
        epochs.append(np.concatenate(seen["label"]).tolist())
    report = {"rank": dist.get_rank(), "backend": ds.backend, "epochs": epochs, "files": list(ds.files),
              "warnings": [str(w.message) for w in caught]}
    del loader
    ds.close()
    return report


def train(args: argparse.Namespace) -> dict:
    if args.node_runtime_dirs:  # what a real multi-node job gets from its node's task prolog
        dirs = args.node_runtime_dirs.split(",")
        os.environ["H5SERVE_RUNTIME_DIR"] = dirs[dist.get_rank() // args.ranks_per_node]
    with warnings.catch_warnings(record=True) as caught:  # why a rank read lazily, for the test's message
        warnings.simplefilter("always")
        ds = SharedH5Dataset(args.path, x_key="x", y_key="y", mode=args.mode, dtype_x="float32")
    sampler = EpochShuffleSampler(len(ds), seed=42)
    loader = DataLoader(ds, batch_size=64, sampler=sampler, num_workers=args.workers,
                        timeout=120 if args.workers else 0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Flatten(), nn.Linear(48, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    epochs = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        seen = []
        for x, y in loader:
            optimizer.zero_grad()
            model(x).sum().backward()  # gradients all-reduced over gloo
            optimizer.step()
            seen.extend(y.tolist())
        epochs.append(seen)
    return {"rank": dist.get_rank(), "backend": ds.backend, "epochs": epochs,
            "warnings": [str(w.message) for w in caught]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("out")
    parser.add_argument("--mode", default="contiguous")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--node-runtime-dirs", help="A,B,...: simulated nodes; rank r uses dir r // ranks-per-node")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--keys", help="name=key,...: dict batches of these fields (see the module docstring)")
    parser.add_argument("--feature", default="image", help="with --keys: the field the model trains on")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    report = train_fields(args) if args.keys else train(args)
    with open(f"{args.out}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(report, f)
    gc.collect()  # the DDP model (which holds the process group) is gone before teardown
    dist.barrier()  # every rank is done with gloo before any tears it down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
