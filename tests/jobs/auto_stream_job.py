"""A DDP job for tests/integration/test_auto_stream.py, run under torchrun (gloo): every rank
opens the file in ``mode="global"`` (``--no-auto``: with ``auto_stream=False``) with the
daemon on H5SERVE_RUNTIME_DIR, records the warnings its constructor gave, what serves it, and
reads ``--epochs`` epochs through make_loader (each batch's x checked against h5py's rows).

Writes ``<out>/rank<N>.json``: warnings (category, text), mode, requested_mode, backend,
the sampler's class, the plan's numbers, per epoch the labels (= global row ids) it read.
"""

import argparse
import datetime
import json
import warnings

import h5py
import numpy as np
import torch.distributed as dist

from h5serve.client import SharedH5Dataset, make_loader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--no-auto", action="store_true")
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    with h5py.File(args.path) as f:
        x_all = f["x"][:]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = SharedH5Dataset(args.path, x_key="x", y_key="y", mode="global", auto_stream=not args.no_auto)
    loader = make_loader(ds, args.batch_size, seed=7)
    plan = ds.auto_streamed
    report: dict = {
        "rank": dist.get_rank(), "mode": ds.mode, "requested_mode": ds.requested_mode, "backend": ds.backend,
        "sampler": type(loader.batch_sampler).__name__, "len": len(ds),
        "warnings": [[w.category.__name__, str(w.message)] for w in caught],
        "plan": None if plan is None else {"need": plan.need, "budget": plan.budget, "window": plan.window,
                                           "capacity": plan.capacity, "block_rows": plan.block_rows,
                                           "whole": list(plan.whole)},
        "epochs": [],
    }
    for epoch in range(args.epochs):
        loader.batch_sampler.set_epoch(epoch)
        labels: list[int] = []
        for x, y in loader:
            assert np.array_equal(x.numpy(), x_all[y.numpy()]), "rows differ from h5py's"
            labels += y.tolist()
        report["epochs"].append(labels)
    with open(f"{args.out}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(report, f)
    ds.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
