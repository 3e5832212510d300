"""The scenarios: each returns Rows (h5serve, the seed-style baseline, the physical limit)."""

from __future__ import annotations

import json
import mmap
import os
import statistics
import time
import warnings
from pathlib import Path

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from h5serve.client import EpochShuffleSampler, SharedH5Dataset, collate, make_loader

from .baselines import SeedH5LazyDataset, SeedRankMemCachedDataset
from .common import BenchDaemon, Row, busy_process, clock, drop_page_cache, log, median_time, nbytes_of, warm_page_cache

BATCH = 256
MB = 1e6


def _rate(loader, epochs: int = 1) -> float:
    """Samples per second over ``epochs`` full passes (the best pass)."""
    best = 0.0
    for epoch in range(epochs):
        sampler = getattr(loader, "batch_sampler", None)
        for s in (sampler, getattr(loader, "sampler", None)):
            if hasattr(s, "set_epoch"):
                s.set_epoch(epoch)
        n, t = 0, clock()
        for batch in loader:
            n += len(batch[0])
        best = max(best, n / (clock() - t))
    return best


def _shm_dataset(path: Path, daemon: BenchDaemon, **kwargs) -> SharedH5Dataset:
    return SharedH5Dataset(path, "x", "y", rank=0, world_size=2, runtime_dir=daemon.runtime_dir,
                           fallback="error", **kwargs)


class _ShardOrder(Sampler[int]):
    """Global row numbers of rank 0's shard in EpochShuffleSampler order (the seed's lazy
    dataset is not sharded: this is how a DDP user would feed it one rank's rows)."""

    def __init__(self, shard: np.ndarray, seed: int = 0) -> None:
        self.shard, self.order = shard, EpochShuffleSampler(len(shard), seed=seed)

    def set_epoch(self, epoch: int) -> None:
        self.order.set_epoch(epoch)

    def __iter__(self):
        return iter(self.shard[self.order.order().numpy()].tolist())

    def __len__(self) -> int:
        return len(self.shard)


# ----- 1. time to a ready dataset ---------------------------------------------------------
def ready(files: dict[str, Path], daemon: BenchDaemon, repeat: int) -> list[Row]:
    path = files["plain"]
    _shm_dataset(path, daemon, dtype_x=np.float32).close()  # the load: later jobs find it warm
    h5 = median_time(lambda: _shm_dataset(path, daemon, dtype_x=np.float32).close(), repeat * 3)
    seed = median_time(lambda: SeedRankMemCachedDataset(str(path), "x", "y", rank=0, world_size=2), repeat)
    shard = np.empty((nbytes_of(path) // 2,), np.uint8)
    shard[:] = 1
    dst = np.empty_like(shard)
    dst[:] = 0
    memcpy = median_time(lambda: np.copyto(dst, shard), repeat)
    return [Row("ready: warm daemon vs seed preload (300 MB shard, float32 out)", "ms", h5 * 1e3, seed * 1e3,
                memcpy * 1e3, higher_is_better=False, target=">= 50x faster", target_ratio=50,
                note="limit: memcpy of the shard (the least any private preload pays)")]


# ----- 2./3. iteration from shm -----------------------------------------------------------
def iteration(files: dict[str, Path], daemon: BenchDaemon, epochs: int) -> list[Row]:
    path = files["plain"]
    rows: list[Row] = []
    ds = _shm_dataset(path, daemon)
    seed_ds = SeedRankMemCachedDataset(str(path), "x", "y", rank=0, world_size=2, dtype_x=None)

    def seed_loader(workers: int = 0) -> DataLoader:
        extra = {"persistent_workers": True, "prefetch_factor": 2} if workers else {}
        return DataLoader(seed_ds, batch_size=BATCH, sampler=EpochShuffleSampler(len(seed_ds)),
                          num_workers=workers, **extra)

    fast_loader = make_loader(ds, BATCH)
    fast = _rate(fast_loader, epochs)
    plain_collate = _rate(DataLoader(ds, batch_size=BATCH, sampler=EpochShuffleSampler(len(ds)), collate_fn=collate),
                          epochs)
    plain_default = _rate(DataLoader(ds, batch_size=BATCH, sampler=EpochShuffleSampler(len(ds))), 1)
    seed = _rate(seed_loader(), 1)
    # the limit: a bare single-threaded gather of the same batches, x and y, from the same
    # segment mapping into new tensors, each batch held until the next (as a training loop holds it)
    batches = [b.numpy().copy() for b in EpochShuffleSampler(len(ds)).batches(BATCH)]
    whole_epoch_limit = bare_gather_rate(ds, batches)
    # batch by batch in lockstep with make_loader, so both see the same machine
    lock_fast, limit, mean_ratio = lockstep_vs_bare(fast_loader, ds, epochs + 1)
    x, y = seed_ds.x, seed_ds.y
    t = clock()
    for b in batches:
        i = torch.from_numpy(b)
        torch.index_select(x, 0, i), torch.index_select(y, 0, i)
    index_select = len(ds) / (clock() - t)
    loader_us, randperm_ms = _fixed_costs(batches, len(ds))
    target = ">= 10x seed, >= 0.9x limit"
    rows.append(Row("iterate shm, workers=0: make_loader", "samples/s", fast, seed, fast * limit / lock_fast,
                    target=target, target_ratio=10, target_vs_limit=0.9,
                    note=f"vs limit: make_loader and a bare np.take of x and y from the segment (1 thread, into "
                         f"new tensors) of the same batches, alternating batch by batch over {epochs + 1} epochs: "
                         f"{1e6 * BATCH / lock_fast:,.0f} us vs {1e6 * BATCH / limit:,.0f} us a typical (median) "
                         f"batch, {mean_ratio:.2f}x on the means (the limit column: make_loader's epoch rate over "
                         f"that ratio); whole epochs, one after the other: make_loader {fast:,.0f}/s, bare "
                         f"{whole_epoch_limit:,.0f}/s. DataLoader's own per-batch work {loader_us:,.0f} us; the "
                         f"epoch's torch.randperm {randperm_ms:,.1f} ms. torch.index_select from private memory, "
                         f"default threads: {index_select:,.0f}/s"))
    limit = whole_epoch_limit
    rows.append(Row("iterate shm, workers=0: DataLoader(collate_fn=collate)", "samples/s", plain_collate, seed, limit,
                    note="per-index sampler, documented collate"))
    rows.append(Row("iterate shm, workers=0: DataLoader, default collate", "samples/s", plain_default, seed, limit,
                    note="default_collate recognises h5serve's batch and passes it through"))

    ds32 = _shm_dataset(path, daemon, dtype_x=np.float32)
    seed32 = SeedRankMemCachedDataset(str(path), "x", "y", rank=0, world_size=2)
    fast32 = _rate(make_loader(ds32, BATCH), epochs)
    seed32_rate = _rate(DataLoader(seed32, batch_size=BATCH, sampler=EpochShuffleSampler(len(seed32))), 1)
    limit32 = bare_gather_rate(ds32, batches)
    rows.append(Row("iterate shm, workers=0, float32 out (uint8 segment, cast per batch)", "samples/s", fast32,
                    seed32_rate, limit32, note="seed keeps a float32 copy; limit: bare np.take + astype, 1 thread"))
    del seed32, ds32

    log("iteration beside a busy process")
    quiet = _rate(make_loader(ds, BATCH), epochs)
    with busy_process():
        busy = _rate(make_loader(ds, BATCH), epochs)
        busy_seed = _rate(seed_loader(), 1)
    rows.append(Row("iterate shm, workers=0, beside one busy process vs quiet", "samples/s", busy, quiet,
                    target=">= 0.8x quiet", target_ratio=0.8,
                    note=f"baseline: the same loop just before, no busy process; the seed beside the busy "
                         f"process: {busy_seed:,.0f}/s"))

    log("iteration with 2 workers")
    fast_w = make_loader(ds, BATCH, num_workers=2)
    seed_w = seed_loader(2)
    _rate(fast_w), _rate(seed_w)  # start the persistent workers
    old_w = make_loader(ds, BATCH, num_workers=2, worker_ring=False)
    _rate(old_w)
    rows.append(Row("iterate shm, workers=2: make_loader vs seed with 2 workers", "samples/s", _rate(fast_w, epochs),
                    _rate(seed_w, epochs), target=">= 1x seed", target_ratio=1.0,
                    note="steady state (persistent workers already started)"))
    rows.append(Row("iterate shm, workers=2: the worker ring vs worker_ring=False (torch's shared-memory files)",
                    "samples/s", _rate(fast_w, epochs), _rate(old_w, epochs), target=">= 3x", target_ratio=3.0,
                    note="each batch copied once out of the worker's ring slot in the training process, against "
                         "a new torch shared-memory file (and its descriptor passing) per tensor"))
    del fast_w, seed_w, old_w
    ds.close()
    return rows


def _fixed_costs(batches: list[np.ndarray], rows: int) -> tuple[float, float]:
    """(microseconds of DataLoader's own work per batch: a dataset that returns a ready batch
    through the same batch sampler protocol and collate; milliseconds of one epoch's
    ``torch.randperm``, which every shuffling sampler pays to match DistributedSampler's order)."""

    class Ready:
        def __len__(self) -> int:
            return rows

        def __getitems__(self, indices: object) -> object:
            return indices

    loader = DataLoader(Ready(), batch_sampler=batches, collate_fn=lambda batch: batch)
    per_batch = []
    for _ in range(3):
        t = clock()
        for _ in loader:
            pass
        per_batch.append((clock() - t) / len(batches))
    perms = []
    for epoch in range(5):
        generator = torch.Generator()
        generator.manual_seed(epoch)
        t = clock()
        torch.randperm(rows, generator=generator)
        perms.append(clock() - t)
    return 1e6 * min(per_batch), 1e3 * statistics.median(perms)


def lockstep_vs_bare(loader: DataLoader, ds: SharedH5Dataset, epochs: int) -> tuple[float, float, float]:
    """(make_loader's samples/s, the bare gather's samples/s, the ratio of their means) with
    the two alternating batch by batch: each of ``loader``'s batches is timed, then a bare
    single-threaded ``np.take`` of x and y (into new tensors) of a batch of the same size from
    another shuffle of the shard (the same rows would still be in the CPU's cache), so both
    see the same machine from moment to moment. Rates are of a typical batch (BATCH over the
    median time): a batch that another process preempted is left out rather than charged to
    whichever side it hit. The first epoch (page faults of the mapping) is not counted."""
    arrays = ds._backend.arrays
    casts = [None if a.dtype == d else d for a, d in zip(arrays, ds._backend.out_dtypes)]
    loader_t: list[float] = []
    bare_t: list[float] = []
    kept = None
    batch = None
    for epoch in range(epochs):
        loader.batch_sampler.set_epoch(epoch)
        order = EpochShuffleSampler(len(ds))  # make_loader's order (seed 0)
        order.set_epoch(epoch)
        # the bare gather's: rows make_loader did not just bring into the CPU's cache
        other = EpochShuffleSampler(len(ds), seed=1)
        other.set_epoch(epoch)
        it = iter(loader)
        for _, bare_positions in zip(order.batches(BATCH), other.batches(BATCH)):
            indices = bare_positions.numpy()
            t0 = clock()
            batch = next(it)  # the previous batch stays alive until this one exists, as in training
            t1 = clock()
            kept = [torch.from_numpy(a.take(indices, axis=0) if c is None else a.take(indices, axis=0).astype(c))
                    for a, c in zip(arrays, casts)]
            t2 = clock()
            if epoch:
                loader_t.append(t1 - t0)
                bare_t.append(t2 - t1)
        assert next(it, None) is None, "make_loader's epoch is not EpochShuffleSampler's"
    del kept, batch
    return (BATCH / statistics.median(loader_t), BATCH / statistics.median(bare_t), sum(bare_t) / sum(loader_t))


def bare_gather_rate(ds: SharedH5Dataset, batches: list[np.ndarray]) -> float:
    """Samples/s of the gather alone: one single-threaded ``np.take`` per array (and the cast
    to the dataset's output dtype) of ``batches`` out of ``ds``'s arrays, into new tensors,
    each batch kept alive until the next one is made (as a training loop keeps it)."""
    arrays = ds._backend.arrays
    casts = [None if a.dtype == d else d for a, d in zip(arrays, ds._backend.out_dtypes)]
    kept = None
    t = clock()
    for b in batches:
        kept = [torch.from_numpy(a.take(b, axis=0) if c is None else a.take(b, axis=0).astype(c))
                for a, c in zip(arrays, casts)]
    took = clock() - t
    del kept
    return sum(len(b) for b in batches) / took


# ----- 4. the lazy fallback -----------------------------------------------------------------
def lazy(files: dict[str, Path]) -> list[Row]:
    path = files["plain"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ds = SharedH5Dataset(path, "x", "y", rank=0, world_size=2, runtime_dir="/nonexistent-h5serve-bench",
                             timeout=0.5)
    assert ds.backend == "lazy"
    cold = _rate(make_loader(ds, BATCH), 1)  # the first epoch reads every chunk once
    warm = _rate(make_loader(ds, BATCH), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        nocache = SharedH5Dataset(path, "x", "y", rank=0, world_size=2, runtime_dir="/nonexistent-h5serve-bench",
                                  timeout=0.5, cache_bytes=0)
    nocache_loader = make_loader(nocache, BATCH)
    n, t = 0, clock()
    for i, (x, _) in enumerate(nocache_loader):
        n += len(x)
        if i == 40:
            break
    nocache_rate = n / (clock() - t)
    shard = ds.indices
    ds.close()  # HDF5 will not open one file twice in a process with different SWMR flags
    nocache.close()
    seed_ds = SeedH5LazyDataset(str(path), "x", "y")
    seed = _rate(DataLoader(seed_ds, batch_size=BATCH, sampler=_ShardOrder(shard)), 1)
    rows = [
        Row("lazy fallback, workers=0, first epoch (cold chunk cache)", "samples/s", cold, seed,
            target=">= 30x seed", target_ratio=30, note="seed: per-item f[key][i], 256 MB HDF5 chunk cache"),
        Row("lazy fallback, workers=0, later epochs (warm chunk cache)", "samples/s", warm, seed),
        Row("lazy fallback, cache_bytes=0 (uncached rows)", "samples/s", nocache_rate, seed,
            note="41 batches; per-chunk-run reads"),
    ]
    seed_ds.close()
    return rows


# ----- 5./6. loading into shm ---------------------------------------------------------------
def _read_direct_rate(path: Path, into: str = "fresh") -> float:
    """MB/s of ``read_direct`` of the whole x dataset into ``into`` memory: ``fresh`` (np.empty,
    as a user writes it), ``touched`` (every page already faulted in) or ``shm`` (a fresh
    fallocated /dev/shm file mapping: what a load into shared memory has to write to)."""
    with h5py.File(path, "r") as f:
        d = f["x"]
        nbytes = d.size * d.dtype.itemsize
        if into == "shm":
            name = f"/dev/shm/h5serve-bench-{os.getpid()}"
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                t = clock()
                os.posix_fallocate(fd, 0, nbytes)
                buffer = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                out = np.frombuffer(buffer, d.dtype).reshape(d.shape)
                d.read_direct(out)
                took = clock() - t
                del out
                buffer.close()
            finally:
                os.close(fd)
                os.unlink(name)
            return nbytes / took / MB
        out = np.empty(d.shape, d.dtype)
        if into == "touched":
            out.reshape(-1)[:: 4096] = 0
        t = clock()
        d.read_direct(out)
        return nbytes / (clock() - t) / MB


def _shm_copy_rate(path: Path, fallocate: bool = False, kernel: bool = False, cold: bool = False) -> float:
    """MB/s of moving rank 0's half of the x dataset's stored bytes from the file into a fresh
    /dev/shm file: ``pread``/``pwrite`` through a 4 MiB buffer, or (``kernel``) ``sendfile``
    (a kernel-side splice, no user buffer). ``fallocate``: the ``posix_fallocate`` of the
    target is timed too (a load reserves every page before writing: the no-SIGBUS
    rule of docs/reliability.md), which makes this the limit of a load from request to ready. ``cold``: the file is
    dropped from the page cache first. What rawcopy does, minus HDF5 and the daemon."""
    with h5py.File(path, "r") as f:
        d = f["x"]
        nbytes = d.size * d.dtype.itemsize // 2
        starts: list[int] = []
        d.id.chunk_iter(lambda chunk: starts.append(chunk.byte_offset))
        start = min(starts) if starts else d.id.get_offset()
    if cold:
        drop_page_cache(path)
    name = f"/dev/shm/h5serve-bench-{os.getpid()}"
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with open(path, "rb") as src:
            if not fallocate:
                os.posix_fallocate(fd, 0, nbytes)
            buffer = memoryview(bytearray(4 * 1024 * 1024))
            t = clock()
            if fallocate:
                os.posix_fallocate(fd, 0, nbytes)
            done = 0
            while done < nbytes:
                if kernel:
                    n = os.sendfile(fd, src.fileno(), start + done, min(1 << 30, nbytes - done))
                else:
                    n = os.preadv(src.fileno(), [buffer[: min(len(buffer), nbytes - done)]], start + done)
                    os.pwrite(fd, buffer[:n], done)
                done += n
            took = clock() - t
    finally:
        os.close(fd)
        os.unlink(name)
    return nbytes / took / MB


def _recycle_pages(nbytes: int) -> None:
    """Reserve ``nbytes`` of /dev/shm and free them again, so that what is timed next allocates
    pages freed moments ago. On these VMs the guest reports free memory to the host a few
    seconds after it is freed (page_reporting), and taking it back makes a fallocate slower:
    307 MB took 25 ms right after a free and 32-76 ms 0.5-5 s later. A bare copy timed right
    after another one, and a load timed after its daemon's start-up, would otherwise not see
    the same machine.

    Each CPU frees an equal share: allocating pages that the same CPU freed moments ago is
    faster (307 MB, fallocate: 26 ms on the CPU that freed them, 30 ms on the other), and the
    process timed next is not always on the CPU this one ran on (a bare copy here was, a
    loader is wherever the scheduler puts it)."""
    cpus = sorted(os.sched_getaffinity(0))
    held: list[tuple[int, int]] = []
    try:
        for index, cpu in enumerate(cpus):
            os.sched_setaffinity(0, {cpu})
            name = f"/dev/shm/h5serve-bench-recycle-{os.getpid()}-{index}"
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            held.append((cpu, fd))
            os.unlink(name)
            os.posix_fallocate(fd, 0, max(nbytes // len(cpus), 1))
        for cpu, fd in held:  # the pages are freed when the last descriptor goes
            os.sched_setaffinity(0, {cpu})
            os.close(fd)
        held = []
    finally:
        for _, fd in held:
            os.close(fd)
        os.sched_setaffinity(0, set(cpus))


def _load(path: Path, flags: tuple[str, ...], mode: str = "contiguous", warm_file: Path | None = None,
          repeat: int = 1, cold: bool = False) -> tuple[float, float]:
    """(seconds from a client's request to a ready dataset, seconds the loader spent reading
    rows) for rank 0's x shard (of 2) on a fresh daemon whose loader processes are warm. The
    file stays in the page cache (--keep-page-cache): these rows measure warm-cache loads, and
    a daemon's drop of the pages it read would make every later load here a cold one.
    ``cold``: the file is dropped from the page cache just before the request."""
    times, reads = [], []
    for _ in range(repeat):
        with BenchDaemon(*flags, "--keep-page-cache") as daemon:
            if warm_file is not None:
                SharedH5Dataset(warm_file, "x", rank=0, world_size=1, runtime_dir=daemon.runtime_dir,
                                fallback="error").close()
                # idle a moment, as a daemon is when a job starts: its spare loader is forked
                # 20 ms after the last load and then copies the pages it shares (daemon/loading/spare.py)
                time.sleep(0.2)
            if cold:
                drop_page_cache(path)
            _recycle_pages(nbytes_of(path) // 2)
            t = clock()
            ds = SharedH5Dataset(path, "x", rank=0, world_size=2, mode=mode, runtime_dir=daemon.runtime_dir,
                                 fallback="error", timeout=600)
            times.append(clock() - t)
            ds.close()
            status = json.loads(daemon.cli("status", "--json").stdout)
            reads += [s["load_read_s"] for s in status["segments"] if s["file"] == str(path)]
    return statistics.median(times), statistics.median(reads)


def loading(files: dict[str, Path], tiny: Path, repeat: int) -> list[Row]:
    rows = []
    plain, gz = files["plain"], files["gzip"]
    shard_mb = nbytes_of(plain) / 2 / MB
    fresh = max(_read_direct_rate(plain) for _ in range(repeat))
    touched = max(_read_direct_rate(plain, "touched") for _ in range(repeat))
    shm = max(_read_direct_rate(plain, "shm") for _ in range(repeat))
    copy = max(_shm_copy_rate(plain) for _ in range(repeat))
    seed_t = median_time(lambda: SeedRankMemCachedDataset(str(plain), "x", rank=0, world_size=2, dtype_x=None),
                         repeat)
    # the bare copies and the loads in turn, round after round, best of each: a load and its
    # limit see the same machine (and the same state of its memory: on a VM, pages the guest
    # has not touched for a while cost far more to fault in than recently freed ones)
    bare = {False: 0.0, True: 0.0}
    loads: dict[str, list[tuple[float, float]]] = {"1": [], "2": []}
    for _ in range(max(repeat, 3)):
        for kernel in (False, True):
            _recycle_pages(nbytes_of(plain) // 2)
            bare[kernel] = max(bare[kernel], _shm_copy_rate(plain, fallocate=True, kernel=kernel))
        for procs in ("1", "2"):
            loads[procs].append(_load(plain, ("--load-processes", procs), warm_file=tiny))
    limit = max(bare.values())
    for procs in ("1", "2"):
        total, read = min(loads[procs])
        rows.append(Row(f"load into shm, uncompressed, {procs} loader process(es): request to ready", "MB/s",
                        shard_mb / total, shard_mb / seed_t, limit, target=">= 0.9x bare copy",
                        target_vs_limit=0.9,
                        note=f"limit: the shard's bytes copied into a fresh /dev/shm file, its fallocate "
                             f"included, one process (pread/pwrite {bare[False]:,.0f}, sendfile {bare[True]:,.0f}); "
                             f"best of {len(loads[procs])} rounds, loads and copies in turn, each after freeing "
                             f"as many /dev/shm pages (median load "
                             f"{shard_mb / statistics.median(t for t, _ in loads[procs]):,.0f}); read_direct of the "
                             f"whole dataset into fresh memory {fresh:,.0f}, into touched memory {touched:,.0f}; "
                             f"baseline: seed f[key][a:b]"))
        rows.append(Row(f"load into shm, uncompressed, {procs} loader process(es): reading rows", "MB/s",
                        shard_mb / read, None, copy,
                        note=f"the loader's read phase; limit: pread/pwrite of the stored bytes into a fresh "
                             f"fallocated /dev/shm file, one process (read_direct into such a mapping: {shm:,.0f})"))
    total, read = _load(plain, ("--load-processes", "1"), mode="interleave", warm_file=tiny, repeat=repeat)
    rows.append(Row("load into shm, interleave mode, 1 loader process: reading rows", "MB/s", shard_mb / read, None,
                    copy, note=f"contiguous blocks read, strided into a staging buffer, pwritten (twice the "
                               f"rows read for 2 ranks); request to ready {shard_mb / total:,.0f} MB/s"))
    cold_total, _ = _load(plain, ("--load-processes", "1"), warm_file=tiny, repeat=repeat, cold=True)
    cold_limit = max(_shm_copy_rate(plain, fallocate=True, kernel=True, cold=True) for _ in range(repeat))
    drop_page_cache(plain)
    cold_seed = shard_mb / median_time(
        lambda: (drop_page_cache(plain), SeedRankMemCachedDataset(str(plain), "x", rank=0, world_size=2, dtype_x=None)),
        repeat)
    warm_page_cache(plain)
    rows.append(Row("load into shm, uncompressed, cold page cache, 1 loader process: request to ready (report only)",
                    "MB/s", shard_mb / cold_total, cold_seed, cold_limit,
                    note="the file dropped from the page cache first (posix_fadvise DONTNEED), as on a cluster "
                         "node; limit: the bare sendfile copy with its fallocate, from the cold file; baseline: "
                         "the seed's preload from the cold file"))
    gz_limit = max(_read_direct_rate(gz) for _ in range(repeat))
    t1, _ = _load(gz, ("--load-processes", "1"), warm_file=tiny, repeat=repeat)
    t2, _ = _load(gz, ("--load-processes", "2"), warm_file=tiny, repeat=repeat)
    rows.append(Row("load into shm, shuffle+gzip: 2 loader processes vs 1", "MB/s", shard_mb / t2, shard_mb / t1,
                    gz_limit, target=">= 1.7x one process", target_ratio=1.7,
                    note="request to ready; baseline: the same daemon with --load-processes 1; limit: one-process "
                         "read_direct of the whole dataset"))
    return rows


def float_data(files: dict[str, Path], daemon: BenchDaemon, epochs: int) -> list[Row]:
    path = files["float32"]
    ds = _shm_dataset(path, daemon)
    seed_ds = SeedRankMemCachedDataset(str(path), "x", "y", rank=0, world_size=2, dtype_x=None)
    fast = _rate(make_loader(ds, BATCH), epochs)
    seed = _rate(DataLoader(seed_ds, batch_size=BATCH, sampler=EpochShuffleSampler(len(seed_ds))), 1)
    batches = [b.numpy().copy() for b in EpochShuffleSampler(len(ds)).batches(BATCH)]
    limit = bare_gather_rate(ds, batches)
    ds.close()
    return [Row("iterate shm, workers=0, float32 data (12 KiB rows)", "samples/s", fast, seed, limit,
                note="the targets are for the default data; with rows 4x larger both sides are closer to "
                     "memory bandwidth. Limit: bare np.take of x and y, 1 thread")]


def run_iteration_suite(files: dict[str, Path], tiny: Path, repeat: int, epochs: int) -> list[Row]:
    rows: list[Row] = []
    with BenchDaemon() as daemon:
        log("time to a ready dataset")
        rows += ready(files, daemon, repeat)
        log("iteration from shm")
        rows += iteration(files, daemon, epochs)
        log("iteration, float32 data")
        rows += float_data(files, daemon, epochs)
    log("lazy fallback")
    rows += lazy(files)
    time.sleep(0.5)
    log("loading")
    rows += loading(files, tiny, repeat)
    return rows
