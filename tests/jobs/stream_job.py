"""A DDP training job for tests/integration/test_stream.py, run under torchrun (gloo).

Every rank opens the file in ``mode="stream"`` with a small window and trains a tiny DDP model
(every batch's backward all-reduces, so unequal batch counts hang until
``--collective-timeout``) for ``--epochs`` epochs with each loader in ``--loaders``
(``make:W`` or ``make:W:spawn``: make_loader with W workers, forked or spawned). Each batch's
x is checked against h5py's rows. Then a mid-epoch checkpoint: the sampler state after
``--resume-at`` batches of epoch 1, loaded into a new loader over a new dataset. ``--window
default`` and ``--block-rows 0`` leave them to the dataset (``None``).

Writes ``<out>/rank<N>.json``: per loader, per epoch, the labels (= global row ids) of each
batch; the block cache's peak (blocks, bytes) and the window; the resumed labels (unless
``--resume-at 0``). With a daemon on H5SERVE_RUNTIME_DIR the blocks come from it
(tests/integration/test_stream_daemon.py).
"""

import argparse
import datetime
import gc
import json

import h5py
import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from h5serve.client import SharedH5Dataset, make_loader


def dataset(args: argparse.Namespace) -> SharedH5Dataset:
    window = None if args.window == "default" else args.window
    return SharedH5Dataset(args.path, x_key="x", y_key="y", mode="stream", window=window,
                           block_rows=args.block_rows or None, timeout=args.timeout)


def loader_of(ds: SharedH5Dataset, name: str, batch_size: int):
    parts = name.split(":")
    workers = int(parts[1])
    kwargs = {"multiprocessing_context": parts[2]} if len(parts) > 2 else {}
    return make_loader(ds, batch_size, seed=42, num_workers=workers, timeout=120 if workers else 0, **kwargs)


def train(ds: SharedH5Dataset, name: str, x_all: np.ndarray, args: argparse.Namespace) -> list:
    loader = loader_of(ds, name, args.batch_size)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Flatten(), nn.Linear(x_all.shape[1], 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    epochs = []
    for epoch in range(args.epochs):
        loader.batch_sampler.set_epoch(epoch)
        batches = []
        for x, y in loader:
            assert np.array_equal(x.numpy(), x_all[y.numpy()]), "rows differ from h5py's"
            optimizer.zero_grad()
            model(x.float()).sum().backward()
            optimizer.step()
            batches.append(y.tolist())
        epochs.append(batches)
    del loader, model, optimizer
    gc.collect()
    return epochs


def resumed(args: argparse.Namespace) -> tuple[list, list]:
    """Epoch 1 whole, and after a checkpoint at ``--resume-at`` batches the rest from a new loader."""
    ds = dataset(args)
    loader = loader_of(ds, "make:0", args.batch_size)
    loader.batch_sampler.set_epoch(1)
    whole, state = [], None
    for i, (_, y) in enumerate(loader):
        whole.append(y.tolist())
        if i + 1 == args.resume_at:
            state = loader.batch_sampler.state_dict()
    ds.close()
    fresh = dataset(args)
    again = loader_of(fresh, "make:0", args.batch_size)
    again.batch_sampler.load_state_dict(state)
    rest = [y.tolist() for _, y in again]
    fresh.close()
    return whole, rest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("out")
    parser.add_argument("--loaders", default="make:0,make:2,make:1:spawn")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--window", default="96KiB", help="'default': window=None")
    parser.add_argument("--block-rows", type=int, default=256, help="0: block_rows=None")
    parser.add_argument("--resume-at", type=int, default=7)
    parser.add_argument("--collective-timeout", type=float, default=60)
    parser.add_argument("--timeout", type=float, default=None, help="SharedH5Dataset(timeout=)")
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.collective_timeout))
    with h5py.File(args.path) as f:
        x_all = f["x"][:]
    ds = dataset(args)
    report: dict = {"rank": dist.get_rank(), "backend": ds.backend, "len": len(ds), "runs": {}}
    for name in args.loaders.split(","):
        report["runs"][name] = train(ds, name, x_all, args)
        if name == "make:0":
            cache = ds.stream.cache
            report["peak_blocks"], report["block_bytes"] = cache.peak, ds.stream.config.block_bytes
            report["window_bytes"], report["capacity"] = ds.stream.config.window_bytes, ds.stream.config.capacity
            report["reads"] = cache.reads
    if args.resume_at:
        report["whole"], report["rest"] = resumed(args)
    with open(f"{args.out}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(report, f)
    ds.close()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
