"""A DDP job for tests/integration/test_stream_kinds.py, run under torchrun (gloo): every rank
streams many files (a glob pattern) of every kind of key (``x`` compressed float32 rows, ``y``
the global row id, ``v`` variable-length float32, ``s`` variable-length strings, ``fs``
fixed-length byte strings) in ``mode="stream"`` and trains a tiny DDP model on x (every
batch's backward all-reduces, so unequal batch counts hang until ``--collective-timeout``).
Every batch is checked against h5py's rows of the files, read here whole.

Writes ``<out>/rank<N>.json``: the backend, and per loader (``make:W`` or ``make:W:spawn``)
per epoch the y of each batch.
"""

import argparse
import datetime
import gc
import glob
import json

import h5py
import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from h5serve.client import SharedH5Dataset, make_loader

KEYS = ["x", "y", "v", "s", "fs"]


def h5py_rows(pattern: str) -> dict[str, list]:
    """Every key's rows of the files, concatenated in sorted order, as h5py reads them."""
    rows: dict[str, list] = {key: [] for key in KEYS}
    for path in sorted(glob.glob(pattern)):
        with h5py.File(path) as f:
            for key in KEYS:
                rows[key].extend(f[key].asstr()[:] if key == "s" else f[key][:])
    return rows


def check(batch: list, want: dict[str, list]) -> list[int]:
    x, y, v, s, fs = batch
    ids = y.tolist()
    assert np.array_equal(x.numpy(), np.stack([want["x"][g] for g in ids])), "x differs from h5py's"
    assert all(np.array_equal(row.numpy(), want["v"][g]) for row, g in zip(v, ids)), "v differs from h5py's"
    assert list(s) == [want["s"][g] for g in ids], "s differs from h5py's"
    assert list(fs) == [want["fs"][g] for g in ids], "fs differs from h5py's"
    return ids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pattern")
    parser.add_argument("out")
    parser.add_argument("--loaders", default="make:0,make:2,make:1:spawn")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--window", default="48KiB")
    parser.add_argument("--block-rows", type=int, default=64)
    parser.add_argument("--collective-timeout", type=float, default=60)
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.collective_timeout))
    want = h5py_rows(args.pattern)
    ds = SharedH5Dataset(args.pattern, keys=KEYS, mode="stream", window=args.window, block_rows=args.block_rows)
    report: dict = {"rank": dist.get_rank(), "backend": ds.backend, "len": len(ds), "runs": {},
                    "files": len(ds.files)}
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for name in args.loaders.split(","):
        parts = name.split(":")
        workers = int(parts[1])
        kwargs = {"multiprocessing_context": parts[2]} if len(parts) > 2 else {}
        loader = make_loader(ds, args.batch_size, seed=5, num_workers=workers, timeout=120 if workers else 0,
                             **kwargs)
        epochs = []
        for epoch in range(args.epochs):
            loader.batch_sampler.set_epoch(epoch)
            batches = []
            for batch in loader:
                batches.append(check(batch, want))
                optimizer.zero_grad()
                model(batch[0]).sum().backward()
                optimizer.step()
            epochs.append(batches)
        report["runs"][name] = epochs
        del loader
        gc.collect()
    with open(f"{args.out}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(report, f)
    ds.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
