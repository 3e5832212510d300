"""One copy of the data per node: after a load, the daemon drops the source file's cached pages
over exactly the bytes it read (``POSIX_FADV_DONTNEED``), unless started with
``--keep-page-cache``; pages of data it did not read stay. Residency is measured for real with
``mincore`` over a mapping of the file. Also the kernel-side copy (splice) of loads, and its
fallback. Every test has a deadline; every daemon is stopped."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.client import SharedH5Dataset, collate
from h5serve.hdf5.rawcopy import FileCopier, copy_rows, data_extents, drop_cached, stored_rows
from h5serve.hdf5.source import inspect_dataset

from ..helpers import Daemon, short_workdir, wait_for

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no os.posix_fadvise on this platform: the daemon "
                       "cannot drop pages here, and keeps them"),
]

ROW = (4, 32, 32)  # 4 KiB rows
ROWS = 16384  # 64 MiB of x
PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def resident(path: Path, extents: list[tuple[int, int]] | None = None) -> float:
    """The fraction of the pages of ``path`` (over ``extents``: the whole pages inside them)
    that are in the page cache: mincore over a read-only mapping, which faults nothing in."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            vec = (ctypes.c_ubyte * -(-size // PAGE))()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    flags = np.frombuffer(vec, dtype=np.uint8) & 1
    if extents is None:
        return float(flags.mean())
    pages = np.concatenate([np.arange(-(-a // PAGE), (a + n) // PAGE) for a, n in extents])
    return float(flags[pages].mean())


def warm(path: Path) -> None:
    """Every page of ``path`` into the page cache, clean (read, as a job's first epoch would)."""
    with open(path, "rb") as f:
        while f.read(8 << 20):
            pass


def write_file(path: Path, **options: object) -> Path:
    """x (64 MiB of 4 KiB rows), z (a second dataset of 16 MiB the loads never read) and y,
    synced to disk so their pages are clean (the kernel drops clean pages only)."""
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=rng.integers(0, 256, (ROWS, *ROW), dtype=np.uint8), **options)
        f.create_dataset("z", data=rng.integers(0, 256, (ROWS // 4, *ROW), dtype=np.uint8), **options)
        f.create_dataset("y", data=np.arange(ROWS, dtype=np.int64))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def extents_of(path: Path, key: str) -> list[tuple[int, int]]:
    with h5py.File(path, "r") as f:
        found = data_extents(f[key], 0, f[key].shape[0])
    assert found, key
    return found


@pytest.fixture
def workdir() -> Iterator[Path]:
    with short_workdir("h5s-pc-") as d:
        yield d


def _check_pages_can_drop(workdir: Path) -> None:
    probe = workdir / "probe.bin"
    probe.write_bytes(b"\1" * (1 << 20))
    fd = os.open(probe, os.O_RDONLY)
    try:
        os.fsync(fd)
        warm(probe)
        os.posix_fadvise(fd, 0, 1 << 20, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if resident(probe) > 0.5:
        pytest.skip(f"{workdir}'s file system keeps pages POSIX_FADV_DONTNEED asks to drop (tmpfs?)")


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    started: list[Daemon] = []
    try:
        yield started
    finally:
        for d in started:
            d.stop()


def load(daemon: Daemon, path: Path, key: str = "x", **kwargs: object) -> SharedH5Dataset:
    ds = SharedH5Dataset(path, key, mode="global", runtime_dir=daemon.runtime_dir, fallback="error", timeout=120,
                         **kwargs)
    assert ds.backend == "shm"
    return ds


# ----- through a real daemon -------------------------------------------------------------
@pytest.mark.parametrize("layout", ["chunked", "contiguous", "gzip"])
def test_load_drops_the_pages_it_read(workdir: Path, daemons: list[Daemon], layout: str) -> None:
    """After a load of x, x's pages are gone from the page cache (rows copied by splice for
    uncompressed data, read through h5py for gzip); z, in the same file and never read by the
    daemon, keeps its pages."""
    _check_pages_can_drop(workdir)
    options = {"chunked": {"chunks": (256, *ROW)}, "contiguous": {},
               "gzip": {"chunks": (256, *ROW), "compression": "gzip", "compression_opts": 1}}[layout]
    path = write_file(workdir / f"{layout}.h5", **options)
    x_pages, z_pages = extents_of(path, "x"), extents_of(path, "z")
    warm(path)
    assert resident(path, x_pages) > 0.9 and resident(path, z_pages) > 0.9
    daemons.append(Daemon().start())
    ds = load(daemons[0], path)
    want = np.random.default_rng(0).integers(0, 256, (ROWS, *ROW), dtype=np.uint8)
    assert np.array_equal(collate(ds.__getitems__([0, 5000, ROWS - 1])).numpy(), want[[0, 5000, ROWS - 1]])
    # the loader drops them right after telling the daemon the segment is ready
    assert wait_for(lambda: resident(path, x_pages) < 0.05, 20), resident(path, x_pages)
    assert resident(path, z_pages) > 0.9
    ds.close()


def test_keep_page_cache_keeps_them(workdir: Path, daemons: list[Daemon]) -> None:
    """``h5serve start --keep-page-cache``: the pages a load read stay cached."""
    _check_pages_can_drop(workdir)
    path = write_file(workdir / "keep.h5", chunks=(256, *ROW))
    x_pages = extents_of(path, "x")
    warm(path)
    daemons.append(Daemon("--keep-page-cache").start())
    ds = load(daemons[0], path)
    status = daemons[0].status()
    assert [s["state"] for s in status["segments"]] == ["ready"]
    # a dropping loader would have dropped them within moments (see above): give it the time
    assert not wait_for(lambda: resident(path, x_pages) < 0.9, 3)
    ds.close()


def test_two_keys_of_one_file(workdir: Path, daemons: list[Daemon]) -> None:
    """x and y of one file load side by side (two loaders); each drops its own dataset's
    pages only: z, which neither read, stays."""
    _check_pages_can_drop(workdir)
    path = write_file(workdir / "two.h5", chunks=(256, *ROW))
    x_pages, y_pages, z_pages = (extents_of(path, k) for k in ("x", "y", "z"))
    warm(path)
    daemons.append(Daemon("--loaders", "2").start())
    ds = SharedH5Dataset(path, "x", "y", mode="global", runtime_dir=daemons[0].runtime_dir, fallback="error",
                         timeout=120)
    assert collate(ds.__getitems__([7]))[1].tolist() == [7]
    assert wait_for(lambda: resident(path, x_pages) < 0.05 and resident(path, y_pages) < 0.5, 20)
    assert resident(path, z_pages) > 0.9
    ds.close()


# ----- the pieces ------------------------------------------------------------------------
def test_data_extents(workdir: Path) -> None:
    """The bytes each layout reads for a row range: exactly the rows for uncompressed data,
    whole stored chunks for compressed data, whole chunks of parts of rows when all their rows
    are in the range; nothing known without file offsets."""
    path = workdir / "layouts.h5"
    data = np.arange(1000 * 48, dtype=np.uint32).reshape(1000, 4, 12)
    with h5py.File(path, "w") as f:
        f.create_dataset("contiguous", data=data)
        f.create_dataset("chunked", data=data, chunks=(100, 4, 12))
        f.create_dataset("gzip", data=data, chunks=(100, 4, 12), compression="gzip")
        f.create_dataset("parts", data=data, chunks=(100, 2, 12))  # chunks of parts of rows
    row = 4 * 12 * 4
    with h5py.File(path, "r") as f:
        offset = f["contiguous"].id.get_offset()
        assert data_extents(f["contiguous"], 150, 420) == [(offset + 150 * row, 270 * row)]
        assert data_extents(f["contiguous"], 5, 5) == []
        chunked = data_extents(f["chunked"], 150, 420)
        assert sum(n for _, n in chunked) == 270 * row  # rows 150..419 exactly
        with open(path, "rb") as raw:  # and those bytes are the rows
            got = b"".join(os.pread(raw.fileno(), n, a) for a, n in chunked)
        assert got == data[150:420].tobytes()
        gz = data_extents(f["gzip"], 150, 420)
        sizes = {}
        f["gzip"].id.chunk_iter(lambda c: sizes.__setitem__(c.chunk_offset[0], c.size))
        assert sum(n for _, n in gz) == sum(sizes[c] for c in (100, 200, 300, 400))  # chunks 1..4, whole
        parts = data_extents(f["parts"], 150, 420)
        assert sum(n for _, n in parts) == 2 * 100 * 2 * 12 * 4 * 2  # chunks of rows 200..399 only, both halves
    with h5py.File(path, "r", driver="core") as f:
        assert data_extents(f["chunked"], 0, 10) is None  # no file offsets to speak of


def test_drop_cached_drops_only_those_pages(workdir: Path) -> None:
    """Pages inside the ranges go; pages outside stay. (The kernel keeps any page, or large
    folio, that is only partly inside a range: the margins around the ranges are not checked.)"""
    _check_pages_can_drop(workdir)
    mib = 1 << 20
    path = workdir / "pages.bin"
    path.write_bytes(os.urandom(48 * mib))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        warm(path)
        assert resident(path) == 1.0
        assert drop_cached(fd, [(8 * mib, 8 * mib), (32 * mib, 8 * mib)]) == 16 * mib
    finally:
        os.close(fd)
    assert resident(path, [(8 * mib, 8 * mib), (32 * mib, 8 * mib)]) < 0.05
    assert resident(path, [(0, 6 * mib), (18 * mib, 12 * mib), (42 * mib, 6 * mib)]) == 1.0


@pytest.mark.parametrize("mode", ["splice", "buffer", "splice-refused"])
def test_file_copier(workdir: Path, mode: str) -> None:
    """Rows copied file to file by splice, by pread/pwrite, and by splice falling back to the
    buffer half way (a destination opened O_APPEND refuses splice with offsets): the same
    bytes; a file that ends early is an error naming the byte, never zeros."""
    path = workdir / "rows.h5"
    data = np.random.default_rng(3).integers(0, 256, (1000, 3, 64), dtype=np.uint8)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data, chunks=(64, 3, 64))
    dest = workdir / "dest.bin"
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_APPEND if mode == "splice-refused" else 0)
    with h5py.File(path, "r") as f, FileCopier(buffer_bytes=5000, splice=mode != "buffer") as copier:
        stored = stored_rows(f["x"], inspect_dataset(f, "x"), np.dtype(np.uint8))
        assert stored is not None
        fd = os.open(dest, flags, 0o600)
        try:
            assert copy_rows(stored, 0, 1000, fd, 0, copier)
        finally:
            os.close(fd)
        assert copier.splice is (mode == "splice")
    assert dest.read_bytes() == data.tobytes()
    cut = workdir / "cut.h5"
    with h5py.File(cut, "w") as f:
        f.create_dataset("x", data=data)  # contiguous: the rows are the end of the file
    with h5py.File(cut, "r") as f, FileCopier(splice=mode != "buffer") as copier:
        stored = stored_rows(f["x"], inspect_dataset(f, "x"), np.dtype(np.uint8))
        assert stored is not None
        os.truncate(cut, os.path.getsize(cut) - 50 * 192)
        fd = os.open(dest, os.O_RDWR | os.O_TRUNC)
        try:
            with pytest.raises(OSError, match="ends at byte"):
                copy_rows(stored, 900, 1000, fd, 0, copier)
        finally:
            os.close(fd)


def test_interleaved_loads_leave_no_pages(workdir: Path, daemons: list[Daemon]) -> None:
    """Interleaved shards of 3 ranks through one loader: every rank's load reads every row of
    x; loads queued behind the running one keep the pages for each other, and once all are
    done the pages are gone."""
    from ..helpers import h5serve_cli

    _check_pages_can_drop(workdir)
    path = write_file(workdir / "interleave.h5", chunks=(256, *ROW))
    x_pages = extents_of(path, "x")
    warm(path)
    daemons.append(Daemon("--loaders", "1").start())
    done = h5serve_cli("preload", str(path), "--x-key", "x", "--world-size", "3", "--mode", "interleave",
                       env=daemons[0].env, timeout=180)
    assert done.returncode == 0, done.stderr
    assert sorted(s["rank"] for s in daemons[0].status()["segments"]) == [0, 1, 2]
    assert wait_for(lambda: resident(path, x_pages) < 0.05, 20), resident(path, x_pages)
