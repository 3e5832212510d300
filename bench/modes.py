"""The ``modes`` group: what global and node mode cost next to per-rank contiguous shards.

One daemon, the plain bench file. A first job of world size 2 attaches the global dataset on
both ranks (rank 0 loads it); then the node's /dev/shm use is measured; a second job with
another world size attaches the same rows; and rank 0 of 2 iterates in global, node (one node
of 2 ranks) and contiguous mode in lockstep, a batch of each in turn, so that load from other
processes on the machine falls on every mode alike.
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader

from h5serve.client import SharedH5Dataset, make_loader

from .baselines import SeedRankMemCachedDataset
from .common import BenchDaemon, Row, clock, log, median_time

BATCH = 256
WORLD, OTHER_WORLD = 2, 4
MODES = ("contiguous", "global", "node")


def _dataset(path: Path, daemon: BenchDaemon, mode: str, rank: int = 0, world: int = WORLD,
             **kwargs: object) -> SharedH5Dataset:
    layout = {"local_rank": rank, "local_world_size": world, "node_rank": 0, "num_nodes": 1} if mode == "node" else {}
    return SharedH5Dataset(path, "x", "y", mode=mode, rank=rank, world_size=world, runtime_dir=daemon.runtime_dir,
                           fallback="error", timeout=600, **layout, **kwargs)


def _segment_bytes(daemon: BenchDaemon, mode: str) -> tuple[int, int]:
    """(bytes /dev/shm holds for the daemon's segments serving ``mode``, as tmpfs allocates
    them; the segments' size as the daemon reports it) from ``h5serve status --json``."""
    status = json.loads(daemon.cli("status", "--json").stdout)
    segments = [s for s in status["segments"] if mode in s["modes"]]
    held = sum(os.stat(Path(status["shm_dir"]) / s["name"]).st_blocks * 512 for s in segments)
    return held, sum(s["bytes"] for s in segments)


def _memcpy_time(path: Path, repeat: int) -> float:
    """Seconds to copy x once into already-touched memory: the least any private preload pays."""
    with h5py.File(path, "r") as f:
        x = f["x"][...]
    dst = np.empty_like(x)
    dst[:] = 0
    return median_time(lambda: np.copyto(dst, x), repeat)


def memory_and_attach(path: Path, daemon: BenchDaemon, repeat: int) -> list[Row]:
    """Node memory of a world-size-2 job in global mode; a world-size-4 job attaching it."""
    with h5py.File(path, "r") as f:
        native = sum(f[k].size * f[k].dtype.itemsize for k in ("x", "y"))
    first_job = [_dataset(path, daemon, "global", rank) for rank in range(WORLD)]
    held, reported = _segment_bytes(daemon, "global")
    shards = [_dataset(path, daemon, "contiguous", rank) for rank in range(WORLD)]
    shards_held, _ = _segment_bytes(daemon, "contiguous")
    for ds in shards:
        ds.close()
    mib = 1024**2
    rows = [Row(f"memory: a {WORLD}-rank job in global mode, /dev/shm (x of the data's native size, one node)",
                "x native", held / native, shards_held / native, 1.0, higher_is_better=False,
                target="<= 1.1x native", target_vs_limit=1 / 1.1,
                note=f"native {native / mib:,.1f} MiB; segments {held / mib:,.1f} MiB held in /dev/shm "
                     f"({reported / mib:,.1f} MiB by status); baseline: the same job's per-rank contiguous "
                     f"shards ({shards_held / mib:,.1f} MiB)")]

    def attach(world: int) -> None:
        _dataset(path, daemon, "global", 0, world, dtype_x=np.float32).close()

    h5 = median_time(lambda: attach(OTHER_WORLD), repeat * 3)
    alone = median_time(lambda: attach(1), repeat * 3)
    seed = median_time(lambda: SeedRankMemCachedDataset(str(path), "x", "y", rank=0, world_size=1), repeat)
    memcpy = _memcpy_time(path, repeat)
    rows.append(Row(f"ready: a world-size-{OTHER_WORLD} job attaching a global dataset (loaded by a world-size-{WORLD} "
                    "job) vs seed preload of all rows, float32 out", "ms", h5 * 1e3, seed * 1e3, memcpy * 1e3,
                    higher_is_better=False, target=">= 50x faster", target_ratio=50,
                    note=f"world size 1: {alone * 1e3:.2f} ms; seed: RankMemCachedH5Dataset of every row (rank 0 "
                         "of 1, its float32 cast); limit: memcpy of x"))
    for ds in first_job:
        ds.close()
    return rows


def _first_epoch(loader: DataLoader) -> tuple[float, int]:
    """(seconds, minor page faults) of epoch 0 right after the dataset attached: it faults the
    mapping's pages in."""
    loader.batch_sampler.set_epoch(0)
    faults, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, clock()
    for _ in loader:
        pass
    return clock() - t, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def _lockstep(loaders: dict[str, DataLoader], epochs: range, threads: int) -> dict[str, np.ndarray]:
    """Every full batch's seconds, per loader, over ``epochs`` run in lockstep (a batch of
    each in turn, the order rotated every epoch), with ``threads`` torch threads (the
    gather's): whatever else the machine runs meanwhile falls on every loader alike."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    times: dict[str, list[float]] = {mode: [] for mode in loaders}
    try:
        for epoch in epochs:
            modes = list(loaders)[epoch % len(loaders):] + list(loaders)[:epoch % len(loaders)]
            iterators = {}
            for mode in modes:
                loaders[mode].batch_sampler.set_epoch(epoch)
                iterators[mode] = iter(loaders[mode])
            while iterators:
                for mode in modes:
                    if mode not in iterators:
                        continue
                    t = clock()
                    batch = next(iterators[mode], None)
                    took = clock() - t
                    if batch is None:
                        del iterators[mode]
                    elif len(batch[0]) == BATCH:
                        times[mode].append(took)
    finally:
        torch.set_num_threads(before)
    return {mode: np.array(t) for mode, t in times.items()}


def iteration(path: Path, daemon: BenchDaemon, epochs: int) -> list[Row]:
    """Rank 0 of 2: global and node mode against contiguous mode, in lockstep, with one torch
    thread (what torchrun gives each of 2 ranks on a node, OMP_NUM_THREADS=1) and with this
    process's threads (as the iterate group; in the note), after a first epoch of each that
    faults its mapping in (timed alone, in the note). The figure is a typical batch's,
    ``BATCH / median batch time``: a batch that another process preempted is an outlier the
    median leaves out, where a mean takes it on whichever mode it hit (0.71x-1.16x for two
    modes reading the same segment, under load). The means are in the note."""
    datasets = {mode: _dataset(path, daemon, mode) for mode in MODES}
    loaders = {mode: make_loader(ds, BATCH, seed=0) for mode, ds in datasets.items()}
    threads = torch.get_num_threads()
    first = {mode: _first_epoch(loader) for mode, loader in loaders.items()}
    epochs_timed = range(1, 1 + max(epochs, 5))
    one = _lockstep(loaders, epochs_timed, 1)
    many = _lockstep(loaders, epochs_timed, threads) if threads > 1 else one
    batches = {mode: len(loaders[mode].batch_sampler) for mode in MODES}

    def median(t: dict[str, np.ndarray], mode: str) -> float:
        return BATCH / float(np.median(t[mode]))

    def mean(t: dict[str, np.ndarray], mode: str) -> float:
        return BATCH * len(t[mode]) / float(t[mode].sum())

    rows = []
    for mode, what in (("global", "DistributedShuffleSampler over every row"),
                       ("node", "NodeShuffleSampler over the node's rows (one node)")):
        rows.append(Row(
            f"iterate shm, workers=0, 1 thread: {mode} mode vs contiguous mode (rank 0 of {WORLD})", "samples/s",
            median(one, mode), median(one, "contiguous"), target=">= 0.9x contiguous", target_ratio=0.9,
            note=f"{what}; {batches[mode]} batches of {BATCH} per epoch (contiguous: {batches['contiguous']}); "
                 f"baseline: make_loader over rank 0's contiguous shard, batches of the three modes in turn; "
                 f"{BATCH} / median batch time; mean: {mean(one, mode) / mean(one, 'contiguous'):.2f}x; with "
                 f"{threads} torch threads: {median(many, mode):,.0f} vs {median(many, 'contiguous'):,.0f} "
                 f"samples/s ({median(many, mode) / median(many, 'contiguous'):.2f}x; mean "
                 f"{mean(many, mode) / mean(many, 'contiguous'):.2f}x); first epoch after attaching, "
                 f"{threads} threads: {first[mode][0] * 1e3:.0f} ms and {first[mode][1]:,} minor page faults vs "
                 f"{first['contiguous'][0] * 1e3:.0f} ms and {first['contiguous'][1]:,}",
            extra={"threads": threads, "contiguous_mean_one_thread": mean(one, "contiguous"),
                   "contiguous_mean_threads": mean(many, "contiguous")}))
    for ds in datasets.values():
        ds.close()
    return rows


def run_modes(files: dict[str, Path], repeat: int, epochs: int) -> list[Row]:
    path = files["plain"]
    with BenchDaemon() as daemon:
        log("modes: global-mode memory and a second job attaching it")
        rows = memory_and_attach(path, daemon, repeat)
        log("modes: iteration in global, node and contiguous mode")
        rows += iteration(path, daemon, epochs)
    return rows
