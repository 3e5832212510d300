"""``h5serve preload``: load the shards of the ranks given (or this node's, ``--plan``) now, and
return once every one is loaded, with a progress bar."""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..errors import ConfigError
from ..util.logtext import printable
from ..util.units import format_bytes
from .common import EXIT_OK, daemon_client

__all__ = ["cmd_preload", "parse_ranks"]


def parse_ranks(text: str, world_size: int) -> list[int]:
    """'0-3,5' -> [0, 1, 2, 3, 5]. Raised when malformed or out of range: ConfigError."""
    ranks: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            ranks.update(range(int(lo), int(hi or lo) + 1))
    except ValueError as exc:
        raise ConfigError(f"--ranks {text!r} is not a list like 0-3,5") from exc
    bad = sorted(r for r in ranks if not 0 <= r < world_size)
    if bad or not ranks:
        raise ConfigError(f"--ranks {text!r}: ranks must be in [0, {world_size - 1}] (got {bad or 'none'})")
    return sorted(ranks)


def cmd_preload(args: argparse.Namespace) -> int:
    from ..hdf5.source import resolve_dtype
    from ..util.progress import Progress
    from ..wire.protocol import POLL_INTERVAL_S, Acquire, AcquireResult

    if args.mode == "global":
        if args.ranks or args.plan:
            raise ConfigError("--mode global loads the whole file once for every rank: drop --ranks/--plan")
        args.world_size, ranks = args.world_size or 1, [0]
        if args.world_size < 1:
            raise ConfigError(f"--world-size must be >= 1, got {args.world_size}")
    elif args.plan:
        if args.ranks:
            raise ConfigError("--plan and --ranks both choose ranks: pass one of them")
        from .plan import plan_from_args

        plan = plan_from_args(args)
        args.world_size, ranks = plan.world_size, list(plan.ranks)
    elif args.world_size is None:
        raise ConfigError("preload needs --world-size (or --plan inside a SLURM allocation; or --mode global)")
    if args.world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {args.world_size}")
    if not args.plan and args.mode != "global":
        ranks = parse_ranks(args.ranks, args.world_size) if args.ranks else list(range(args.world_size))
    path = os.path.abspath(args.file)
    dtypes = {args.x_key: resolve_dtype(args.dtype_x, "--dtype-x")}
    if args.y_key:
        dtypes[args.y_key] = resolve_dtype(args.dtype_y, "--dtype-y")
    if args.mode == "node":  # the node's ranks share one block: the union of their contiguous shards
        from ..order.sharding import node_selection

        block = node_selection(args.world_size, sorted(ranks))
        places = [(block.rank, block.span)]
    else:
        places = [(rank, 1) for rank in ranks]
    requests = [
        Acquire(path, key, args.world_size, rank, args.mode, None if dtype is None else dtype.str, span)
        for rank, span in places for key, dtype in dtypes.items()
    ]
    start = time.monotonic()
    with daemon_client(args.runtime_dir) as client:
        results = [AcquireResult.from_wire(client.request(r)) for r in requests]  # starts every load
        bar = Progress(f"preloading {len(requests)} segments", sum(r.rows_total for r in results),
                       lambda line: print(line, file=sys.stderr, flush=True))
        try:
            while not all(r.state == "ready" for r in results):
                time.sleep(POLL_INTERVAL_S)
                results = [r if r.state == "ready" else AcquireResult.from_wire(client.request(q))
                           for q, r in zip(requests, results)]
                bar.update(sum(r.rows_done for r in results))
        finally:
            bar.close()
        status = client.status()
    loaded = [s for s in status["segments"] if s["file"] == os.path.realpath(path) and s["state"] == "ready"]
    print(f"preloaded {len(requests)} segments of {printable(path)} for ranks {ranks} "
          f"in {time.monotonic() - start:.2f}s ({format_bytes(sum(s['bytes'] for s in loaded))} for this file in shm)")
    return EXIT_OK
