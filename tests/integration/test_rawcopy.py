"""Loads that copy stored bytes file to file (h5serve.hdf5.rawcopy) instead of reading through h5py.

The copy is only right when the file holds the rows exactly as numpy does: these tests pin
down which datasets take it (and that every other kind still goes through h5py), that copied
rows are byte-identical to h5py's from a real daemon with one and with several loader
processes, and that a file ending early is a clear error, never silent zeros.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.client import SharedH5Dataset
from h5serve.errors import DataError, SourceChanged
from h5serve.hdf5.rawcopy import copy_rows, read_stored_rows, stored_rows
from h5serve.hdf5.reads import ShardWrite, read_shard_into
from h5serve.hdf5.source import inspect_dataset
from h5serve.order.sharding import Selection

from ..helpers import Daemon, short_workdir
from .test_parallel_load import kill_tree, start_daemon

pytestmark = pytest.mark.timeout(120)

ROWS, SHAPE = 1000, (3, 8, 8)


def _data(dtype: str = "uint8") -> np.ndarray:
    return (np.arange(ROWS * 192) % 251).astype(dtype).reshape(ROWS, *SHAPE)


# Each kind: (create_dataset keywords, whether rows are copied file to file)
KINDS: dict[str, tuple[dict, bool]] = {
    "contiguous": ({}, True),
    "chunked": ({"chunks": (64, *SHAPE)}, True),
    "chunked-float64": ({"chunks": (50, *SHAPE), "dtype": "float64"}, True),
    "chunked-float16": ({"chunks": (50, *SHAPE), "dtype": "float16"}, True),
    "chunked-int32": ({"chunks": (100, *SHAPE), "dtype": "int32"}, True),
    "contiguous-complex64": ({"dtype": "complex64"}, True),
    "partial-row-chunks": ({"chunks": (64, 3, 4, 8)}, False),
    "gzip": ({"chunks": (64, *SHAPE), "compression": "gzip"}, False),
    "shuffle": ({"chunks": (64, *SHAPE), "shuffle": True}, False),
    "fletcher32": ({"chunks": (64, *SHAPE), "fletcher32": True}, False),
    "big-endian": ({"dtype": ">i4"}, False),
    "bool": ({"dtype": "bool"}, False),
}


def _write(path: Path, kind: str, userblock: int = 0) -> np.ndarray:
    kw, _ = KINDS[kind]
    kw = dict(kw)
    dtype = kw.pop("dtype", "uint8")
    data = _data("int64").astype(dtype) if dtype != "bool" else _data("int64") % 2 == 0
    with h5py.File(path, "w", userblock_size=userblock) if userblock else h5py.File(path, "w") as f:
        f.create_dataset("x", data=data, **kw)
    return data


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with short_workdir("h5s-rc-") as where:
        yield where


# ----- which datasets are copied ----------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_which_datasets_are_copied(workdir: Path, kind: str) -> None:
    path = workdir / f"which-{kind}.h5"
    data = _write(path, kind)
    with h5py.File(path, "r") as f:
        info = inspect_dataset(f, "x")
        stored = stored_rows(f["x"], info, info.dtype)
        assert (stored is not None) == KINDS[kind][1]
        if data.dtype.kind in "iuf":  # asking for another dtype (a cast) never copies
            assert stored_rows(f["x"], info, np.dtype("float32" if data.dtype != np.float32 else "float64")) is None


def test_too_many_chunks_go_through_h5py(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = workdir / "many-chunks.h5"
    _write(path, "chunked")  # 16 chunks of 64 rows
    with h5py.File(path, "r") as f:
        info = inspect_dataset(f, "x")
        monkeypatch.setattr("h5serve.hdf5.rawcopy.MAX_MAPPED_CHUNKS", 16)
        assert stored_rows(f["x"], info, info.dtype) is not None
        monkeypatch.setattr("h5serve.hdf5.rawcopy.MAX_MAPPED_CHUNKS", 15)
        assert stored_rows(f["x"], info, info.dtype) is None


def test_unwritten_and_compact_datasets_are_not_copied(workdir: Path) -> None:
    path = workdir / "odd.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("empty", shape=(ROWS, *SHAPE), dtype="uint8")  # never written: fill value
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.COMPACT)
        space = h5py.h5s.create_simple((4, 4))
        h5py.h5d.create(f.id, b"compact", h5py.h5t.NATIVE_UINT8, space, dcpl=dcpl).write(
            h5py.h5s.ALL, h5py.h5s.ALL, np.ones((4, 4), np.uint8))
    with h5py.File(path, "r") as f:
        for key in ("empty", "compact"):
            info = inspect_dataset(f, key)
            assert stored_rows(f[key], info, info.dtype) is None, key
    with h5py.File(path, "r", driver="core") as f:  # not HDF5's plain file driver: no file offsets to copy
        assert stored_rows(f["empty"], inspect_dataset(f, "empty"), np.dtype("uint8")) is None


# ----- the bytes are h5py's ---------------------------------------------------------------
@pytest.mark.parametrize("userblock", [0, 1024])
@pytest.mark.parametrize("kind", ["contiguous", "chunked", "chunked-float64"])
def test_copied_ranges_equal_h5py(workdir: Path, kind: str, userblock: int) -> None:
    """Any row range (inside a chunk, across chunks, the partial last chunk) lands at its place;
    file offsets count from the end of a user block."""
    path = workdir / f"ranges-{kind}-{userblock}.h5"
    data = _write(path, kind, userblock)
    dest_path = workdir / "dest.bin"
    with h5py.File(path, "r") as f, open(dest_path, "w+b") as dest:
        info = inspect_dataset(f, "x")
        stored = stored_rows(f["x"], info, info.dtype)
        assert stored is not None
        buffer = memoryview(bytearray(1000))  # smaller than a chunk: many reads per extent
        for lo, hi in [(0, ROWS), (0, 1), (5, 6), (63, 65), (100, 700), (990, 1000), (999, 1000), (7, 7)]:
            dest.truncate(0)
            assert copy_rows(stored, lo, hi, dest.fileno(), 4096, buffer)
            got = np.frombuffer(Path(dest_path).read_bytes()[4096:], dtype=data.dtype).reshape(-1, *SHAPE)
            assert np.array_equal(got, data[lo:hi]), (lo, hi)


def test_chunks_out_of_file_order_and_unwritten_chunks(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks written last-to-first sit in the file in reverse; chunks never written are not
    copied (HDF5 serves their fill value, so the blocks holding them go through h5py)."""
    monkeypatch.setattr("h5serve.hdf5.reads.STAGED_BLOCK_BYTES", 200 * 192)  # blocks of two chunks, not the whole file
    path = workdir / "sparse.h5"
    data = _data()
    with h5py.File(path, "w") as f:
        d = f.create_dataset("x", shape=data.shape, dtype="uint8", chunks=(100, *SHAPE), fillvalue=7)
        for c in reversed(range(10)):
            if c not in (3, 4):
                d[c * 100:(c + 1) * 100] = data[c * 100:(c + 1) * 100]
    want = data.copy()
    want[300:500] = 7
    dest_path = workdir / "sparse.bin"
    with h5py.File(path, "r") as f, open(dest_path, "w+b") as dest:
        info = inspect_dataset(f, "x")
        stored = stored_rows(f["x"], info, info.dtype)
        assert stored is not None and list(stored.chunk_offsets < 0) == [c in (3, 4) for c in range(10)]
        buffer = memoryview(bytearray(1 << 16))
        assert not copy_rows(stored, 250, 350, dest.fileno(), 0, buffer)
        assert dest.seek(0, os.SEEK_END) == 0  # nothing written when it refuses
        assert copy_rows(stored, 0, 300, dest.fileno(), 0, buffer)
        assert np.array_equal(np.frombuffer(Path(dest_path).read_bytes(), np.uint8).reshape(-1, *SHAPE), data[:300])
        # the whole shard: copied blocks and h5py blocks side by side
        dest.truncate(ROWS * 192)
        with mmap.mmap(dest.fileno(), ROWS * 192) as m:
            out = np.frombuffer(m, np.uint8).reshape(ROWS, *SHAPE)
            copied = read_shard_into(f["x"], info, Selection("contiguous", 1, 0), out,
                                     how=ShardWrite((dest.fileno(), 0)))
            assert np.array_equal(out, want)
            del out
    assert copied == 600 * 192  # all but the blocks of rows 200..399 and 400..599


def test_file_ending_early_is_a_data_error(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file cut short while it is being loaded: the rows that are gone are an error naming
    them, never zeros in the segment (HDF5's own reads return zeros past the end of a file;
    the daemon also refuses to publish a load whose file changed meanwhile)."""
    path = workdir / "cut.h5"
    _write(path, "contiguous")
    size = os.path.getsize(path)
    with h5py.File(path, "r") as f, open(workdir / "out.bin", "w+b") as dest:
        info = inspect_dataset(f, "x")
        stored = stored_rows(f["x"], info, info.dtype)
        assert stored is not None
        os.truncate(path, size - 50 * 192)  # the last 50 rows are gone
        with pytest.raises(OSError, match="ends at byte"):
            copy_rows(stored, 900, ROWS, dest.fileno(), 0, memoryview(bytearray(1 << 16)))
    monkeypatch.setattr("h5serve.hdf5.reads.STAGED_BLOCK_BYTES", 500 * 192)
    path = workdir / "cut-later.h5"
    _write(path, "contiguous")
    with h5py.File(path, "r") as f, open(workdir / "out.bin", "w+b") as dest:
        dest.truncate(ROWS * 192)

        def cut_after_first_block(rows_done: int) -> None:
            os.truncate(path, size - 50 * 192)

        with pytest.raises(DataError, match=r"cannot read rows 500\.\.999 .*truncated"):
            read_shard_into(f["x"], inspect_dataset(f, "x"), Selection("contiguous", 1, 0),
                            np.zeros((ROWS, *SHAPE), np.uint8), cut_after_first_block,
                            how=ShardWrite((dest.fileno(), 0)))


# ----- end to end, through a real daemon --------------------------------------------------
@pytest.fixture(scope="module")
def split_daemon() -> Iterator[Daemon]:
    d = start_daemon("--load-processes", "3", min_part_bytes=1024)
    try:
        yield d
    finally:
        kill_tree(d)


@pytest.mark.parametrize("mode,world_size", [("contiguous", 1), ("contiguous", 3), ("interleave", 2)])
@pytest.mark.parametrize("kind", ["contiguous", "chunked", "chunked-float64", "gzip", "big-endian"])
def test_daemon_loads_are_byte_identical(split_daemon: Daemon, workdir: Path, kind: str, mode: str,
                                         world_size: int) -> None:
    path = workdir / f"e2e-{kind}.h5"
    if not path.exists():
        _write(path, kind)
    with h5py.File(path, "r") as f:
        data = f["x"][...]
    for rank in range(world_size):
        ds = SharedH5Dataset(path, "x", rank=rank, world_size=world_size, mode=mode,
                             runtime_dir=split_daemon.runtime_dir, fallback="error", timeout=60)
        try:
            got = ds.__getitems__(list(range(len(ds)))).x.numpy()
            want = data[ds.indices]
            assert got.dtype == want.dtype.newbyteorder("=") and got.tobytes() == want.astype(got.dtype).tobytes()
        finally:
            ds.close()
    segments = [s for s in split_daemon.status()["segments"]
                if s["file"] == str(path) and s["mode"] == mode and s["world_size"] == world_size]
    assert len(segments) == world_size
    copies = KINDS[kind][1] and mode == "contiguous"  # interleaved rows are strided in memory instead
    for s in segments:
        assert s["load_copied_bytes"] == (s["rows"] * data[0].nbytes if copies else 0), s
        assert s["load_parts"] > 1  # several processes wrote through the one descriptor


# ----- lazy reads of uncached rows, straight from the file --------------------------------
def test_read_stored_rows_equal_h5py(workdir: Path) -> None:
    path = workdir / "reversed.h5"
    data = _data()
    with h5py.File(path, "w") as f:
        d = f.create_dataset("x", shape=data.shape, dtype="uint8", chunks=(64, *SHAPE))
        for c in reversed(range(0, ROWS, 64)):  # chunks in the file in reverse order
            d[c:c + 64] = data[c:c + 64]
        f.create_dataset("sparse", shape=data.shape, dtype="uint8", chunks=(64, *SHAPE))[:64] = data[:64]
    rng = np.random.default_rng(3)
    with h5py.File(path, "r") as f:
        info = inspect_dataset(f, "x")
        stored = stored_rows(f["x"], info, info.dtype)
        assert stored is not None
        for rows in (np.arange(ROWS), np.array([0]), np.array([63, 64]), np.array([999]),
                     np.unique(rng.integers(0, ROWS, 300)), np.arange(100, 300, 7)):
            out = np.empty((len(rows), *SHAPE), np.uint8)
            assert read_stored_rows(stored, rows, out)
            assert np.array_equal(out, data[rows]), rows
        sparse = stored_rows(f["sparse"], inspect_dataset(f, "sparse"), np.dtype("uint8"))
        assert sparse is not None
        assert read_stored_rows(sparse, np.array([3, 60]), np.empty((2, *SHAPE), np.uint8))
        assert not read_stored_rows(sparse, np.array([3, 70]), np.empty((2, *SHAPE), np.uint8))


def _lazy(path: Path, key: str, **kwargs) -> SharedH5Dataset:
    with pytest.warns(RuntimeWarning, match="lazily"):
        return SharedH5Dataset(path, key, runtime_dir=str(path) + "-no-daemon", timeout=0.2, cache_bytes=0, **kwargs)


@pytest.mark.parametrize("kind", ["contiguous", "chunked", "chunked-float64", "gzip", "big-endian",
                                  "partial-row-chunks"])
def test_lazy_uncached_rows(workdir: Path, kind: str) -> None:
    """Uncached lazy reads (a shard over the cache budget) read stored rows from the file
    directly and everything else through h5py: the same rows either way, in any order."""
    path = workdir / f"lazy-{kind}.h5"
    data = _write(path, kind)
    ds = _lazy(path, "x", rank=1, world_size=3, dtype_x="float32")
    try:
        backend = ds._backend
        assert (backend.handle.located(backend.infos[0])[1] is not None) == KINDS[kind][1]
        positions = np.random.default_rng(0).integers(0, len(ds), 500)  # shuffled, with repeats
        got = ds.__getitems__(positions.tolist()).x.numpy()
        assert got.dtype == np.float32 and np.array_equal(got, data[ds.indices[positions]].astype(np.float32))
    finally:
        ds.close()


@pytest.mark.parametrize("kind", ["contiguous", "gzip", "big-endian"])  # read directly, decompressed, converted
def test_lazy_reads_of_a_file_cut_short_fail_loudly(workdir: Path, kind: str) -> None:
    """A file truncated while a job reads it lazily: the next read that touches the file is
    SourceChanged, whether the rows are read directly or through h5py (HDF5 alone returns
    zeros past the new end of an uncompressed dataset, as the big-endian case would)."""
    path = workdir / f"lazy-cut-{kind}.h5"
    _write(path, kind)
    ds = _lazy(path, "x")
    try:
        assert ds[5].shape == SHAPE  # the file is open
        os.truncate(path, os.path.getsize(path) * 9 // 10)  # the last rows' data is gone
        with pytest.raises(SourceChanged, match=r"changed while this process was reading it .*restart the job"):
            ds.__getitems__([950])
    finally:
        ds.close()


def test_lazy_reads_go_on_from_a_file_replaced_by_rename(workdir: Path) -> None:
    """Writing a new file and renaming it over the old one is the safe way to replace data:
    a running job keeps reading the file it opened, unchanged."""
    path = workdir / "lazy-replaced.h5"
    data = _write(path, "chunked")
    ds = _lazy(path, "x")
    try:
        assert np.array_equal(ds[5].numpy(), data[5])
        new = workdir / "lazy-replaced.h5.new"
        with h5py.File(new, "w") as f:
            f.create_dataset("x", data=np.zeros_like(data), chunks=(64, *SHAPE))
        os.rename(new, path)
        assert np.array_equal(ds.__getitems__([900, 3]).x.numpy(), data[[900, 3]])
    finally:
        ds.close()
