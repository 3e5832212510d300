"""Ranks the bigdata group launches: ``torchrun --nproc-per-node 2 -m bench.bigdata_jobs SYSTEM DATA ...``.

SYSTEM is ``stream`` (h5serve, mode="stream", from the daemon at ``--runtime-dir``), ``lazy``
(h5serve global mode, no daemon: lazy h5py reads), ``streaming`` (MosaicML Streaming, the data
dir as its remote, a private local cache bounded by ``cache_limit``) or ``litdata`` (LitData, the
data dir as a ``local:`` remote, a private cache bounded by ``max_cache_size``). Each step
"trains" for ``--step-ms`` (a sleep, as a GPU step leaves the CPU to the loader), batch 256,
``num_workers=0``. Rank 0 prints one ``result {json}`` line: first-batch wall time, each epoch's
end wall time, seconds spent in ``next()`` per epoch, steps that waited over 1 ms, and its labels
(row ids) per epoch, for the shuffle figures. ``--max-epoch-s``: once an epoch has run that long, rank 0
reports what it has (that epoch ``cut``) and the ranks end, so a thrashing cache still gives its
rate and its order.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from .peer_jobs import import_streaming

BATCH = 256
WAIT_S = 0.001


def build(system: str, data: str, args: argparse.Namespace):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if system in ("stream", "lazy"):
        from h5serve.client import SharedH5Dataset, make_loader

        kw: dict = ({"mode": "stream", "block_rows": args.block_rows, "runtime_dir": args.runtime_dir,
                     "fallback": "error"} if system == "stream" else
                    {"mode": "global", "runtime_dir": "/nonexistent"})
        ds = SharedH5Dataset(data, "x", "y", rank=rank, world_size=world, timeout=600, **kw)
        if system == "stream":
            assert ds.backend == "shm", ds.backend
        return make_loader(ds, BATCH, seed=0)
    cache = os.path.join(args.cache, f"rank{rank}" if system == "litdata" else "")
    if system == "streaming":
        from torch.utils.data import DataLoader

        ds = import_streaming().StreamingDataset(remote=data, local=cache, batch_size=BATCH, shuffle=True,
                                                 cache_limit=args.budget)
        return DataLoader(ds, batch_size=BATCH, num_workers=0)
    import litdata

    os.environ["GLOBAL_RANK"] = str(rank)
    ds = litdata.StreamingDataset(litdata.streaming.resolver.Dir(path=cache, url=f"local:{data}"), shuffle=True,
                                  drop_last=True, max_cache_size=args.budget)
    return litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=0)


def set_epoch(loader, epoch: int) -> None:
    for owner in (loader, getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None),
                  getattr(loader, "dataset", None)):
        if owner is not None and hasattr(owner, "set_epoch") and owner is not loader:
            owner.set_epoch(epoch)
            return


def _cut_at(args: argparse.Namespace, rank: int, state: dict) -> None:
    """Watchdog: once an epoch has run ``--max-epoch-s``, report what rank 0 has and end the rank
    at once (a thrashing Streaming cache can block in one ``next()`` for tens of seconds, and its
    next epoch waits for the last one's threads)."""
    while not state["done"]:
        time.sleep(0.2)
        if time.perf_counter() - state["start"] > args.max_epoch_s and not state["done"]:
            if rank == 0:
                seen = list(state["seen"])
                r = {k: list(v) for k, v in state["result"].items() if isinstance(v, list)}
                r["ends"].append(time.time())
                r["wait"].append(state["wait"])
                r["waited"].append(state["slow"])
                r["steps"].append(state["n"])
                r["labels"].append(np.concatenate(seen).tolist() if seen else [])
                r["cut"].append(True)
                print("result " + json.dumps({**r, "first_batch": state["result"]["first_batch"], "blocks": {}}),
                      flush=True)
            import faulthandler

            print(f"rank {rank}: epoch cut after {args.max_epoch_s} s; its threads:", file=sys.stderr, flush=True)
            faulthandler.dump_traceback(all_threads=True)  # where a hung rank was (stderr)
            os._exit(0)


def run(args: argparse.Namespace) -> int:
    import threading

    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = build(args.system, args.data, args)
    result: dict = {"first_batch": 0.0, "ends": [], "wait": [], "waited": [], "steps": [], "labels": [], "cut": []}
    state: dict = {"start": time.perf_counter(), "done": False, "result": result, "seen": [],
                   "wait": 0.0, "slow": 0, "n": 0}
    if args.max_epoch_s:
        threading.Thread(target=_cut_at, args=(args, rank, state), daemon=True).start()
    for epoch in range(args.epochs):
        set_epoch(loader, epoch)
        state.update(start=time.perf_counter(), seen=[], wait=0.0, slow=0, n=0)
        it = iter(loader)
        while True:
            t = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            dt = time.perf_counter() - t
            y = batch["y"] if isinstance(batch, dict) else batch[1]
            if not result["first_batch"]:
                result["first_batch"] = time.time()
            else:  # the first batch is the start-up figure, not a step
                state.update(wait=state["wait"] + dt, slow=state["slow"] + (dt > WAIT_S), n=state["n"] + 1)
            state["seen"].append(np.asarray(y).astype(np.int64).ravel())
            time.sleep(args.step_ms / 1000)
        result["ends"].append(time.time())
        result["wait"].append(state["wait"])
        result["waited"].append(state["slow"])
        result["steps"].append(state["n"])
        result["labels"].append(np.concatenate(state["seen"]).tolist() if state["seen"] else [])
        result["cut"].append(False)
    state["done"] = True
    cache = getattr(getattr(getattr(loader, "dataset", None), "stream", None), "cache", None)
    counted = ("attaches", "budget_waits", "ready_waits", "waited_s", "yields")  # rank 0's stream blocks (DaemonBlocks)
    blocks = {k: getattr(cache, k) for k in counted if hasattr(cache, k)}
    if rank == 0:  # before the barrier: rank 0's figures stand when the other rank's epoch is cut
        print("result " + json.dumps({**result, "blocks": blocks}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bigdata_jobs")
    p.add_argument("system", choices=("stream", "lazy", "streaming", "litdata"))
    p.add_argument("data")
    p.add_argument("--runtime-dir")
    p.add_argument("--budget", type=int, default=0, help="bytes: the peers' cache_limit / max_cache_size")
    p.add_argument("--cache", default="", help="the peers' local cache directory")
    p.add_argument("--block-rows", type=int, default=None)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--step-ms", type=float, default=2.0)
    p.add_argument("--max-epoch-s", type=float, default=0, help="end an epoch after this many seconds (0: never)")
    return run(p.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
