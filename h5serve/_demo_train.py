"""The training script ``h5serve demo`` runs under torchrun: a tiny model, 2 epochs, DDP on
gloo, data from SharedH5Dataset. Each rank writes its report to ``<report-dir>/rank<N>.json``
(files, not stdout: torchrun interleaves the ranks' output)."""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from h5serve.client import LoaderStats, SharedH5Dataset, make_loader


def train(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    t0 = time.perf_counter()
    ds = SharedH5Dataset(args.path, x_key="images", y_key="labels", mode="contiguous", dtype_x=np.float32)
    ready_s = time.perf_counter() - t0
    loader = make_loader(ds, args.batch_size, seed=42)
    stats = LoaderStats(loader)
    features = int(np.prod(ds[0][0].shape))
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Flatten(), nn.Linear(features, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    seen, loss = 0, torch.tensor(0.0)
    t1 = time.perf_counter()
    for epoch in range(args.epochs):
        loader.batch_sampler.set_epoch(epoch)
        for x, y in stats:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x / 255.0), y)
            loss.backward()
            optimizer.step()
            seen += len(y)
    train_s = time.perf_counter() - t1
    report = {
        "rank": dist.get_rank(), "backend": ds.backend, "rows": len(ds), "first_row": int(ds.indices[0]),
        "ready_ms": round(ready_s * 1000, 1), "samples": seen, "samples_per_s": round(seen / train_s),
        "loss": round(float(loss.detach()), 4), "waiting_for_data": round(stats.snapshot().wait_fraction, 3),
    }
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--report-dir", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    report = train(args)
    with open(f"{args.report_dir}/rank{report['rank']}.json", "w") as f:
        json.dump(report, f)
    # The DDP model holds the process group; if it is still alive when the interpreter exits,
    # gloo's threads are torn down during finalization and abort the rank now and then
    # ("terminate called without an active exception"). So: model gone, then a barrier (every
    # rank is done with gloo), then destroy, all before exit.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
