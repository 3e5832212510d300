"""A PyTorch Lightning DDP job for tests/integration/test_frameworks.py.

Run as ``python lightning_job.py PATH OUT --cases ...``: ``Trainer(accelerator="cpu",
devices=2, strategy="ddp")`` starts the second rank itself (Lightning's own launcher, as users
run it), and both ranks fit a tiny model once per case, in one process group.

A case is ``MODE:LOADER:SAMPLER[:FLAG...]``:

- ``MODE``: the SharedH5Dataset mode (global, contiguous, interleave, node);
- ``LOADER``: ``plain`` is ``DataLoader(ds, batch_size, shuffle=True)``, ``epoch`` is
  ``DataLoader(ds, batch_size, sampler=EpochShuffleSampler(len(ds), seed=42))`` (the
  predecessor's way), ``make`` is ``make_loader(ds, batch_size, seed=42)``;
- ``SAMPLER``: ``lightning`` keeps ``use_distributed_sampler=True`` (the default), ``own`` sets
  ``Trainer(use_distributed_sampler=False)``;
- ``lazy``: the dataset is opened with ``--lazy-runtime-dir`` (no daemon there: h5py reads);
Nothing in the module calls ``set_epoch``: Lightning does, on ``loader.sampler`` and
``loader.batch_sampler.sampler`` (h5serve's batch samplers answer to both), and the test
checks the second epoch is reshuffled.

The dataset is opened in ``LightningDataModule.setup()``: under Lightning's launcher only then
does the process group exist to give it its rank and world size.

Writes ``OUT/rank<N>.json``: per case, either the labels (= row ids) of every batch per epoch
and the dataset's backend, length, rank and world size, or the error the fit raised (class,
module, whether it is an H5ServeError, message).
"""

import argparse
import gc
import json
import logging
import warnings

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from h5serve.client import EpochShuffleSampler, SharedH5Dataset, make_loader
from h5serve.errors import H5ServeError


class Data(L.LightningDataModule):
    def __init__(self, path: str, mode: str, loader: str, batch_size: int, where: dict) -> None:
        super().__init__()
        self.path, self.mode, self.loader, self.batch_size, self.where = path, mode, loader, batch_size, where
        self.ds: SharedH5Dataset | None = None

    def setup(self, stage: str) -> None:
        # node mode: the layout comes from the process group (Lightning's launcher sets LOCAL_RANK
        # but not torchrun's other variables, which the process group outranks)
        self.ds = SharedH5Dataset(self.path, "x", "y", mode=self.mode, **self.where)

    def train_dataloader(self) -> DataLoader:
        if self.loader == "plain":
            return DataLoader(self.ds, batch_size=self.batch_size, shuffle=True)
        if self.loader == "epoch":
            return DataLoader(self.ds, batch_size=self.batch_size, sampler=EpochShuffleSampler(len(self.ds), seed=42))
        return make_loader(self.ds, self.batch_size, seed=42)

    def teardown(self, stage: str) -> None:
        if self.ds is not None:
            self.ds.close()


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(48, 2))
        self.seen: list[list[list[int]]] = []  # per epoch, per batch: the labels

    def on_train_epoch_start(self) -> None:
        self.seen.append([])

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.seen[-1].append(y.tolist())
        return self.net(x.float()).sum()  # DDP all-reduces its gradients: every rank must take part

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def run_case(case: str, args: argparse.Namespace) -> tuple[int, dict]:
    mode, loader, sampler, *flags = case.split(":")
    where = {"runtime_dir": args.lazy_runtime_dir, "fallback": "lazy"} if "lazy" in flags else {"fallback": "error"}
    data = Data(args.path, mode, loader, args.batch_size, where)
    model = Model()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=args.epochs,
                        use_distributed_sampler=sampler == "lightning", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    try:
        trainer.fit(model, datamodule=data)
    except Exception as exc:  # both ranks fail alike while setting up the loader, before any collective
        result = {"error": type(exc).__name__, "module": type(exc).__module__,
                  "h5serve": isinstance(exc, H5ServeError), "message": str(exc)}
    else:
        ds = data.ds
        result = {"epochs": model.seen, "backend": ds.backend, "len": len(ds), "rank": ds.rank,
                  "world_size": ds.world_size}
    rank = trainer.global_rank
    del trainer, model, data
    gc.collect()
    return rank, result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("out")
    parser.add_argument("--cases", required=True)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lazy-runtime-dir", default=None)
    args = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")  # "few workers" and the like: not what is tested

    results, rank = {}, None
    for case in args.cases.split(","):
        rank, results[case] = run_case(case, args)
    with open(f"{args.out}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    if dist.is_initialized():  # end gloo cleanly (docs/usage.md): every rank done before any tears it down
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
