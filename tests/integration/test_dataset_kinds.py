"""Every kind of dataset h5py can open is either served with the bytes h5py itself reads, or
refused with a clear error naming the reason: on the daemon (shm) backend and on the lazy
backend, in both modes, for several ranks. A refusal never hurts the daemon."""

from __future__ import annotations

import os
import time
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from h5serve.client import SharedH5Dataset, collate
from h5serve.errors import DataError, KeyNotFound, SourceNotFound, UnsupportedDataset
from h5serve.order.sharding import shard_indices

from ..helpers import Daemon

N = 101  # rows: shards of 34/34/33 in contiguous mode, strided in interleave mode
WORLD = 3
RANKS = (0, 2)
MODES = ("contiguous", "interleave")
BACKENDS = ("shm", "lazy")


# ----- values and reference reads --------------------------------------------------------------
def values(shape: tuple[int, ...], dtype: str | np.dtype, seed: int = 0) -> np.ndarray:
    """Rows covering the dtype's range; floats include nan, +-inf and -0.0."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(dt)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        wide = np.int64 if dt.kind == "i" else np.uint64
        return rng.integers(info.min, info.max, shape, endpoint=True, dtype=wide).astype(dt)
    real = rng.standard_normal(shape) * 100
    flat = real.reshape(-1)
    flat[: min(4, flat.size)] = [np.nan, np.inf, -np.inf, -0.0][: min(4, flat.size)]
    if dt.kind == "c":
        return (real + 1j * rng.standard_normal(shape)).astype(dt)
    return real.astype(dt)


def expected(path: Path, key: str, indices: np.ndarray, dtype=None) -> np.ndarray:
    """h5py's own read of the rows, in native byte order (torch holds nothing else; the values
    and, once native, the bytes are h5py's), cast with numpy when a dtype is requested."""
    with h5py.File(path, "r") as f:
        data = f[key][...][indices]
    data = data.astype(data.dtype.newbyteorder("="))
    return data if dtype is None else data.astype(dtype)


def open_ds(backend: str, daemon: Daemon, path: Path, key: str, **kwargs) -> SharedH5Dataset:
    if backend == "shm":
        ds = SharedH5Dataset(path, key, runtime_dir=daemon.runtime_dir, fallback="error", **kwargs)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "reading lazily": expected here
            ds = SharedH5Dataset(path, key, fallback="lazy", **kwargs)
    assert ds.backend == backend
    return ds


def assert_serves(ds: SharedH5Dataset, path: Path, key: str, total: int, dtype_x=None) -> None:
    """Whole-shard batch, single samples and a sparse, repeating, reversed batch all equal
    h5py's read: same dtype, same shape, same bytes."""
    assert ds.total_rows == total
    assert ds.indices.tolist() == shard_indices(total, ds.world_size, ds.rank, ds.mode).tolist()
    want = expected(path, key, ds.indices, dtype_x)
    batch = collate(ds.__getitems__(list(range(len(ds))))).numpy()
    assert batch.dtype == want.dtype
    assert batch.shape == want.shape
    assert batch.tobytes() == want.tobytes()
    n = len(ds)
    if n == 0:
        with pytest.raises(IndexError):
            ds[0]
        return
    for i in sorted({0, n // 2, n - 1}):
        x = ds[i].numpy()
        assert x.dtype == want.dtype and x.shape == want[i].shape
        assert x.tobytes() == want[i].tobytes()
    picks = [n - 1, 0, n - 1, n // 2]  # rows far apart (h5py point selection on the lazy side)
    sparse = collate(ds.__getitems__(picks)).numpy()
    assert sparse.dtype == want.dtype and sparse.tobytes() == want[picks].tobytes()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "shm":
        request.getfixturevalue("shared_daemon")
    else:
        request.getfixturevalue("no_daemon_env")
    return request.param


# ----- served kinds ----------------------------------------------------------------------------
def _compact(f: h5py.File, name: str) -> None:
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.COMPACT)
    dset = f.create_dataset(name, (N, 3), "i2", dcpl=dcpl)
    dset[...] = values((N, 3), "i2", 7)
    assert dset.id.get_create_plist().get_layout() == h5py.h5d.COMPACT


def _resized(f: h5py.File, name: str) -> None:
    dset = f.create_dataset(name, (40, 4), "f4", chunks=(6, 4), maxshape=(None, 4))
    dset[...] = values((40, 4), "f4", 8)
    dset.resize((130, 4))
    dset[40:] = values((90, 4), "f4", 9)
    dset.resize((N, 4))  # shrink into a partial chunk, as a grown-then-trimmed log would


def _vds_same_file(f: h5py.File, name: str) -> None:
    f["vds_part"] = values((N, 2), "i4", 10)
    layout = h5py.VirtualLayout((N, 2), "i4")
    layout[: N // 2] = h5py.VirtualSource(".", "vds_part", shape=(N, 2))[N - N // 2 :]
    layout[N // 2 :] = h5py.VirtualSource(".", "vds_part", shape=(N, 2))[: N - N // 2]
    f.create_virtual_dataset(name, layout)


def _plain(shape: tuple[int, ...], dtype: str, **kwargs) -> Callable[[h5py.File, str], None]:
    def build(f: h5py.File, name: str) -> None:
        f.create_dataset(name, data=values((N, *shape), dtype, zlib.crc32(name.encode())), **kwargs)

    return build


def _link(target: Callable[[str], object]) -> Callable[[h5py.File, str], None]:
    def build(f: h5py.File, name: str) -> None:
        f[name] = target(f.filename)

    return build


def _soft_in_group(path: str) -> Callable[[h5py.File, str], None]:
    """A soft link inside group 'rel/...' to 'rel/data' (made here if missing)."""
    def build(f: h5py.File, name: str) -> None:
        if "rel/data" not in f:
            f["rel/data"] = values((N, 2), "i8", 11)
        f[name] = h5py.SoftLink(path)

    return build


# key -> (builder(file, key), dtype_x)
SERVED: dict[str, tuple[Callable[[h5py.File, str], None], object]] = {
    "be_i4": (_plain((), ">i4"), None),
    "be_f8": (_plain((3,), ">f8"), None),
    "f16": (_plain((4, 2), "f2"), None),
    "bool": (_plain((5,), "?"), None),
    "u16": (_plain((), "u2"), None),
    "i8": (_plain((2,), "i1"), None),
    "c64": (_plain((3,), "c8"), None),
    "a/b/c": (_plain((2,), "f4"), None),
    "soft": (_link(lambda _: h5py.SoftLink("/a/b/c")), None),
    "rel/alias": (_soft_in_group("data"), None),  # relative: resolved in the group holding the link
    "rel/grp/alias": (_soft_in_group("/rel/data"), None),
    "soft_to_ext": (_link(lambda _: h5py.SoftLink("/ext_relative")), None),
    "ext_relative": (_link(lambda _: h5py.ExternalLink("linked.h5", "/deep/x")), None),
    "ext_absolute": (_link(lambda fn: h5py.ExternalLink(str(Path(fn).parent / "linked.h5"), "/deep/x")), None),
    "chunks_not_dividing": (_plain((3,), "u1", chunks=(7, 3)), None),
    "contiguous_layout": (_plain((3,), "i4", chunks=None), None),
    "compact_layout": (_compact, None),
    "gzip": (_plain((4,), "f4", chunks=(5, 4), compression="gzip"), None),
    "lzf": (_plain((4,), "i2", chunks=(5, 4), compression="lzf"), None),
    "shuffle_gzip": (_plain((4,), "f8", chunks=(9, 4), shuffle=True, compression="gzip", compression_opts=9), None),
    "fletcher32": (_plain((4,), "u4", chunks=(8, 4), fletcher32=True), None),
    "scaleoffset_int": (_plain((4,), "i4", chunks=(8, 4), scaleoffset=0), None),
    "scaleoffset_float": (_plain((4,), "f8", chunks=(8, 4), scaleoffset=2), None),  # lossy: h5py's read rules
    "rows_3x5x7": (_plain((3, 5, 7), "f4", chunks=(4, 3, 5, 7)), None),
    "one_d": (_plain((), "f8"), None),
    "cast_be_i2_to_f32": (_plain((3,), ">i2"), np.float32),
    "cast_be_f8_to_f16": (_plain((3,), ">f8"), np.float16),
    "cast_u1_to_i8": (_plain((3,), "u1"), np.int8),
    "zero_rows": (lambda f, name: f.create_dataset(name, (0, 3), "f4"), None),
    "resized": (_resized, None),
    "vds_same_file": (_vds_same_file, None),
}


@pytest.fixture(scope="module")
def served_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("kinds")
    with h5py.File(root / "linked.h5", "w") as f:
        f["deep/x"] = values((N, 3), ">u2", 12)
    path = root / "served.h5"
    with h5py.File(path, "w") as f:
        for key, (build, _) in SERVED.items():
            build(f, key)
    return path


@pytest.mark.parametrize("key", list(SERVED))
def test_served_bytes_equal_h5py(served_file: Path, backend: str, request: pytest.FixtureRequest, key: str) -> None:
    if key == "c64":
        try:
            torch.from_numpy(np.zeros(1, np.complex64))
        except TypeError:
            pytest.skip("this torch has no complex64")
    daemon = request.getfixturevalue("shared_daemon") if backend == "shm" else None
    dtype_x = SERVED[key][1]
    with h5py.File(served_file, "r") as f:
        total = f[key].shape[0]
    assert total == (0 if key == "zero_rows" else N)
    for mode in MODES:
        for rank in RANKS:
            ds = open_ds(backend, daemon, served_file, key, mode=mode, rank=rank, world_size=WORLD, dtype_x=dtype_x)
            try:
                assert_serves(ds, served_file, key, total, dtype_x)
            finally:
                ds.close()


def test_rows_over_one_read_block(tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> None:
    """A dataset over twice the loader's 32 MiB read block (three blocks of 28 rows), with row
    bytes and chunk rows that divide neither the block nor the shard, and interleaved shards
    whose stride does not line up with the block boundaries: every boundary lands right."""
    daemon = request.getfixturevalue("shared_daemon") if backend == "shm" else None
    rows, row = 70, (1000, 1049)  # 1.05 MB rows, 73 MB in all
    path = tmp_path / "big.h5"
    data = np.random.default_rng(3).integers(0, 256, (rows, *row), dtype=np.uint8)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data, chunks=(4, *row))
    for mode, world, rank in (("contiguous", 1, 0), ("interleave", 3, 0), ("interleave", 3, 1),
                              ("contiguous", 2, 1)):
        ds = open_ds(backend, daemon, path, "x", mode=mode, rank=rank, world_size=world)
        try:
            got = collate(ds.__getitems__(list(range(len(ds))))).numpy()
            assert got.tobytes() == data[ds.indices].tobytes()
        finally:
            ds.close()


# ----- external links: the linked file's identity is part of the segment -----------------------
def _write_linked(path: Path, rows: int, seed: int) -> np.ndarray:
    data = values((rows, 3), "i4", seed)
    with h5py.File(path, "w") as f:
        f["deep/x"] = data
    return data


@pytest.mark.parametrize("absolute", [False, True], ids=["relative", "absolute"])
def test_rewritten_external_file_is_never_served_stale(tmp_path: Path, backend: str, absolute: bool,
                                                       request: pytest.FixtureRequest) -> None:
    daemon = request.getfixturevalue("shared_daemon") if backend == "shm" else None
    linked, outer = tmp_path / "linked.h5", tmp_path / "outer.h5"
    with h5py.File(outer, "w") as f:
        f["x"] = h5py.ExternalLink(str(linked) if absolute else "linked.h5", "/deep/x")
    outer_stat = os.stat(outer)

    def serve(data: np.ndarray) -> None:
        for mode in MODES:
            ds = open_ds(backend, daemon, outer, "x", mode=mode, rank=1, world_size=WORLD)
            try:
                assert ds.total_rows == len(data)
                got = collate(ds.__getitems__(list(range(len(ds))))).numpy()
                assert got.tobytes() == data[ds.indices].tobytes()
                assert got.tobytes() == expected(outer, "x", ds.indices).tobytes()
            finally:
                ds.close()

    old = _write_linked(linked, N, 1)
    serve(old)
    time.sleep(0.02)  # a new mtime even on a coarse clock
    new = _write_linked(linked, N, 2)  # same size, same inode, other rows
    assert new.tobytes() != old.tobytes()
    serve(new)
    time.sleep(0.02)  # again: only the mtime tells the rewrite apart
    longer = _write_linked(linked, N + 20, 3)  # other length: the row count must not be cached
    serve(longer)
    assert (os.stat(outer).st_mtime_ns, os.stat(outer).st_size) == (outer_stat.st_mtime_ns, outer_stat.st_size)


# ----- refused kinds ----------------------------------------------------------------------------
def _lzo_without_plugin(f: h5py.File, name: str) -> None:
    # LZO (id 305) is a registered HDF5 filter that neither HDF5, h5py nor hdf5plugin provides
    assert not h5py.h5z.filter_avail(305)
    dset = f.create_dataset(name, (20, 4), dtype="f4", chunks=(5, 4), compression=305, allow_unknown_filter=True)
    for start in range(0, 20, 5):
        dset.id.write_direct_chunk((start, 0), np.ones((5, 4), "f4").tobytes())


def _longdouble(f: h5py.File, name: str) -> None:
    if np.dtype(np.longdouble).itemsize <= 8:
        pytest.skip("long double is float64 on this platform")
    try:
        f[name] = np.ones(10, dtype=np.longdouble)
    except (TypeError, ValueError) as exc:
        pytest.skip(f"h5py cannot write long double here: {exc}")
    if f[name].dtype.itemsize <= 8:
        pytest.skip("h5py reads long double back as float64 here")


def _refs(f: h5py.File, name: str) -> None:
    f["target"] = np.zeros(3)
    dset = f.create_dataset(name, (3,), dtype=h5py.ref_dtype)
    dset[0] = f["target"].ref


def _external_raw(f: h5py.File, name: str) -> None:
    raw = Path(f.filename).parent / "raw.bin"
    np.arange(30, dtype="<i4").tofile(raw)
    f.create_dataset(name, (30,), "<i4", external=[(str(raw), 0, 120)])


def _vds_missing_source(f: h5py.File, name: str) -> None:
    # (a VDS whose sources exist is served: tests/integration/test_many_files.py)
    layout = h5py.VirtualLayout((20,), "f4")
    layout[:] = h5py.VirtualSource(str(Path(f.filename).parent / "vds_gone.h5"), "part", shape=(20,))
    f.create_virtual_dataset(name, layout)


def _chained_external(f: h5py.File, name: str) -> None:
    root = Path(f.filename).parent
    with h5py.File(root / "inner.h5", "w") as g:
        g["a"] = np.arange(30, dtype="i4")
    with h5py.File(root / "mid.h5", "w") as g:
        g["m"] = h5py.ExternalLink(str(root / "inner.h5"), "/a")
    f[name] = h5py.ExternalLink(str(root / "mid.h5"), "/m")


def _two_other_files(f: h5py.File, name: str) -> None:
    root = Path(f.filename).parent
    with h5py.File(root / "second.h5", "w") as g:
        g["a"] = np.arange(30, dtype="i4")
    with h5py.File(root / "first.h5", "w") as g:
        g["grp/x"] = h5py.ExternalLink(str(root / "second.h5"), "/a")
    f["via_first"] = h5py.ExternalLink(str(root / "first.h5"), "/grp")  # a group in first.h5
    f[name] = h5py.SoftLink("/via_first/x")


# key -> (builder, error class, regex the message must match)
REFUSED = {
    # variable-length rows are served (tests/integration/test_vlen.py), but not of every base type or shape
    "vlen_refs": (lambda f, n: f.create_dataset(n, (4,), dtype=h5py.vlen_dtype(h5py.ref_dtype)),
                  UnsupportedDataset, "variable-length sequences of object references"),
    "vlen_2d": (lambda f, n: f.create_dataset(n, (4, 2), dtype=h5py.vlen_dtype(np.int32)), UnsupportedDataset,
                "variable-length rows in 2 dimensions"),
    "compound": (lambda f, n: f.create_dataset(n, data=np.zeros(5, [("a", "<i4"), ("b", "<f8")])),
                 UnsupportedDataset, r"compound.*select one of its fields as the key, e\.g\. 'compound:a'"),
    "array_dtype": (lambda f, n: f.create_dataset(n, (4,), dtype=np.dtype(("i4", (2,)))), UnsupportedDataset,
                    "array type"),
    "longdouble": (_longdouble, UnsupportedDataset, "float128.*extended precision"),
    "lzo_missing": (_lzo_without_plugin, UnsupportedDataset, r"'lzo' \(id 305\).*HDF5_PLUGIN_PATH"),
    "scalar": (lambda f, n: f.create_dataset(n, data=3.0), UnsupportedDataset, "scalar"),
    "object_refs": (_refs, UnsupportedDataset, "object references"),
    "external_raw": (_external_raw, UnsupportedDataset, r"external raw files \(.*raw\.bin\)"),
    "vds_missing_source": (_vds_missing_source, SourceNotFound, r"virtual dataset whose source file .*vds_gone\.h5"),
    "chained_external": (_chained_external, UnsupportedDataset, r"mid\.h5.*inner\.h5.*only one linked file"),
    "two_other_files": (_two_other_files, UnsupportedDataset, r"first\.h5.*second\.h5.*only one linked file"),
    "dangling_soft": (lambda f, n: f.__setitem__(n, h5py.SoftLink("/gone/x")), KeyNotFound,
                      r"'/gone' does not exist.*soft link '/dangling_soft' -> '/gone/x'"),
    "dangling_external": (lambda f, n: f.__setitem__(n, h5py.ExternalLink("missing.h5", "/x")), KeyNotFound,
                          r"'/dangling_external'.* external link to '/x' in file 'missing\.h5'.*cannot be opened"),
    "dangling_external_path": (lambda f, n: f.__setitem__(n, h5py.ExternalLink("other.h5", "/nope")), KeyNotFound,
                               r"external link to '/nope' in file 'other\.h5'.*cannot be opened"),
}


@pytest.fixture(scope="module")
def refused_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("refused")
    with h5py.File(root / "other.h5", "w") as f:
        f["x"] = np.arange(10)
    return root


@pytest.mark.parametrize("key", list(REFUSED))
def test_refused_with_reason(refused_dir: Path, backend: str, request: pytest.FixtureRequest, key: str) -> None:
    build, error, match = REFUSED[key]
    path = refused_dir / f"{key}.h5"
    with h5py.File(path, "w") as f:
        build(f, key)
    with h5py.File(path, "r") as f:  # h5py itself opens every one of these (or sees the dangling link)
        assert key in list(f)  # a link name, even when its target is gone
    daemon = request.getfixturevalue("shared_daemon") if backend == "shm" else None
    for mode in MODES:
        with pytest.raises(error, match=match) as caught:
            open_ds(backend, daemon, path, key, mode=mode, rank=2, world_size=WORLD)
        assert key in str(caught.value)


def _corrupt_chunk(path: Path) -> None:
    with h5py.File(path, "w") as f:
        dset = f.create_dataset("x", (30, 4), "f4", chunks=(5, 4), compression="gzip")
        dset[...] = 1.0
        dset.id.write_direct_chunk((10, 0), b"this is not a deflate stream" * 3)


def test_damaged_chunk_lazy_read_names_the_rows(tmp_path: Path, no_daemon_env: Path) -> None:
    path = tmp_path / "damaged.h5"
    _corrupt_chunk(path)
    ds = open_ds("lazy", None, path, "x", rank=0, world_size=1)  # metadata is fine: the rows are not
    try:
        assert ds[0].tolist() == [1.0] * 4  # chunks before the damage still read
        with pytest.raises(DataError, match=r"cannot read rows .* of dataset 'x'.*damaged"):
            ds.__getitems__(list(range(len(ds))))
    finally:
        ds.close()


def test_damaged_chunk_daemon_load_names_the_rows(tmp_path: Path, shared_daemon: Daemon) -> None:
    path = tmp_path / "damaged.h5"
    _corrupt_chunk(path)
    with pytest.raises(DataError, match=r"cannot read rows .* of dataset 'x'.*damaged"):
        open_ds("shm", shared_daemon, path, "x", rank=0, world_size=1)


def test_daemon_still_serves_after_refusals(shared_daemon: Daemon, served_file: Path, tmp_path: Path) -> None:
    """The refusals (these, and those above on the same module daemon) leave the daemon
    answering and loading."""
    for key in ("scalar", "compound", "vlen_refs", "dangling_external", "chained_external", "external_raw"):
        build, error, match = REFUSED[key]
        path = tmp_path / f"{key}.h5"
        with h5py.File(path, "w") as f:
            build(f, key)
        for _ in range(2):  # the second time from the daemon's memory of the failure, or again
            with pytest.raises(error, match=match):
                open_ds("shm", shared_daemon, path, key, rank=0, world_size=1)
    assert shared_daemon.status()["running"] is True
    ds = open_ds("shm", shared_daemon, served_file, "gzip", mode="interleave", rank=1, world_size=5)
    try:
        assert_serves(ds, served_file, "gzip", N)
    finally:
        ds.close()
    assert shared_daemon.alive()
