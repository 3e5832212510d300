"""Many HDF5 files as one dataset (a glob or a list), and HDF5 virtual datasets over other files:
the same bytes as h5py in every mode, backend and worker start method; every file's identity
in the segment key; every mismatch a clear error; every file checked like one file is."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import h5py
import msgpack
import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader

import h5serve.client.backends.files  # noqa: F401 - imported before tests drop privileges (as_user)
from h5serve.client import SharedH5Dataset, collate
from h5serve.daemon.loading.loader import MIN_PART_ENV
from h5serve.errors import (
    AccessDenied,
    ConfigError,
    DataError,
    KeyNotFound,
    LengthMismatch,
    ProtocolError,
    SourceNotFound,
)
from h5serve.hdf5.files import MAX_FILES, expand_paths
from h5serve.segments import HEADER_SIZE, SegmentMeta, attach_segment, create_segment, read_meta
from h5serve.wire.connection import DaemonClient
from h5serve.wire.protocol import MAX_FRAME_BYTES, Acquire, decode_request, encode_request

from ..helpers import ROW_SHAPE, Daemon, make_h5, short_tmpdir, wait_for
from ..users import as_user, root_only, throwaway_group, throwaway_user

SIZES = (37, 0, 64, 21, 50)  # an empty file too; 172 rows
MODES = ("contiguous", "interleave", "global", "node")
WORLD = 3
NOWHERE = "/nonexistent/h5serve-no-daemon"  # a runtime dir where no daemon can run


def write_set(directory: Path, sizes=SIZES, dtype="uint8", name="run_{}.h5", start=0, y_rows=None) -> list[Path]:
    """Files whose x rows are distinct across the set and whose y is the global row id."""
    directory.mkdir(parents=True, exist_ok=True)
    paths, base = [], start
    for i, n in enumerate(sizes):
        x = ((np.arange(n * 48).reshape(n, *ROW_SHAPE) + base * 48) % 251).astype(dtype)
        path = directory / name.format(i)
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=x, chunks=(min(16, n), *ROW_SHAPE) if n else None)
            f["y"] = np.arange(base, base + (n if y_rows is None else y_rows[i]), dtype=np.int64)
        paths.append(path)
        base += n
    return paths


def concat(paths, key: str = "x") -> np.ndarray:
    parts = []
    for p in paths:
        with h5py.File(p, "r") as f:
            parts.append(f[key][...])
    return np.concatenate(parts)


def node_kwargs(mode: str, rank: int) -> dict:
    return dict(local_rank=0, local_world_size=1, node_rank=rank, num_nodes=WORLD) if mode == "node" else {}


def open_ds(backend: str, daemon: Daemon | None, path, *keys: str, **kwargs) -> SharedH5Dataset:
    if backend == "shm":
        ds = SharedH5Dataset(path, *keys, runtime_dir=daemon.runtime_dir, fallback="error", **kwargs)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "reading lazily": expected
            ds = SharedH5Dataset(path, *keys, runtime_dir=NOWHERE, fallback="lazy", **kwargs)
    assert ds.backend == backend
    return ds


@pytest.fixture(scope="module")
def data_set(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_set(tmp_path_factory.mktemp("many") / "data")


@pytest.fixture(params=["shm", "lazy"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def daemon_for(backend: str, request: pytest.FixtureRequest) -> Daemon | None:
    return request.getfixturevalue("shared_daemon") if backend == "shm" else None


# --------------------------------------------------------------------------- bytes


@pytest.mark.parametrize("mode", MODES)
def test_bytes_equal_h5py_every_mode(data_set: list[Path], backend: str, request: pytest.FixtureRequest,
                                     mode: str) -> None:
    daemon = daemon_for(backend, request)
    pattern = str(data_set[0].parent / "run_*.h5")
    want_x, want_y = concat(data_set), concat(data_set, "y")
    seen = []
    for rank in range(WORLD):
        ds = open_ds(backend, daemon, pattern, "x", "y", mode=mode, rank=rank, world_size=WORLD,
                     **node_kwargs(mode, rank))
        try:
            assert ds.total_rows == sum(SIZES) and ds.files == tuple(str(p) for p in data_set)
            order = np.arange(len(ds))[::-1].copy()  # a whole shard, reversed, through one gather
            x, y = collate(ds.__getitems__(order))
            assert x.numpy().tobytes() == want_x[ds.indices[order]].tobytes()
            assert y.tolist() == want_y[ds.indices[order]].tolist() == ds.indices[order].tolist()
            xi, yi = ds[len(ds) - 1]
            assert xi.numpy().tobytes() == want_x[ds.indices[-1]].tobytes() and int(yi) == ds.indices[-1]
            seen.extend(ds.indices.tolist())
        finally:
            ds.close()
    if mode in ("contiguous", "interleave", "node"):
        assert sorted(seen) == list(range(sum(SIZES)))


def test_lazy_uncached_and_cast_equal_h5py(data_set: list[Path]) -> None:
    want = concat(data_set).astype(np.float32)
    ds = open_ds("lazy", None, data_set, "x", mode="interleave", rank=1, world_size=2, dtype_x="float32", cache_bytes=0)
    try:
        batch = [5, 0, 5, 70, len(ds) - 1]
        assert collate(ds.__getitems__(batch)).numpy().tobytes() == want[ds.indices[batch]].tobytes()
    finally:
        ds.close()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers(data_set: list[Path], shared_daemon: Daemon, context: str) -> None:
    """One worker reads both backends' datasets (a spawned worker unpickles both: one start-up)."""
    paths = [str(p) for p in data_set]
    both = [open_ds(backend, shared_daemon, paths, "x", "y", rank=1, world_size=2) for backend in ("shm", "lazy")]
    try:
        loader = DataLoader(ConcatDataset(both), batch_size=16, shuffle=False, num_workers=1,
                            multiprocessing_context=context, timeout=120)
        xs, ys = zip(*loader)
        indices = np.concatenate([both[0].indices, both[1].indices])
        assert torch.cat(xs).numpy().tobytes() == concat(data_set)[indices].tobytes()
        assert torch.cat(ys).tolist() == indices.tolist()
    finally:
        for ds in both:
            ds.close()


def test_list_order_is_row_order(data_set: list[Path], backend: str, request: pytest.FixtureRequest) -> None:
    daemon = daemon_for(backend, request)
    order = [data_set[3], data_set[0], data_set[2]]
    ds = open_ds(backend, daemon, order, "x", mode="global")
    try:
        assert collate(ds.__getitems__(list(range(len(ds))))).numpy().tobytes() == concat(order).tobytes()
    finally:
        ds.close()


def test_dtypes_that_cast_safely_to_the_requested_one(tmp_path: Path, backend: str,
                                                      request: pytest.FixtureRequest) -> None:
    daemon = daemon_for(backend, request)
    paths = write_set(tmp_path, (10, 12), name="a{}.h5") + write_set(tmp_path, (9,), dtype="int16", name="b{}.h5")
    want = concat(paths).astype(np.float32)
    ds = open_ds(backend, daemon, paths, "x", mode="global", dtype_x="float32")
    try:
        assert collate(ds.__getitems__(list(range(len(ds))))).numpy().tobytes() == want.tobytes()
    finally:
        ds.close()


# --------------------------------------------------------------------------- what is shown


def test_glob_is_expanded_sorted_and_shown(tmp_path: Path, shared_daemon: Daemon) -> None:
    paths = write_set(tmp_path / "d", (5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), name="run_{:02d}.h5")
    ds = open_ds("shm", shared_daemon, tmp_path / "d" / "run_*.h5", "x", mode="global")
    try:
        assert ds.files == tuple(sorted(str(p) for p in paths))
        assert repr(ds).startswith(f"SharedH5Dataset({str(tmp_path / 'd' / 'run_*.h5')!r} (11 files: {paths[0]} ... "
                                   f"{paths[-1]}), x_key='x'")
        mine = [s for s in shared_daemon.status()["segments"] if s["file"] == str(paths[0])]
        assert len(mine) == 1 and mine[0]["files"] == [str(p) for p in paths] and mine[0]["rows"] == 110
        env = {**os.environ, "H5SERVE_RUNTIME_DIR": str(shared_daemon.runtime_dir)}
        text = subprocess.run([sys.executable, "-m", "h5serve", "status"], env=env, capture_output=True, text=True,
                              timeout=60).stdout
        assert f"{paths[0]} .. run_10.h5 (11 files)" in text
    finally:
        ds.close()


def test_one_file_stays_one_file(tmp_path: Path) -> None:
    path = make_h5(tmp_path / "only[1].h5", rows=10)  # glob characters in a real name: taken literally
    assert expand_paths(str(path)).paths == (str(path),)
    assert expand_paths(str(tmp_path / "only*.h5")).paths == (str(path),)
    ds = open_ds("lazy", None, str(tmp_path / "only*.h5"), "x")
    try:
        assert ds.spec.path == str(path) and ds.spec.files == ()
        assert repr(ds).startswith(f"SharedH5Dataset({str(path)!r}")
    finally:
        ds.close()


def test_one_file_request_is_the_message_it_always_was() -> None:
    frame = encode_request(7, Acquire("/d/a.h5", "x", 2, 1))
    assert "files" not in msgpack.unpackb(frame)
    assert decode_request(frame) == (7, Acquire("/d/a.h5", "x", 2, 1))


def test_many_files_request_limits() -> None:
    paths = tuple(f"/data/{'long-directory-name/' * 8}run_{i:05d}.h5" for i in range(4000))
    frame = encode_request(3, Acquire(paths[0], "x", 1, 0, files=paths))
    assert len(frame) > MAX_FRAME_BYTES
    assert decode_request(frame)[1].files == paths  # a list this long is still one request
    with pytest.raises(ProtocolError, match="must start with 'path'"):
        Acquire("/other.h5", "x", 1, 0, files=paths[:2])
    with pytest.raises(ProtocolError, match=f"2 to {MAX_FILES} paths"):
        Acquire(paths[0], "x", 1, 0, files=paths * 2)
    padded = msgpack.packb({"v": 1, "id": 4, "op": "ping", "pad": "x" * (MAX_FRAME_BYTES + 10)})
    with pytest.raises(ProtocolError, match=f"at most {MAX_FRAME_BYTES} bytes"):
        decode_request(padded)  # only an acquire naming many files may be that large


def test_the_daemon_never_expands_a_pattern(data_set: list[Path], shared_daemon: Daemon) -> None:
    pattern = str(data_set[0].parent / "run_*.h5")
    with DaemonClient(shared_daemon.runtime_dir) as client:
        with pytest.raises(SourceNotFound, match=r"run_\*\.h5.*cannot be read"):
            client.acquire(Acquire(pattern, "x", 1, 0))


def test_multi_file_header_holds_a_long_file_list(tmp_path: Path) -> None:
    files = tuple((f"/data/{'d' * 60}/run_{i:04d}.h5", 1, i, 100, 5, 1) for i in range(300))
    meta = SegmentMeta(*files[0][:5], key="x", mode="global", world_size=1, rank=0, total_rows=300, rows=300,
                       row_shape=(2,), dtype="<f4", source_dtype="<f4", files=files)
    assert meta.header_size > HEADER_SIZE and meta.header_size % HEADER_SIZE == 0
    writer = create_segment(tmp_path, "seg.tmp-1-aaaaaa", meta)
    os.pwrite(writer.data_target()[0], np.arange(600, dtype="<f4").tobytes(), meta.header_size)
    writer.publish("seg")
    assert read_meta(tmp_path / "seg") == (meta, True)
    segment = attach_segment(tmp_path, "seg")
    try:
        assert segment.meta.file_rows == (1,) * 300
        assert segment.data.tobytes() == np.arange(600, dtype="<f4").tobytes()
    finally:
        segment.close()


# --------------------------------------------------------------------------- errors


def _mismatch(tmp_path: Path, kind: str) -> tuple[list[Path], dict, type, str]:
    paths = write_set(tmp_path, (10, 12, 9))
    bad = paths[2]
    if kind == "key":
        with h5py.File(bad, "a") as f:
            del f["x"]
        return paths, {}, KeyNotFound, rf"key 'x' is not in {re.escape(str(bad))}"
    if kind == "shape":
        with h5py.File(bad, "a") as f:
            del f["x"]
            f["x"] = np.zeros((9, 3, 4, 5), "uint8")
        return paths, {}, DataError, (rf"{re.escape(str(bad))}: dataset 'x' has rows of shape \(3, 4, 5\), "
                                      rf"but {re.escape(str(paths[0]))} has \(3, 4, 4\)")
    if kind in ("dtype", "unsafe_dtype"):
        with h5py.File(bad, "a") as f:
            del f["x"]
            f["x"] = np.zeros((9, *ROW_SHAPE), "float64")
        if kind == "dtype":
            return paths, {}, DataError, (rf"{re.escape(str(bad))}: dataset 'x' has dtype float64, "
                                          rf"but {re.escape(str(paths[0]))} has uint8.*'float64'")
        return (paths, {"dtype_x": "float32"}, DataError,
                rf"float32 cannot hold every float64 value of {re.escape(str(bad))}")
    if kind == "lengths":  # equal totals, rows that would pair up across files
        paths = write_set(tmp_path, (10, 12), y_rows=(12, 10), name="len{}.h5")
        return paths, {}, LengthMismatch, rf"{re.escape(str(paths[0]))}: 'x' has 10 rows but 'y' has 12"
    if kind == "missing":
        bad.unlink()
        return paths, {}, SourceNotFound, re.escape(str(bad))
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["key", "shape", "dtype", "unsafe_dtype", "lengths", "missing"])
def test_files_that_disagree_are_refused_naming_the_file(tmp_path: Path, backend: str, request: pytest.FixtureRequest,
                                                        kind: str) -> None:
    daemon = daemon_for(backend, request)
    paths, kwargs, error, match = _mismatch(tmp_path, kind)
    with pytest.raises(error, match=match):
        open_ds(backend, daemon, paths, "x", "y", mode="interleave", rank=1, world_size=2, **kwargs)


def test_bad_path_arguments(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFound, match=r"pattern .*nothing_\*\.h5.* matches no file"):
        SharedH5Dataset(str(tmp_path / "nothing_*.h5"), "x")
    with pytest.raises(ConfigError, match="empty list"):
        SharedH5Dataset([], "x")
    with pytest.raises(ConfigError, match="named twice"):
        SharedH5Dataset([tmp_path / "a.h5", tmp_path / "b.h5", tmp_path / "a.h5"], "x")
    with pytest.raises(ConfigError, match=f"more than the {MAX_FILES} one dataset may have.*virtual dataset"):
        SharedH5Dataset([tmp_path / f"{i}.h5" for i in range(MAX_FILES + 1)], "x")
    with pytest.raises(ConfigError, match="entry of the path list"):
        SharedH5Dataset([tmp_path / "a.h5", 3], "x")


# --------------------------------------------------------------------------- never stale


def segments_of(daemon: Daemon, first: Path) -> list[dict]:
    return [s for s in daemon.status()["segments"] if s["file"] == str(first)]


def test_a_changed_file_is_never_served_stale(tmp_path: Path, shared_daemon: Daemon) -> None:
    """One file of a set rewritten in place, replaced by a rename, or removed: new rows (or an
    error naming the file), never the old segment; the old one is evicted once unheld."""
    sets = {change: write_set(tmp_path / change, (10, 12, 9)) for change in ("rewritten", "replaced", "removed")}
    old = {}
    for change, paths in sets.items():
        open_ds("shm", shared_daemon, paths, "x", mode="global").close()
        old[change] = [s["name"] for s in segments_of(shared_daemon, paths[0])]
        assert len(old[change]) == 1
    with h5py.File(sets["rewritten"][2], "a") as f:
        f["x"][0] = 200  # other values, same shape
    write_set(tmp_path / "new", (10, 12, 9), start=1000)[2].rename(sets["replaced"][2])
    sets["removed"][2].unlink()
    for change in ("rewritten", "replaced"):
        ds = open_ds("shm", shared_daemon, sets[change], "x", mode="global")
        try:
            assert collate(ds.__getitems__(list(range(len(ds))))).numpy().tobytes() == concat(sets[change]).tobytes()
            assert ds._backend.segments[0].name != old[change][0]
        finally:
            ds.close()
    with pytest.raises(SourceNotFound, match=re.escape(str(sets["removed"][2]))):
        open_ds("shm", shared_daemon, sets["removed"], "x", mode="global")
    stale = {name for names in old.values() for name in names}
    assert wait_for(lambda: not stale & {s["name"] for s in shared_daemon.status()["segments"]}, 15)


# --------------------------------------------------------------------------- virtual datasets


def write_vds(directory: Path, sources: list[Path], name: str = "vds.h5") -> Path:
    counts = []
    for src in sources:
        with h5py.File(src, "r") as f:
            counts.append(f["x"].shape[0])
    layout = h5py.VirtualLayout((sum(counts), *ROW_SHAPE), "uint8")
    at = 0
    for src, n in zip(sources, counts):
        if n:
            layout[at:at + n] = h5py.VirtualSource(os.path.relpath(src, directory), "x", shape=(n, *ROW_SHAPE))
        at += n
    path = directory / name
    with h5py.File(path, "w") as f:
        f.create_virtual_dataset("x", layout, fillvalue=7)
    return path


def test_virtual_dataset_bytes_equal_h5py_and_sources_tracked(tmp_path: Path, backend: str,
                                                               request: pytest.FixtureRequest) -> None:
    daemon = daemon_for(backend, request)
    sources = write_set(tmp_path / "src", SIZES[:3])
    vds = write_vds(tmp_path, sources)
    with h5py.File(vds, "r") as f:
        want = f["x"][...]
    ds = open_ds(backend, daemon, vds, "x", mode="interleave", rank=0, world_size=2)
    try:
        assert collate(ds.__getitems__(list(range(len(ds))))).numpy().tobytes() == want[ds.indices].tobytes()
    finally:
        ds.close()
    if backend == "lazy":
        return
    first = [s["name"] for s in daemon.status()["segments"] if s["file"] == str(vds)]
    with h5py.File(sources[2], "a") as f:  # a source changes: the VDS file itself does not
        f["x"][3] = 250
    with h5py.File(vds, "r") as f:
        want = f["x"][...]
    ds = open_ds(backend, daemon, vds, "x", mode="interleave", rank=0, world_size=2)
    try:
        assert collate(ds.__getitems__(list(range(len(ds))))).numpy().tobytes() == want[ds.indices].tobytes()
        assert ds._backend.segments[0].name not in first
    finally:
        ds.close()
    assert wait_for(lambda: not set(first) & {s["name"] for s in daemon.status()["segments"]}, 15)
    sources[0].unlink()  # h5py would read the fill value there: refused instead
    missing = rf"virtual dataset whose source file .*{sources[0].name}.* does not exist"
    with pytest.raises(SourceNotFound, match=missing):
        open_ds(backend, daemon, vds, "x")


# --------------------------------------------------------------------------- every file checked


def test_allow_root_parallel_load_and_adoption_of_many_files(tmp_path: Path) -> None:
    inside, outside = tmp_path / "inside", tmp_path / "outside"
    paths = write_set(inside, SIZES)
    stray = write_set(outside, (8,), name="stray{}.h5")[0]
    vds = write_vds(inside, [paths[0], stray], name="vds.h5")  # a VDS reaching outside
    d = Daemon("--allow-root", str(inside), "--load-processes", "2")
    d.env[MIN_PART_ENV] = "1"  # split even these small files across both processes
    try:
        d.start()
        ds = open_ds("shm", d, paths, "x", "y", mode="global")
        try:
            assert collate(ds.__getitems__(list(range(len(ds)))))[0].numpy().tobytes() == concat(paths).tobytes()
        finally:
            ds.close()
        assert {s["load_parts"] for s in d.status()["segments"]} == {2}
        # after a kill -9, the next daemon adopts the multi-file segments (their file list is in the header)
        before = d.segment_files()
        os.kill(d.pid, 9)
        assert wait_for(lambda: not d.alive(), 10)
        d.start()
        assert d.status()["counters"]["adopted"] == 2 and d.segment_files() == before
        ds = open_ds("shm", d, paths, "x", "y", mode="global")
        try:
            assert collate(ds.__getitems__(list(range(len(ds)))))[0].numpy().tobytes() == concat(paths).tobytes()
        finally:
            ds.close()
        assert d.status()["counters"]["loads"] == 0  # served from the adopted segments
        outside = rf"{re.escape(str(stray))} \(resolved to {re.escape(str(stray))}\) is outside"
        with pytest.raises(AccessDenied, match=outside):
            open_ds("shm", d, [*paths[:2], stray], "x")
        with pytest.raises(AccessDenied, match=rf"{re.escape(str(stray))} \(a source of .*vds\.h5\).* is outside"):
            open_ds("shm", d, vds, "x")
    finally:
        d.stop()


@root_only
def test_root_daemon_checks_every_file_as_the_user() -> None:
    public = short_tmpdir("h5s-pubmf-")
    try:
        public.chmod(0o755)
        paths = write_set(public / "d", (10, 12, 9))
        (public / "d").chmod(0o755)
        for p in paths:
            p.chmod(0o644)
        paths[1].chmod(0o600)  # one file of the set is root's only
        vds = write_vds(public / "d", paths[:2])
        vds.chmod(0o644)
        with throwaway_group() as group, throwaway_user((group,)) as member:
            d = Daemon("--group", group.name)
            d.dir.chmod(0o755)
            try:
                d.start()

                def ask(path) -> str:
                    return SharedH5Dataset(path, "x", runtime_dir=d.runtime_dir, fallback="error").backend

                status, out = as_user(member, lambda: ask(paths))
                assert status == "error" and out.startswith("AccessDenied"), out
                assert f"may not read {paths[1]}" in out
                # a virtual dataset's sources cannot be pinned: refused to members whatever they may read
                status, out = as_user(member, lambda: ask(vds))
                assert status == "error" and out.startswith("AccessDenied") and "virtual dataset" in out, out
                assert d.status()["segments"] == []
                paths[1].chmod(0o644)
                assert as_user(member, lambda: ask(paths)) == ("ok", "shm")
            finally:
                d.stop()
    finally:
        shutil.rmtree(public, ignore_errors=True)


# --------------------------------------------------------------------------- DDP


@pytest.mark.slow
def test_ddp_torchrun_over_a_five_file_glob(tmp_path: Path) -> None:
    """tests/jobs/ddp_job.py, 2 ranks over gloo, given a glob: shm, then lazy in the same order."""
    from .test_ddp import run_torchrun

    write_set(tmp_path / "d", (201, 0, 300, 99, 403))
    pattern = tmp_path / "d" / "run_*.h5"
    d = Daemon().start()
    try:
        shm = run_torchrun(pattern, tmp_path / "shm", d.runtime_dir, "contiguous", 2, "--workers", "1")
        assert len(d.segment_files()) == 4 and all(len(s["files"]) == 5 for s in d.status()["segments"])
    finally:
        d.stop()
    assert [r["backend"] for r in shm] == ["shm", "shm"], [r["warnings"] for r in shm]
    for epoch in range(2):
        assert sorted(shm[0]["epochs"][epoch] + shm[1]["epochs"][epoch]) == list(range(1003))
    lazy = run_torchrun(pattern, tmp_path / "lazy", short_tmpdir("h5s-none-"), "contiguous", 2, "--workers", "1")
    assert [r["backend"] for r in lazy] == ["lazy", "lazy"]
    assert [r["epochs"] for r in lazy] == [r["epochs"] for r in shm]
    json.dumps(shm)  # reports are plain data


def test_variable_length_rows_from_many_files_are_served(tmp_path: Path, backend: str,
                                                         request: pytest.FixtureRequest) -> None:
    """Variable-length rows of many files: each file's rows in turn, as h5py reads them; a
    file whose sequences hold another dtype is a DataError naming it."""
    paths = []
    for i, base in enumerate((np.float32, np.float32, np.int32)):
        path = tmp_path / f"v_{i}.h5"
        with h5py.File(path, "w") as f:
            d = f.create_dataset("tokens", (3,), dtype=h5py.vlen_dtype(base))
            for r in range(3):
                d[r] = np.arange(r + i, dtype=base) + 10 * i
        paths.append(path)
    ds = open_ds(backend, daemon_for(backend, request), paths[:2], "tokens", mode="global")
    try:
        got = collate(ds.__getitems__([5, 0, 3, 2]))
        want = [np.arange(r + i, dtype=np.float32) + 10 * i for i in range(2) for r in range(3)]
        assert [g.numpy().tobytes() for g in got] == [want[r].tobytes() for r in (5, 0, 3, 2)]
    finally:
        ds.close()
    with pytest.raises(DataError, match=rf"{re.escape(str(paths[2]))}: dataset 'tokens' holds variable-length rows "
                                        r"of int32, but .* has variable-length rows of float32"):
        open_ds(backend, daemon_for(backend, request), paths, "tokens")
