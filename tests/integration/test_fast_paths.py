"""Correctness of every fast path: batch gathers, make_loader, the lazy chunk cache, per-batch
casts. Each fast path must give exactly the rows, dtypes and order of the plain path; speed
itself is measured in bench/, not here."""

from __future__ import annotations

import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from h5serve.client import (
    Batch,
    EpochBatchSampler,
    EpochShuffleSampler,
    H5LazyDataset,
    SampleList,
    SharedH5Dataset,
    collate,
    make_loader,
)
from h5serve.client.gather import as_positions
from h5serve.errors import ConfigError, DataError

from ..helpers import Daemon

pytestmark = pytest.mark.timeout(240)

BACKENDS = ("shm", "lazy-cached", "lazy-uncached")


def open_dataset(backend: str, path: Path, daemon: Daemon, **kwargs) -> SharedH5Dataset:
    if backend == "shm":
        ds = SharedH5Dataset(path, runtime_dir=daemon.runtime_dir, fallback="error", **kwargs)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "reading lazily instead"
            ds = SharedH5Dataset(path, runtime_dir=str(daemon.runtime_dir) + "-none", timeout=0.2,
                                 cache_bytes=None if backend == "lazy-cached" else 0, **kwargs)
        assert ds.backend == "lazy"
    assert ds.backend == backend.split("-")[0]
    return ds


def rows_of(path: Path, key: str) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f[key][...]


def write(path: Path, **datasets: tuple[np.ndarray, dict]) -> Path:
    with h5py.File(path, "w") as f:
        for key, (data, options) in datasets.items():
            f.create_dataset(key, data=data, **options)
    return path


@pytest.fixture
def images(tmp_path: Path) -> Path:
    rng = np.random.default_rng(7)
    x = rng.integers(0, 256, (2000, 3, 8, 8), dtype=np.uint8)
    y = rng.integers(0, 10, 2000).astype(np.int64)
    return write(tmp_path / "img.h5", x=(x, {"chunks": (64, 3, 8, 8)}), y=(y, {"chunks": (100,)}))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["contiguous", "interleave"])
def test_make_loader_matches_plain_dataloader(backend: str, mode: str, images: Path, shared_daemon: Daemon) -> None:
    ds = open_dataset(backend, images, shared_daemon, x_key="x", y_key="y", mode=mode, rank=1, world_size=3)
    x_all, y_all = rows_of(images, "x"), rows_of(images, "y")
    shard = np.arange(1, 2000, 3) if mode == "interleave" else np.arange(667, 1334)
    assert np.array_equal(ds.indices, shard)
    fast = make_loader(ds, 64, seed=5)
    plain = DataLoader(ds, batch_size=64, sampler=EpochShuffleSampler(len(ds), seed=5))
    for epoch in (0, 1):
        fast.batch_sampler.set_epoch(epoch)
        plain.sampler.set_epoch(epoch)
        order = EpochShuffleSampler(len(ds), seed=5)
        order.set_epoch(epoch)
        want = shard[order.order().numpy()]
        got_fast = [(x.clone(), y.clone()) for x, y in fast]
        got_plain = list(plain)
        assert len(got_fast) == len(got_plain) == -(-len(ds) // 64)
        xs = torch.cat([x for x, _ in got_fast]).numpy()
        ys = torch.cat([y for _, y in got_fast]).numpy()
        assert np.array_equal(xs, x_all[want]) and np.array_equal(ys, y_all[want])
        for (xf, yf), (xp, yp) in zip(got_fast, got_plain):
            assert torch.equal(xf, xp) and torch.equal(yf, yp)
            assert xf.dtype == torch.uint8 and yf.dtype == torch.int64
    ds.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_getitems_batch_and_collate(backend: str, images: Path, shared_daemon: Daemon) -> None:
    ds = open_dataset(backend, images, shared_daemon, x_key="x", y_key="y", rank=0, world_size=1)
    x_all, y_all = rows_of(images, "x"), rows_of(images, "y")
    picks = [5, 1999, 0, 5, -1, 700]
    batch = ds.__getitems__(picks)
    assert isinstance(batch, Batch) and len(batch) == 6
    x, y = collate(batch)
    want = np.array(picks) % 2000
    assert np.array_equal(x.numpy(), x_all[want]) and np.array_equal(y.numpy(), y_all[want])
    # default_collate sees per-sample pairs and stacks the same tensors again
    dx, dy = torch.utils.data.default_collate(batch)
    assert torch.equal(dx, x) and torch.equal(dy, y)
    assert [int(s[1]) for s in batch] == list(y_all[want]) and len(batch[1:3]) == 2
    # tensors of any integer dtype and numpy arrays index the same rows
    for indices in (torch.tensor(picks, dtype=torch.int32), np.array(picks, dtype=np.int16),
                    torch.tensor([0, *picks])[1:]):
        xi, yi = collate(ds.__getitems__(indices))
        assert torch.equal(xi, x) and torch.equal(yi, y)
    # x-only data: a real list (default_collate needs one) that collate short-cuts
    xonly = open_dataset(backend, images, shared_daemon, x_key="x", rank=0, world_size=1)
    samples = xonly.__getitems__(picks)
    assert isinstance(samples, SampleList) and len(samples) == 6
    assert torch.equal(collate(samples), x) and torch.equal(torch.utils.data.default_collate(samples), x)
    # gathered batches are fresh, writable memory: writing one changes nothing served
    x.fill_(0)
    assert np.array_equal(collate(ds.__getitems__(picks))[0].numpy(), x_all[want])
    ds.close()
    xonly.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_index_errors(backend: str, images: Path, shared_daemon: Daemon) -> None:
    ds = open_dataset(backend, images, shared_daemon, x_key="x", y_key="y", rank=0, world_size=2)
    for bad in ([1000], [-1001], torch.tensor([5, 1000]), [0.5]):
        with pytest.raises(IndexError):
            ds.__getitems__(bad)
    with pytest.raises(IndexError):
        ds[1000]
    assert int(ds[-1][1]) == int(rows_of(images, "y")[999])
    assert len(collate(ds.__getitems__([]))[0]) == 0
    ds.close()


CASTS = [
    ("uint8", "float32"), ("uint8", "int64"), ("int16", "int64"), ("float16", "float32"), ("int32", "float64"),
    ("bool", "float32"), ("uint16", "int32"), ("int8", "uint8"), ("float64", "float32"), ("uint32", "int64"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("source,requested", CASTS)
def test_per_batch_casts_follow_numpy(backend: str, source: str, requested: str, tmp_path: Path,
                                      shared_daemon: Daemon) -> None:
    rng = np.random.default_rng(1)
    raw = rng.integers(-300, 70000, (300, 5)).astype(np.float64) * 0.5
    if source == "bool":
        raw = raw > 0
    with np.errstate(invalid="ignore", over="ignore"):
        x = raw.astype(source)
    path = write(tmp_path / "cast.h5", x=(x, {"chunks": (32, 5)}))
    ds = open_dataset(backend, path, shared_daemon, x_key="x", dtype_x=requested, rank=0, world_size=1)
    perm = torch.randperm(300, generator=torch.Generator().manual_seed(3))
    got = collate(ds.__getitems__(perm))
    with np.errstate(invalid="ignore", over="ignore"):
        want = x[perm.numpy()].astype(requested)
    assert got.dtype == torch.from_numpy(want).dtype
    assert np.array_equal(got.numpy(), want, equal_nan=want.dtype.kind == "f")
    ds.close()


def test_lazy_cache_layouts_and_interleave(tmp_path: Path, no_daemon_env: Path) -> None:
    """Chunk runs smaller than a read, one row per chunk, an unchunked dataset, gzip+shuffle:
    the cached lazy path serves exactly the uncached rows for every rank and mode."""
    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, (1001, 7), dtype=np.uint8)
    path = write(
        tmp_path / "layouts.h5",
        tiny=(x, {"chunks": (1, 7)}),
        flat=(x, {}),
        gz=(x, {"chunks": (50, 7), "compression": "gzip", "shuffle": True}),
        odd=(x, {"chunks": (333, 7)}),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for key in ("tiny", "flat", "gz", "odd"):
            for mode in ("contiguous", "interleave"):
                for rank in range(3):
                    cached = SharedH5Dataset(path, key, mode=mode, rank=rank, world_size=3, timeout=0.2)
                    plain = SharedH5Dataset(path, key, mode=mode, rank=rank, world_size=3, timeout=0.2, cache_bytes=0)
                    assert cached._backend.cached and not plain._backend.cached
                    perm = torch.randperm(len(cached))
                    for part in perm.split(37):
                        a, b = collate(cached.__getitems__(part)), collate(plain.__getitems__(part))
                        assert torch.equal(a, b)
                        assert np.array_equal(a.numpy(), x[cached.indices[part.numpy()]])
                    assert all(c.missing == 0 for c in cached._backend._caches)


def test_lazy_cache_budget_decides(tmp_path: Path, no_daemon_env: Path) -> None:
    x = np.arange(4000, dtype=np.float32).reshape(1000, 4)
    path = write(tmp_path / "b.h5", x=(x, {"chunks": (100, 4)}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        fits = SharedH5Dataset(path, "x", rank=0, world_size=2, cache_bytes=500 * 16, timeout=0.2)
        over = SharedH5Dataset(path, "x", rank=0, world_size=2, cache_bytes=500 * 16 - 1, timeout=0.2)
    assert fits._backend.cached and not over._backend.cached
    assert torch.equal(collate(fits.__getitems__([3, 499])), collate(over.__getitems__([3, 499])))
    for bad in (-1, 1.5, "1G", True):
        with pytest.raises(ConfigError, match="cache_bytes"):
            SharedH5Dataset(path, "x", cache_bytes=bad)


def test_lazy_cache_damaged_chunk_is_an_error_not_zeros(tmp_path: Path, no_daemon_env: Path) -> None:
    x = (np.arange(100 * 131072) % 251).astype(np.uint8).reshape(100, 131072)  # 1.25 MiB chunks: one per read
    path = write(tmp_path / "bad.h5", x=(x, {"chunks": (10, 131072), "compression": "gzip"}))
    with h5py.File(path, "r") as f:
        offset = f["x"].id.get_chunk_info(5).byte_offset  # rows 50..59
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(b"\xff" * 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ds = SharedH5Dataset(path, "x", rank=0, world_size=1, timeout=0.2)
    assert torch.equal(collate(ds.__getitems__([1, 99])), torch.from_numpy(x[[1, 99]]))
    for _ in range(2):  # the chunk stays unread: asking again fails again, never serves garbage
        with pytest.raises(DataError, match=r"rows 5\d\.\.5\d"):
            ds.__getitems__([3, 55])
    assert torch.equal(collate(ds.__getitems__([62])), torch.from_numpy(x[[62]]))


@pytest.mark.parametrize("rdcc_nbytes", [64, 256 * 1024**2])
def test_h5lazydataset_cached_and_uncached_agree(rdcc_nbytes: int, h5file: Path) -> None:
    ds = H5LazyDataset(str(h5file), "x", "y", x_dtype=np.float32, rdcc_nbytes=rdcc_nbytes)
    assert ds._cached == (rdcc_nbytes > 64)
    x_all, y_all = rows_of(h5file, "x").astype(np.float32), rows_of(h5file, "y")
    loader = DataLoader(ds, batch_size=100, shuffle=True, generator=torch.Generator().manual_seed(0))
    seen = []
    for x, y in loader:
        assert np.array_equal(x.numpy(), x_all[y.numpy()])  # y[i] == i in this file
        seen += y.tolist()
    assert sorted(seen) == list(range(1000))
    picks = [7, 999, 7]
    got = ds.__getitems__(picks)
    assert all(np.array_equal(g[0].numpy(), x_all[p]) and int(g[1]) == y_all[p] for g, p in zip(got, picks))


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_make_loader_workers_same_batches(context: str, images: Path, shared_daemon: Daemon) -> None:
    for backend in ("shm", "lazy-cached"):
        ds = open_dataset(backend, images, shared_daemon, x_key="x", y_key="y", rank=0, world_size=2)
        single = [(x.clone(), y.clone()) for x, y in make_loader(ds, 50, seed=1)]
        loader = make_loader(ds, 50, seed=1, num_workers=2, multiprocessing_context=context, timeout=60)
        assert loader.persistent_workers and loader.prefetch_factor == 2
        for epoch in (0, 0):  # persistent workers serve a second pass the same way
            loader.batch_sampler.set_epoch(epoch)
            got = list(loader)
            assert len(got) == len(single)
            assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, single))
        del loader
        ds.close()


def test_worker_seeding_differs_per_worker(images: Path, no_daemon_env: Path) -> None:
    class Draw(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4

        def __getitems__(self, indices):
            return [float(np.random.random()) for _ in indices]

    loader = make_loader(Draw(), 1, num_workers=2, seed=0, timeout=60)
    draws = [tuple(b.tolist()) for b in loader]
    assert len(set(draws)) == 4  # numpy seeded per worker, not the same stream twice


def test_batch_sampler_resume_and_drop_last() -> None:
    sampler = EpochShuffleSampler(103, seed=9)
    batches = EpochBatchSampler(sampler, 10, drop_last=True)
    assert len(batches) == 10
    got = list(batches)
    assert len(got) == 10 and all(len(b) == 10 for b in got)
    assert torch.equal(torch.cat(got), sampler.order()[:100])
    batches = EpochBatchSampler(EpochShuffleSampler(103, seed=9), 10)
    assert len(batches) == 11
    it = iter(batches)
    first = [next(it) for _ in range(3)]
    state = batches.state_dict()
    assert state["consumed"] == 30
    resumed = EpochBatchSampler(EpochShuffleSampler(103, seed=9), 10)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert torch.equal(torch.cat(first + rest), EpochShuffleSampler(103, seed=9).order())
    assert len(rest[-1]) == 3
    for b in got:  # batches do not view the whole order (index_select and pickling would pay for it)
        assert b.storage_offset() == 0 and b.untyped_storage().nbytes() == b.nbytes


@pytest.mark.parametrize("workers", [0, 2])
def test_default_collate_takes_the_whole_batch(images: Path, shared_daemon: Daemon, workers: int) -> None:
    """A plain DataLoader (no collate_fn) gets the gathered tensors themselves, as the list
    ``[x, y]`` default_collate makes of tuple samples, with and without workers; rows
    collated one by one still give the same values."""
    ds = open_dataset("shm", images, shared_daemon, x_key="x", y_key="y")
    try:
        batch = ds.__getitems__([5, 1, 7])
        whole = default_collate(batch)
        assert isinstance(whole, list) and whole[0] is batch.x and whole[1] is batch.y
        assert isinstance(batch[0], tuple) and len(batch[0]) == 2  # a plain pair to everyone else
        by_row = default_collate([batch[i] for i in range(3)])
        assert torch.equal(by_row[0], batch.x) and torch.equal(by_row[1], batch.y)

        def loader(collate_fn: object) -> DataLoader:
            return DataLoader(ds, batch_size=64, sampler=EpochShuffleSampler(len(ds), seed=1), collate_fn=collate_fn,
                              num_workers=workers, timeout=60 if workers else 0)

        pairs = list(zip(loader(None), loader(collate), strict=True))
        assert len(pairs) == -(-len(ds) // 64)
        for (x0, y0), (x1, y1) in pairs:
            assert torch.equal(x0, x1) and torch.equal(y0, y1)
    finally:
        ds.close()


def test_batch_sampler_arrays_for_workers(images: Path, shared_daemon: Daemon) -> None:
    """With workers, make_loader's batch sampler yields small int64 arrays (no shared-memory
    file per batch on the way to a worker): the same batches, the same samples."""
    tensors = list(EpochBatchSampler(EpochShuffleSampler(103, seed=9), 10))
    arrays = list(EpochBatchSampler(EpochShuffleSampler(103, seed=9), 10, arrays=True))
    assert all(isinstance(a, np.ndarray) and a.dtype == np.int64 for a in arrays)
    assert [a.tolist() for a in arrays] == [t.tolist() for t in tensors]
    ds = open_dataset("shm", images, shared_daemon, x_key="x", y_key="y")
    try:
        in_process, workers = make_loader(ds, 64, seed=3), make_loader(ds, 64, seed=3, num_workers=2)
        assert not in_process.batch_sampler.arrays and workers.batch_sampler.arrays
        for (x0, y0), (x1, y1) in zip(in_process, workers, strict=True):
            assert torch.equal(x0, x1) and torch.equal(y0, y1)
        del workers
    finally:
        ds.close()


def test_make_loader_refuses_bad_arguments(images: Path, no_daemon_env: Path) -> None:
    ds = H5LazyDataset(str(images), "x", "y")
    for kwargs, match in (
        ({"num_workers": -1}, "num_workers"),
        ({"collate_fn": collate}, "collate_fn"),
        ({"worker_init_fn": print}, "num_workers > 0"),
        ({"sampler": EpochShuffleSampler(5)}, "covers 5"),
    ):
        with pytest.raises(ConfigError, match=match):
            make_loader(ds, 8, **kwargs)
    with pytest.raises(ConfigError, match="batch_size"):
        make_loader(ds, 0)


def test_as_positions() -> None:
    assert as_positions([0, -1, 3], 5).tolist() == [0, 4, 3]
    assert as_positions(np.array([], dtype=np.int64), 5).numel() == 0
    big = torch.arange(100)
    view = as_positions(big[10:20], 100)
    assert view.tolist() == list(range(10, 20)) and view.untyped_storage().nbytes() == 80
    with pytest.raises(IndexError):
        as_positions(torch.tensor([1.0]), 5)
    with pytest.raises(IndexError):
        as_positions([5], 5)


def test_gathers_leave_fork_usable(images: Path, shared_daemon: Daemon) -> None:
    """After serving batches, a plain fork() child can still run parallel torch ops: a gather
    on torch's OpenMP pool would make that child hang. Run in a fresh interpreter, since any
    parallel torch op earlier in this test process would poison its forks the same way."""
    import subprocess
    import sys

    script = f"""
import os, signal, warnings, torch
warnings.simplefilter("ignore")
from h5serve.client import SharedH5Dataset, make_loader, collate
for rt, cache in (({str(shared_daemon.runtime_dir)!r}, None), ("/nonexistent-h5s-rt", None)):
    ds = SharedH5Dataset({str(images)!r}, "x", "y", runtime_dir=rt, timeout=0.3, cache_bytes=cache)
    for batch in make_loader(ds, 256, seed=0):
        pass
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(20)
        big = torch.randn(1500, 1500)
        (big @ big).sum()
        collate(ds.__getitems__([1, 2, 3]))
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, ("child hung or died", ds.backend, status)
    print(ds.backend)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["shm", "lazy"]


_MMAP_PROBE = """
import ctypes, sys
import numpy as np, torch
from torch.utils.data import DataLoader
from h5serve.client import make_loader

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                              "fsmblks", "uordblks", "fordblks", "keepcost")]

class Probe(torch.utils.data.Dataset):
    # is a fresh 2 MiB block mmapped (mallinfo2.hblkhd grows) after an earlier one was freed?
    def __len__(self):
        return 2

    def __getitems__(self, indices):
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = MallInfo2
        first = np.ones(2 << 20, np.uint8)
        del first  # glibc's default now raises its mmap threshold past 2 MiB
        before = libc.mallinfo2().hblkhd
        second = np.ones(2 << 20, np.uint8)
        return [libc.mallinfo2().hblkhd - before >= second.nbytes for _ in indices]

plain = DataLoader(Probe(), batch_size=2, num_workers=1, timeout=60)
fast = make_loader(Probe(), 2, num_workers=1, timeout=60)
print(list(plain)[0].tolist(), list(fast)[0].tolist())
"""


def test_make_loader_workers_return_batch_memory() -> None:
    """In a fresh interpreter (a long-lived one has free heap that hides the difference), a
    plain DataLoader worker puts a batch-sized block on the heap after freeing one, where
    make_loader's workers keep batch-sized blocks on mmap, returned to the system when freed."""
    import ctypes
    import subprocess
    import sys

    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("not glibc >= 2.33")
    done = subprocess.run([sys.executable, "-c", _MMAP_PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[False, False] [True, True]", done.stdout


def test_make_loader_pins_only_where_cuda_is(images: Path, no_daemon_env: Path) -> None:
    ds = H5LazyDataset(str(images), "x", "y")
    loader = make_loader(ds, 16)
    assert loader.pin_memory is torch.cuda.is_available()
    assert make_loader(ds, 16, pin_memory=False).pin_memory is False
    x, y = next(iter(loader))
    assert len(x) == 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_make_loader_batches_are_pinned_on_cuda(images: Path, shared_daemon: Daemon) -> None:
    ds = open_dataset("shm", images, shared_daemon, x_key="x", y_key="y", rank=0, world_size=1)
    for workers in (0, 2):
        x, y = next(iter(make_loader(ds, 64, num_workers=workers, timeout=60)))
        assert x.is_pinned() and y.is_pinned()
        assert torch.equal(x.cuda(non_blocking=True).cpu(), x)
    ds.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ("shm", "lazy-cached"))
def test_make_loader_without_workers_is_torchs_loop_and_profilable(backend: str, images: Path,
                                                                    shared_daemon: Daemon) -> None:
    """make_loader's ShmDataLoader skips torch's per-batch profiler record only while no
    profiler runs: the same batches as a plain DataLoader, and under torch.profiler every
    batch still shows up as torch's ``enumerate(DataLoader)`` record."""
    from torch.profiler import ProfilerActivity, profile

    from h5serve.client import ShmDataLoader

    ds = open_dataset(backend, images, shared_daemon, x_key="x", y_key="y")
    try:
        loader = make_loader(ds, 7, seed=3)
        assert type(loader) is ShmDataLoader and isinstance(loader, DataLoader)
        plain = DataLoader(ds, batch_sampler=loader.batch_sampler, collate_fn=collate)
        for epoch in range(2):
            loader.batch_sampler.set_epoch(epoch)
            got = [(x.clone(), y.clone()) for x, y in loader]
            want = [(x.clone(), y.clone()) for x, y in plain]
            assert len(got) == len(want) == len(loader)
            for (gx, gy), (wx, wy) in zip(got, want):
                assert torch.equal(gx, wx) and torch.equal(gy, wy)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            batches = sum(1 for _ in loader)
        records = [e for e in prof.events() if e.name.startswith("enumerate(DataLoader)")]
        assert batches == len(loader) and len(records) >= batches
    finally:
        ds.close()


def test_the_default_lazy_cache_is_the_rank_s_share_of_the_node(tmp_path: Path, monkeypatch) -> None:
    """Every rank on a node caching its shard stays within half the node's memory together:
    the default budget is divided by torchrun's LOCAL_WORLD_SIZE (it was half the memory
    available in every process)."""
    from h5serve.client.backends.chunkcache import auto_cache_bytes

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = auto_cache_bytes()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    shared = auto_cache_bytes()
    assert 0 < shared <= alone // 4 * 1.1  # MemAvailable moves a little between the two reads
    path = tmp_path / "one.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(4000, dtype=np.float32).reshape(1000, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 ** 40))  # a share too small for the 16 KB shard
    with pytest.warns(RuntimeWarning, match="no h5serve daemon"):
        uncached = SharedH5Dataset(path, "x", timeout=0.2, runtime_dir=tmp_path / "none")
    assert uncached.backend == "lazy" and not uncached._backend.cached
    assert float(uncached[999].sum()) == float(np.arange(3996, 4000).sum())
