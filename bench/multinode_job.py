"""The multi-node bench's job (bench/multinode.py), one ``torchrun`` per namespace node: opens
``PATH`` in ``--mode`` from the node's daemon, takes the wall-clock time of its first batch,
then iterates one epoch (make_loader, batch 256, no workers) and writes ``<out>/rank<N>.json``:
``first_batch`` (time.time() of it), ``samples_per_s`` (the epoch after the first batch).

A script (torchrun runs it by path in each node): imports only h5serve and torch.
"""

import argparse
import json
import os
import time

import torch.distributed as dist

from h5serve.client import SharedH5Dataset, make_loader


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("out")
    p.add_argument("--mode", default="global")
    args = p.parse_args()
    dist.init_process_group("gloo")
    ds = SharedH5Dataset(args.path, "x", "y", mode=args.mode, fallback="error", timeout=600)
    loader = make_loader(ds, 256, seed=0)
    batches = iter(loader)
    first = next(batches)
    first_batch = time.time()
    samples, started = 0, time.perf_counter()
    for x, _ in batches:
        samples += len(x)
    took = time.perf_counter() - started
    report = {"rank": dist.get_rank(), "host": os.uname().nodename, "first_batch": first_batch,
              "samples_per_s": samples / took if took else 0.0, "backend": ds.backend, "first_len": len(first[0])}
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f)
    ds.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
