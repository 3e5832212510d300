"""A stream-mode job for tests/integration/test_stream_daemon.py's stopped-rank tests, run under
torchrun (2 ranks): no collective after the start, so one rank goes on while the other is
stopped. Each rank writes ``<out>/rank<N>.pid`` at the start and ``<out>/rank<N>.step`` (the
batches done) after every batch, then ``<out>/rank<N>.json``: the labels seen, or the error
that ended it (the process then exits 1)."""

import argparse
import json
import os
import time

import torch.distributed as dist

from h5serve.client import SharedH5Dataset, make_loader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("out")
    parser.add_argument("--window", required=True)
    parser.add_argument("--block-rows", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--pause", type=float, default=0.01, help="seconds per batch (a training step)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ds = SharedH5Dataset(args.path, "x", "y", mode="stream", window=args.window, block_rows=args.block_rows,
                         timeout=args.timeout, fallback="error")
    dist.barrier()  # both ranks set up: from here on, none waits for the other
    with open(f"{args.out}/rank{rank}.pid", "w") as f:
        f.write(str(os.getpid()))
    report: dict = {"rank": rank, "backend": ds.backend, "labels": []}
    started = time.monotonic()
    try:
        for step, (_, y) in enumerate(make_loader(ds, args.batch_size, seed=3)):
            report["labels"] += y.tolist()
            with open(f"{args.out}/rank{rank}.step.tmp", "w") as f:
                f.write(str(step + 1))
            os.replace(f"{args.out}/rank{rank}.step.tmp", f"{args.out}/rank{rank}.step")
            time.sleep(args.pause)
    except Exception as exc:  # noqa: BLE001 - the test reads what ended the rank
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["seconds"] = time.monotonic() - started
    # written whole, then renamed: the test reads the report as soon as its name appears
    with open(f"{args.out}/rank{rank}.json.tmp", "w") as f:
        json.dump(report, f)
    os.replace(f"{args.out}/rank{rank}.json.tmp", f"{args.out}/rank{rank}.json")
    ds.close()
    os._exit(1 if "error" in report else 0)  # no teardown collective: the other rank may be stopped


if __name__ == "__main__":
    main()
