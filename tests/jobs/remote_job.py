"""A DDP job for tests/integration/test_remote_daemon.py, test_remote_files.py and
test_remote_stream.py, run under torchrun (gloo): every rank opens the same s3:// objects in
``--mode`` (global, or stream with ``--window`` and ``--block-rows``) with the node's daemon
(``fallback="error"``: the daemon's segments or nothing), runs one epoch of a tiny DDP model, and writes
``<out>/rank<N>.json``: the backend, and for every row it saw, its label and the crc32 of x."""

import argparse
import json
import zlib

import numpy as np
import torch.distributed as dist
from torch import nn

from h5serve.client import SharedH5Dataset, make_loader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("out")
    parser.add_argument("--mode", default="global", choices=["global", "stream"])
    parser.add_argument("--window", default="4MiB")  # stream mode's
    parser.add_argument("--block-rows", type=int, default=1024)  # stream mode's
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stream = {"window": args.window, "block_rows": args.block_rows} if args.mode == "stream" else {}
    ds = SharedH5Dataset(args.url, "x", "y", mode=args.mode, fallback="error", **stream)
    features = int(np.prod(np.asarray(ds[0][0]).shape))
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Flatten(), nn.Linear(features, 2)))
    seen: dict[int, int] = {}
    for x, y in make_loader(ds, args.batch, seed=1):
        model(x.float()).sum().backward()  # all-reduced: both ranks take part in every batch
        for row, label in zip(np.asarray(x), np.asarray(y)):
            seen[int(label)] = zlib.crc32(row.tobytes())
    with open(f"{args.out}/rank{rank}.json", "w") as f:
        json.dump({"backend": ds.backend, "rows": len(ds), "seen": seen}, f)
    ds.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
