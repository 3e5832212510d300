"""A training script for tests/integration/test_stream_exit.py that never calls ``close()``: it
opens ``path`` (x, y) with the daemon on H5SERVE_RUNTIME_DIR in ``--mode`` (``stream``; or
``global``, which the daemon's small budget streams automatically), reads a few batches in this
process, then ``--workers`` DataLoader workers (``--context`` fork or spawn) read a few, then this
process reads a few more over its own connection (a worker must not have closed it), each
batch's x checked against h5py's rows. The dataset and its loader sit in a reference cycle.

``--end gc``: ``train()`` returns, ``gc.collect()`` frees the cycle (checked: the dataset's
daemon connection with it, and its segments: none stays open, leased, or mapped), a fresh
dataset reads a batch (the process can still talk to the daemon) and is closed. ``--end exit``:
the dataset stays alive, mid-epoch, until the interpreter exits.

Prints one JSON line (``mode``, ``requested_mode``, ``backend``, ``batches``) once done; the
test asks that the process exits, in time, with status 0 and nothing left to pyzmq. Under torchrun (RANK set) each
rank joins a gloo group first and writes ``<--out>/rank<N>.json`` (the same line).
"""

import argparse
import datetime
import gc
import json
import os
import warnings
import weakref

import h5py
import numpy as np
import torch.distributed as dist

from h5serve.client import SharedH5Dataset, make_loader

BATCHES = 4  # read in each of the three passes


class Training:
    """A dataset, its loader and an iterator, in a reference cycle (as a trainer object holding
    itself through a callback or a logger often is): only the garbage collector frees them."""

    def __init__(self, ds: SharedH5Dataset, x_all: np.ndarray) -> None:
        self.ds, self.x_all = ds, x_all
        self.itself = self
        self.batches = 0
        self.iterator = None

    def read(self, workers: int, context: str | None) -> None:
        kwargs = {"multiprocessing_context": context} if workers else {}
        loader = make_loader(self.ds, 32, seed=5, num_workers=workers, timeout=120 if workers else 0, **kwargs)
        self.iterator = iter(loader)  # kept: an epoch left unfinished
        for _ in range(BATCHES):
            x, y = next(self.iterator)
            assert np.array_equal(x.numpy(), self.x_all[y.numpy()]), "rows differ from h5py's"
            self.batches += 1


def segments_held() -> list[str]:
    """The daemon's segments this process holds open (a lease) or mapped."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    with open("/proc/self/maps") as f:
        maps = [line.split()[-1] for line in f]
    return sorted({target for target in fds + maps if os.path.basename(target).startswith("h5serve-")})


def open_dataset(args: argparse.Namespace) -> SharedH5Dataset:
    if args.mode == "stream":
        return SharedH5Dataset(args.path, x_key="x", y_key="y", mode="stream", window="1MiB", block_rows=128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "... streams it": what test_auto_stream checks
        return SharedH5Dataset(args.path, x_key="x", y_key="y", mode="global")


def train(args: argparse.Namespace, x_all: np.ndarray) -> tuple[Training, dict]:
    training = Training(open_dataset(args), x_all)
    ds = training.ds
    training.read(0, None)  # this process's own connection to the daemon
    if args.workers:
        training.read(args.workers, args.context)  # forked workers inherit that connection
        training.read(0, None)  # ... and must have left it alone
    report = {"mode": ds.mode, "requested_mode": ds.requested_mode, "backend": ds.backend,
              "batches": training.batches}
    return training, report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--mode", choices=["stream", "global"], default="stream")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--context", choices=["fork", "spawn"], default="fork")
    parser.add_argument("--end", choices=["gc", "exit"], default="gc")
    parser.add_argument("--out", default=None, help="under torchrun: where each rank writes rank<N>.json")
    args = parser.parse_args()

    ddp = "RANK" in os.environ
    if ddp:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    with h5py.File(args.path) as f:
        x_all = f["x"][:]
    training, report = train(args, x_all)
    if args.end == "gc":
        freed = weakref.ref(training.ds)
        del training  # never closed: only the collector frees it
        gc.collect()
        assert freed() is None, "the collector did not free the dataset"
        held = segments_held()
        assert not held, f"segments still open or mapped after the dataset was freed (their leases held): {held}"
        fresh = open_dataset(args)
        x, y = fresh[0]
        assert np.array_equal(np.asarray(x), x_all[int(y)]), "rows differ from h5py's"
        fresh.close()
    else:
        globals()["kept"] = training  # alive, mid-epoch, until the interpreter exits
    if ddp:
        dist.barrier()
        with open(f"{args.out}/rank{dist.get_rank()}.json", "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
