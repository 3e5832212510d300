"""A Hugging Face Accelerate job for tests/integration/test_frameworks.py, run with
``python -m accelerate.commands.launch --cpu --num_processes 2 accelerate_job.py PATH OUT --cases ...``.

A case is ``MODE:LOADER:PREPARE[:lazy]``:

- ``MODE``: the SharedH5Dataset mode (global, contiguous, interleave, node);
- ``LOADER``: ``plain`` is ``DataLoader(ds, batch_size, shuffle=True)``, ``epoch`` is
  ``DataLoader(ds, batch_size, sampler=EpochShuffleSampler(len(ds), seed=42))`` (the
  predecessor's way), ``make`` is ``make_loader(ds, batch_size, seed=42)``;
- ``PREPARE``: ``prepare`` passes the loader to ``accelerator.prepare`` with the model and
  optimizer, ``own`` prepares only the model and optimizer (a ``make`` loader then gets
  ``batch_sampler.set_epoch(epoch)`` every epoch);
- ``lazy``: the dataset is opened with ``--lazy-runtime-dir`` (no daemon there: h5py reads).

Writes ``OUT/rank<N>.json``: per case, either the labels (= row ids) of every batch per epoch
and the dataset's backend, length, rank and world size, or the error raised (class, module,
whether it is an H5ServeError, message).
"""

import argparse
import datetime
import gc
import json

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from torch import nn
from torch.utils.data import DataLoader

from h5serve.client import EpochShuffleSampler, SharedH5Dataset, make_loader
from h5serve.errors import H5ServeError


def run_case(accelerator: Accelerator, case: str, args: argparse.Namespace) -> dict:
    mode, loader_kind, prepare, *flags = case.split(":")
    where = {"runtime_dir": args.lazy_runtime_dir, "fallback": "lazy"} if "lazy" in flags else {"fallback": "error"}
    ds = SharedH5Dataset(args.path, "x", "y", mode=mode, **where)
    if loader_kind == "plain":
        loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True)
    elif loader_kind == "epoch":
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=EpochShuffleSampler(len(ds), seed=42))
    else:
        loader = make_loader(ds, args.batch_size, seed=42)
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    epochs: list[list[list[int]]] = []
    try:
        if prepare == "prepare":
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        else:
            model, optimizer = accelerator.prepare(model, optimizer)
        for epoch in range(args.epochs):
            if prepare == "own" and loader_kind == "make":
                loader.batch_sampler.set_epoch(epoch)
            batches = []
            for x, y in loader:
                optimizer.zero_grad()
                accelerator.backward(model(x.float()).sum())  # all-reduced: every rank must take part
                optimizer.step()
                batches.append(y.tolist())
            epochs.append(batches)
    except Exception as exc:  # both ranks fail alike, before their first batch
        result = {"error": type(exc).__name__, "module": type(exc).__module__,
                  "h5serve": isinstance(exc, H5ServeError), "message": str(exc)}
    else:
        result = {"epochs": epochs, "backend": ds.backend, "len": len(ds), "rank": ds.rank,
                  "world_size": ds.world_size}
    accelerator.free_memory()
    del model, optimizer, loader
    ds.close()
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("out")
    parser.add_argument("--cases", required=True)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lazy-runtime-dir", default=None)
    parser.add_argument("--collective-timeout", type=float, default=60)
    args = parser.parse_args()

    timeout = InitProcessGroupKwargs(backend="gloo", timeout=datetime.timedelta(seconds=args.collective_timeout))
    accelerator = Accelerator(cpu=True, kwargs_handlers=[timeout])
    results = {case: run_case(accelerator, case, args) for case in args.cases.split(",")}
    with open(f"{args.out}/rank{accelerator.process_index}.json", "w") as f:
        json.dump(results, f)
    accelerator.wait_for_everyone()
    if dist.is_initialized():  # end gloo cleanly (docs/usage.md)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
