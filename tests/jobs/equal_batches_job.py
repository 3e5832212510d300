"""A DDP training job for tests/integration/test_equal_batches.py, run under torchrun (gloo).

For each loader configuration given (``mode:drop_last:workers``, comma-separated), it trains a
tiny DDP model over ``make_loader`` batches for ``--epochs`` epochs: every batch's backward
all-reduces the gradients, so a rank with one batch more than another waits in that
all-reduce until the gloo timeout (``--collective-timeout``) or the test's deadline ends it.

Writes ``<out>/rank<N>.json``: per configuration, per epoch, the labels (= global row ids) of
each batch in the order this rank saw them.
"""

import argparse
import datetime
import gc
import json

import torch
import torch.distributed as dist
from torch import nn

from h5serve.client import SharedH5Dataset, make_loader


def parse_config(text: str) -> tuple[str, bool, int]:
    mode, drop_last, workers = text.split(":")
    return mode, drop_last == "1", int(workers)


def train_one(args: argparse.Namespace, ds: SharedH5Dataset, drop_last: bool, workers: int) -> list:
    loader = make_loader(ds, args.batch_size, seed=42, drop_last=drop_last, num_workers=workers,
                         timeout=120 if workers else 0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Flatten(), nn.Linear(48, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    epochs = []
    for epoch in range(args.epochs):
        loader.batch_sampler.set_epoch(epoch)
        batches = []
        for x, y in loader:
            optimizer.zero_grad()
            model(x).sum().backward()  # gradients all-reduced over gloo: every rank must take part
            optimizer.step()
            batches.append(y.tolist())
        epochs.append(batches)
    del loader, model, optimizer  # the workers and the DDP model go before the next configuration
    gc.collect()
    return epochs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("out")
    parser.add_argument("--configs", required=True, help="mode:drop_last(0|1):workers, comma-separated")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--collective-timeout", type=float, default=60)
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.collective_timeout))
    datasets: dict[str, SharedH5Dataset] = {}
    report: dict = {"rank": dist.get_rank(), "runs": {}}
    for text in args.configs.split(","):
        mode, drop_last, workers = parse_config(text)
        if mode not in datasets:
            datasets[mode] = SharedH5Dataset(args.path, x_key="x", y_key="y", mode=mode, dtype_x="float32",
                                             fallback="error")
        report["runs"][text] = train_one(args, datasets[mode], drop_last, workers)
    report["backends"] = sorted({ds.backend for ds in datasets.values()})
    report["indices"] = {mode: ds.indices.tolist() for mode, ds in datasets.items()}
    with open(f"{args.out}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(report, f)
    gc.collect()
    dist.barrier()  # every rank is done with gloo before any tears it down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
