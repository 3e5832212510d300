"""Many files × several fields × variable-length rows: byte for byte what h5py reads from each
file in turn, in per-rank, node and global mode, from shared memory (a real daemon) and lazily
(no daemon), in DataLoader workers (fork and spawn); a list and a dict of keys, compound
``"ds:field"`` keys, fixed-length byte strings (``bytes``, or ``str`` with ``encoding=``),
variable-length rows (lists, ``ragged="pad"``) next to fixed ones; every disagreement between
the files a clear error naming the file."""

from __future__ import annotations

import os
import re
import signal
import warnings
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from h5serve.client import RankMemCachedH5Dataset, SharedH5Dataset, collate, make_loader
from h5serve.client.fields import DictBatch, TupleBatch
from h5serve.client.ragged import Padded, RaggedList
from h5serve.errors import DataError, KeyNotFound, LengthMismatch, UnsupportedDataset
from h5serve.order.sharding import GLOBAL, NODE

from ..helpers import WORLD_4, Daemon, h5serve_cli, open_ds, rank_args, wait_for

SIZES = (7, 0, 12, 3, 9)  # an empty file too: 31 rows
TOTAL = sum(SIZES)
WORLD = WORLD_4  # node mode: 2 nodes of 2 ranks
MODES = ("contiguous", NODE, GLOBAL)
NOWHERE = "/nonexistent/h5serve-no-daemon"
EVENT = np.dtype([("energy", ">f8"), ("pos", "<f4", (3,)), ("tag", "S6")])
NAMES = h5py.string_dtype("utf-8", 16)
TOKENS = h5py.vlen_dtype(np.float32)

FIELD_SETS: dict[str, dict[str, Any]] = {
    # a list of keys: tuples; a compound field; byte strings as bytes
    "list": {"keys": ["img", "events:energy", "names", "label"]},
    # a dict: several compound fields (one of byte strings), byte strings decoded, a requested dtype
    "dict": {"keys": {"image": "img", "mask": "mask", "pos": "events:pos", "tag": "events:tag", "name": "names",
                      "label": "label"},
             "encoding": "utf-8", "dtypes": {"image": "float32"}},
}


def write_files(directory: Path, sizes: tuple[int, ...] = SIZES, names: Any = NAMES, tokens: Any = TOKENS,
                prefix: str = "run") -> list[Path]:
    """One file per size; ``label`` is the global row id, every other key distinct per row."""
    directory.mkdir(parents=True, exist_ok=True)
    paths, base = [], 0
    for i, n in enumerate(sizes):
        rows = np.arange(base, base + n)
        rng = np.random.default_rng(100 + i)
        events = np.zeros(n, EVENT)
        events["energy"] = rows * 0.5 - 3
        events["pos"] = rng.normal(size=(n, 3))
        events["tag"] = [b"t%d" % r if r % 4 else b"" for r in rows]  # empty strings too
        path = directory / f"{prefix}_{i}.h5"
        with h5py.File(path, "w") as f:
            f.create_dataset("img", data=((rows[:, None, None] * 7 + np.arange(6).reshape(2, 3)) % 251)
                             .astype(np.uint8).reshape(n, 2, 3), chunks=(min(4, n), 2, 3) if n else None)
            f["mask"] = rng.random((n, 4)) > 0.5
            f["label"] = rows.astype(np.int64)
            f.create_dataset("events", data=events, chunks=(min(5, n),) if n else None)
            f.create_dataset("names", data=np.array([f"ñ{r}·x".encode() for r in rows], dtype=names), dtype=names)
            vl = f.create_dataset("tokens", (n,), dtype=tokens, chunks=(min(4, n),) if n else None)
            for k, r in enumerate(rows):
                vl[k] = (np.arange(r % 5) + r * 10).astype(h5py.check_vlen_dtype(tokens))  # empty rows too
            f.create_dataset("text", data=[f"ñ·{r}" * (r % 3) for r in rows], dtype=h5py.string_dtype())
        paths.append(path)
        base += n
    return paths


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_files(tmp_path_factory.mktemp("mff") / "d")


@pytest.fixture(params=["shm", "lazy"])
def where(request: pytest.FixtureRequest) -> dict[str, Any]:
    """How to open a dataset: from the module's daemon (no fallback), or lazily (no daemon)."""
    if request.param == "shm":
        daemon: Daemon = request.getfixturevalue("shared_daemon")
        return {"runtime_dir": daemon.runtime_dir, "fallback": "error"}
    return {"runtime_dir": NOWHERE, "fallback": "lazy"}


def h5_all(paths: list[Path], key: str, encoding: str | None = None) -> Any:
    """h5py's read of ``key`` from each file in turn, concatenated: an array, or a list of
    bytes / str (byte strings, variable-length strings), or a list of arrays (vlen rows)."""
    parts = []
    for p in paths:
        with h5py.File(p, "r") as f:
            name, _, field = key.partition(":")
            data = f[name].fields(field)[:] if field else f[name][:]
            vlen = h5py.check_vlen_dtype(f[name].dtype) if not field else None
            string = h5py.check_string_dtype(f[name].dtype) if not field else None
        if string is not None and string.length is None:
            parts.append([b.decode(string.encoding) for b in data])
        elif vlen is not None:
            parts.append(list(data))
        else:
            parts.append(data)
    if isinstance(parts[0], list):
        return sum(parts, [])
    joined = np.concatenate(parts)
    if joined.dtype.kind == "S":
        values = joined.tolist()
        return [v.decode(encoding) for v in values] if encoding else values
    return joined


def pick(want: Any, rows: np.ndarray) -> Any:
    return [want[r] for r in rows.tolist()] if isinstance(want, list) else want[rows]


def assert_same(got: Any, want: Any, dtype: Any = None) -> None:
    """Same type, dtype, shape and bytes as h5py's read (cast with numpy to ``dtype``)."""
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want)
        for g, w in zip(got, want):
            if isinstance(w, np.ndarray):  # a variable-length row
                assert isinstance(g, torch.Tensor) and g.dim() == 1
                w = w.astype(dtype or w.dtype.newbyteorder("="))
                assert g.numpy().dtype == w.dtype and g.numpy().tobytes() == w.tobytes()
            else:
                assert type(g) is type(w) and g == w
        return
    assert isinstance(got, torch.Tensor)
    w = want.astype(np.dtype(dtype) if dtype is not None else want.dtype.newbyteorder("="))
    assert got.numpy().dtype == w.dtype and got.shape == w.shape
    assert got.numpy().tobytes() == w.tobytes()


def field_items(spec: dict[str, Any]) -> list[tuple[str, str]]:
    keys = spec["keys"]
    return list(keys.items()) if isinstance(keys, dict) else [(k, k) for k in keys]


def check_batch(ds: SharedH5Dataset, spec: dict[str, Any], paths: list[Path], local: np.ndarray) -> None:
    """``ds``'s batch of ``local`` positions (one gather) and one sample, against h5py."""
    rows = ds.indices[local]
    raw = ds.__getitems__(torch.from_numpy(local))
    batch = collate(raw)
    items = field_items(spec)
    dtypes = spec.get("dtypes", {})
    if isinstance(spec["keys"], dict):
        assert isinstance(raw, DictBatch) and list(batch) == [n for n, _ in items]
        columns = [batch[n] for n, _ in items]
    else:
        assert isinstance(raw, TupleBatch) and type(batch) is tuple
        columns = list(batch)
    for (name, key), got in zip(items, columns):
        assert_same(got, pick(h5_all(paths, key, spec.get("encoding")), rows), dtypes.get(name))
    if len(ds):
        sample = ds[int(local[0])]
        values = [sample[n] for n, _ in items] if isinstance(sample, dict) else list(sample)
        for (name, key), got in zip(items, values):
            want = pick(h5_all(paths, key, spec.get("encoding")), rows[:1])
            assert_same([got] if isinstance(want, list) else got.unsqueeze(0), want, dtypes.get(name))


# ----- bytes equal h5py's: every mode, both backends, a list and a dict of fields -----------------


@pytest.mark.parametrize("fields", list(FIELD_SETS))
@pytest.mark.parametrize("mode", MODES)
def test_many_files_fields_equal_h5py(files: list[Path], where: dict, mode: str, fields: str) -> None:
    spec = FIELD_SETS[fields]
    pattern = str(files[0].parent / "run_*.h5")
    seen: list[int] = []
    for rank in (range(WORLD) if mode != GLOBAL else (0, WORLD - 1)):
        ds = open_ds(pattern, where, **spec, **rank_args(mode, rank))
        try:
            assert ds.files == tuple(map(str, files)) and ds.total_rows == TOTAL
            local = np.arange(len(ds))[::-1].copy()
            if len(ds):
                local = np.concatenate([local, local[:2]])  # repeats too
            check_batch(ds, spec, files, local)
            if mode != NODE or rank % 2 == 0:  # node mode: a node's ranks share the node's rows
                seen += ds.indices.tolist()
        finally:
            ds.close()
    if mode != GLOBAL:
        assert sorted(seen) == list(range(TOTAL))  # every row once across ranks
    else:
        assert seen == list(range(TOTAL)) * 2  # every rank: every row


def test_lazy_uncached_equals_cached(files: list[Path]) -> None:
    """Reading rows straight from HDF5 (over the cache budget) gives the same batches."""
    spec = FIELD_SETS["dict"]
    ds = open_ds(files, {"runtime_dir": NOWHERE, "fallback": "lazy"}, **spec, mode="contiguous", rank=1,
                 world_size=2, cache_bytes=0)
    try:
        check_batch(ds, spec, files, np.array([3, 0, 3, len(ds) - 1, 7]))
    finally:
        ds.close()


def test_compat_preload_of_many_files_with_field_keys(files: list[Path], shared_daemon: Daemon) -> None:
    """The predecessor's class preloads many files (no daemon) or maps them (daemon): a
    compound field as x, byte strings as y."""
    want_x = h5_all(files, "events:pos").astype(np.float32)
    want_y = h5_all(files, "names")
    for runtime_dir in (NOWHERE, shared_daemon.runtime_dir):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("H5SERVE_RUNTIME_DIR", str(runtime_dir))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                ds = RankMemCachedH5Dataset(str(files[0].parent / "run_*.h5"), "events:pos", "names",
                                            mode="interleave", log_fn=lambda _: None)
        try:
            assert ds.backend == ("memory" if runtime_dir == NOWHERE else "shm")
            x, y = collate(ds.__getitems__(list(range(len(ds)))))
            assert_same(x, want_x[ds.indices])
            assert y == pick(want_y, ds.indices)
        finally:
            ds.close()


def _double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_equal_h5py(files: list[Path], where: dict, context: str) -> None:
    """Worker processes (forked, or spawned: the dataset pickled) serve the same bytes through
    collate, and with a transform through default_collate."""
    spec = FIELD_SETS["dict"]
    keys = spec["keys"]
    plain = open_ds(files, where, **spec, mode="contiguous", rank=1, world_size=2)
    with_tf = open_ds(files, where, keys={"pos": "events:pos", "name": "names", "image": "img"},
                      transforms={"image": _double}, mode="global")
    try:
        batches = list(DataLoader(plain, batch_size=5, num_workers=2, multiprocessing_context=context,
                                  collate_fn=collate, timeout=120))
        rows = plain.indices
        for name, key in keys.items():
            parts = [b[name] for b in batches]
            got = sum(parts, []) if isinstance(parts[0], list) else torch.cat(parts)
            assert_same(got, pick(h5_all(files, key, "utf-8"), rows), spec["dtypes"].get(name))
        batches = list(DataLoader(with_tf, batch_size=8, num_workers=1, multiprocessing_context=context,
                                  timeout=120))
        assert_same(torch.cat([b["image"] for b in batches]), h5_all(files, "img") * 2)
        assert_same(torch.cat([b["pos"] for b in batches]), h5_all(files, "events:pos"))
        assert sum((b["name"] for b in batches), []) == h5_all(files, "names")
    finally:
        plain.close()
        with_tf.close()


# ----- variable-length rows from many files ---------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_vlen_from_many_files_equal_h5py(files: list[Path], where: dict, mode: str) -> None:
    """Each file's rows one after the other, as lists and padded, next to fixed keys."""
    want_tokens, want_text = h5_all(files, "tokens"), h5_all(files, "text")
    want_label, want_energy = h5_all(files, "label"), h5_all(files, "events:energy")
    seen: list[int] = []
    for rank in (range(WORLD) if mode != GLOBAL else (1,)):
        ds = open_ds(files, where, keys={"tokens": "tokens", "text": "text", "label": "label",
                                         "energy": "events:energy"}, **rank_args(mode, rank))
        pad = open_ds(files, where, keys=["tokens", "img"], ragged="pad", pad_value=-1.5, **rank_args(mode, rank))
        try:
            assert ds.total_rows == pad.total_rows == TOTAL
            local = np.random.default_rng(rank).permutation(len(ds))
            local = np.concatenate([local, local[:3]])
            rows = ds.indices[local]
            batch = collate(ds.__getitems__(local))
            assert isinstance(batch["tokens"], RaggedList) and isinstance(batch["text"], list)
            assert_same(batch["tokens"], pick(want_tokens, rows))
            assert batch["text"] == pick(want_text, rows)
            assert_same(batch["label"], want_label[rows])
            assert_same(batch["energy"], want_energy[rows])
            tokens, img = collate(pad.__getitems__(local))
            assert isinstance(tokens, Padded)
            assert tokens.lengths.tolist() == [len(want_tokens[r]) for r in rows]
            assert_same([tokens.values[i, :n] for i, n in enumerate(tokens.lengths.tolist())], pick(want_tokens, rows))
            for i, n in enumerate(tokens.lengths.tolist()):
                assert (tokens.values[i, n:] == -1.5).all()
            assert_same(img, h5_all(files, "img")[rows])
            if len(ds):
                sample = ds[int(local[0])]
                assert_same([sample["tokens"]], pick(want_tokens, rows[:1]))
                assert sample["text"] == want_text[rows[0]] and int(sample["label"]) == rows[0]
            if mode != NODE or rank % 2 == 0:
                seen += ds.indices.tolist()
        finally:
            ds.close()
            pad.close()
    if mode != GLOBAL:
        assert sorted(seen) == list(range(TOTAL))


def test_vlen_from_many_files_cast_and_lazy_uncached(files: list[Path]) -> None:
    want = h5_all(files, "tokens")
    ds = open_ds(files, {"runtime_dir": NOWHERE, "fallback": "lazy"}, keys=["tokens", "label"],
                 dtypes={"tokens": "float64"}, mode="interleave", rank=1, world_size=3, cache_bytes=0)
    try:
        local = np.array([4, 0, 4, len(ds) - 1, 2])
        tokens, label = collate(ds.__getitems__(local))
        assert_same(tokens, pick(want, ds.indices[local]), "float64")
        assert label.tolist() == ds.indices[local].tolist()
    finally:
        ds.close()


def test_vlen_segments_hold_every_files_values(files: list[Path], shared_daemon: Daemon) -> None:
    """One values segment and one offsets segment (Arrow's layout, n + 1 offsets) per key for
    the whole set, values in file order."""
    ds = open_ds(files, {"runtime_dir": shared_daemon.runtime_dir, "fallback": "error"}, x_key="tokens",
                 mode="global")
    try:
        segment = ds._backend.segments[0]
        want = h5_all(files, "tokens")
        offsets = np.asarray(segment.data)
        assert offsets.shape == (TOTAL + 1,) and offsets[0] == 0
        assert np.diff(offsets).tolist() == [len(w) for w in want]
        assert np.asarray(segment.values).tobytes() == np.concatenate(want).astype(np.float32).tobytes()
        assert segment.meta.file_rows == SIZES and segment.meta.vlen == "seq"
        status = [s for s in shared_daemon.status()["segments"] if s["name"] == segment.name]
        assert status and len(status[0]["files"]) == len(SIZES) and status[0]["dtype"] == "vlen float32"
    finally:
        ds.close()


def test_vlen_field_of_compound_datasets_from_many_files(tmp_path: Path, where: dict) -> None:
    """``"events:hits"``, a variable-length field of a compound dataset in every file."""
    paths = []
    for i, n in enumerate((3, 0, 4)):
        paths.append(tmp_path / f"c_{i}.h5")
        with h5py.File(paths[-1], "w") as f:
            ev = f.create_dataset("events", (n,), dtype=[("e", "<f8"), ("hits", h5py.vlen_dtype(np.int32))])
            for r in range(n):
                ev[r] = (r + 10 * i, np.arange(r, dtype=np.int32) + 100 * i)
    want_hits, want_e = h5_all(paths, "events:hits"), h5_all(paths, "events:e")
    ds = open_ds(paths, where, keys=["events:hits", "events:e"], mode="global")
    try:
        local = np.array([6, 0, 3, 2, 5])
        hits, e = collate(ds.__getitems__(local))
        assert_same(hits, pick(list(want_hits), local))
        assert_same(e, want_e[local])
    finally:
        ds.close()


@pytest.mark.slow
def test_vlen_sets_verified_adopted_and_never_stale(tmp_path: Path, daemon: Daemon) -> None:
    """Multi-file vlen segments: ``status --verify`` checks them, a killed daemon's successor
    adopts them (no load), and a file of the set replaced means new rows, never the old ones."""
    paths = write_files(tmp_path / "d", (5, 0, 6))
    kwargs = {"keys": ["tokens", "text", "label"], "mode": "contiguous", "rank": 1, "world_size": 2,
              "runtime_dir": daemon.runtime_dir, "fallback": "error"}

    def check(ds: SharedH5Dataset) -> None:
        tokens, text, label = collate(ds.__getitems__(list(range(len(ds)))))
        assert_same(tokens, pick(h5_all(paths, "tokens"), ds.indices))
        assert text == pick(h5_all(paths, "text"), ds.indices) and label.tolist() == ds.indices.tolist()

    ds = SharedH5Dataset(paths, **kwargs)
    try:
        check(ds)
    finally:
        ds.close()
    verify = h5serve_cli("status", "--verify", env=daemon.env)
    assert verify.returncode == 0 and "verified 3 segments" in verify.stdout, verify.stdout + verify.stderr
    before = daemon.segment_files()
    os.kill(daemon.pid, signal.SIGKILL)
    assert wait_for(lambda: not daemon.alive(), 10)
    daemon.start()
    assert daemon.status()["counters"]["adopted"] == 3 and daemon.segment_files() == before
    ds = SharedH5Dataset(paths, **kwargs)
    try:
        check(ds)
        assert daemon.status()["counters"]["loads"] == 0
    finally:
        ds.close()
    new = write_files(tmp_path / "new", (5, 0, 6), tokens=h5py.vlen_dtype(np.float32))[2]
    with h5py.File(new, "a") as f:
        f["tokens"][1] = np.full(9, 7.5, np.float32)  # row 6: other values, same dtype and rows
    os.replace(new, paths[2])
    ds = SharedH5Dataset(paths, **kwargs)
    try:
        check(ds)
        assert ds[ds.indices.tolist().index(6)][0].tolist() == [7.5] * 9
    finally:
        ds.close()


@pytest.mark.slow
@pytest.mark.parametrize("backend,ragged,context", [("shm", "list", "spawn"), ("shm", "pad", "fork"),
                                                    ("lazy", "list", "fork"), ("lazy", "pad", "spawn")])
def test_vlen_dataloader_workers(files: list[Path], request: pytest.FixtureRequest, backend: str, ragged: str,
                                 context: str) -> None:
    if backend == "shm":
        where = {"runtime_dir": request.getfixturevalue("shared_daemon").runtime_dir, "fallback": "error"}
    else:
        where = {"runtime_dir": NOWHERE, "fallback": "lazy"}
    want, text = h5_all(files, "tokens"), h5_all(files, "text")
    ds = open_ds(files, where, keys=["tokens", "text", "label"], mode="contiguous", rank=0, world_size=2,
                 ragged=ragged)
    try:
        loader = make_loader(ds, 4, num_workers=2, multiprocessing_context=context, seed=5)
        seen = []
        for tokens, strings, label in loader:
            rows = label.numpy()
            got = [tokens.values[i, :n] for i, n in enumerate(tokens.lengths.tolist())] if ragged == "pad" else tokens
            assert_same(list(got), pick(want, rows))
            assert strings == pick(text, rows)
            seen += rows.tolist()
        assert set(seen) == set(ds.indices.tolist())
        del loader
    finally:
        ds.close()


# ----- every disagreement a clear error ------------------------------------------------------


def _rewrite(path: Path, key: str, data: Any, dtype: Any = None) -> None:
    with h5py.File(path, "a") as f:
        del f[key]
        f.create_dataset(key, data=data, dtype=dtype)


def _mismatch(tmp_path: Path, kind: str) -> tuple[list[Path], dict, type, str]:
    paths = write_files(tmp_path, (5, 6, 4))
    bad, first = paths[2], paths[0]
    b, a = re.escape(str(bad)), re.escape(str(first))
    if kind == "names_length":  # S16 in one file, S8 in another
        _rewrite(bad, "names", np.array([b"n%d" % i for i in range(4)], dtype="S8"))
        return paths, {"keys": ["names", "label"]}, DataError, \
            rf"{b}: dataset 'names' holds byte strings of 8 bytes, but {a} has 16.*same length"
    if kind == "vlen_base":
        with h5py.File(bad, "a") as f:
            del f["tokens"]
            d = f.create_dataset("tokens", (4,), dtype=h5py.vlen_dtype(np.int32))
            for i in range(4):
                d[i] = np.arange(i, dtype=np.int32)
        return paths, {"keys": ["tokens", "label"]}, DataError, \
            rf"{b}: dataset 'tokens' holds variable-length rows of int32, but {a} has variable-length rows of float32"
    if kind == "vlen_vs_fixed":
        _rewrite(bad, "tokens", np.zeros(4, np.float32))
        return paths, {"keys": ["tokens", "label"]}, DataError, \
            rf"{b}: dataset 'tokens' holds rows of shape \(\) \(float32\), but {a} has variable-length rows of float32"
    if kind == "field_missing":
        with h5py.File(bad, "a") as f:
            del f["events"]
            f["events"] = np.zeros(4, [("energy", "<f8")])
        return paths, {"keys": ["events:pos", "label"]}, KeyNotFound, rf"{b} has no field 'pos'"
    if kind == "field_shape":
        with h5py.File(bad, "a") as f:
            del f["events"]
            f["events"] = np.zeros(4, [("pos", "<f4", (2,))])
        return paths, {"keys": ["events:pos", "label"]}, DataError, \
            rf"{b}: dataset 'events:pos' has rows of shape \(2,\), but {a} has \(3,\)"
    if kind == "key_lengths":  # one key shorter in every file: each key's length named
        for p in paths:
            with h5py.File(p, "r") as f:
                n = len(f["label"])
            _rewrite(p, "mask", np.zeros((n + 1, 4), bool))
        return paths, {"keys": ["mask", "label"]}, LengthMismatch, r"'mask' has 18 rows, 'label' has 15 rows"
    if kind == "bytes_dtype":  # no dtype for byte strings, many files or one
        return paths, {"keys": ["names", "label"], "dtypes": {"names": "float32"}}, UnsupportedDataset, \
            r"'names' holds fixed-length byte strings \(\|S16\), which cannot be cast to float32"
    if kind == "text_dtype":
        return paths, {"keys": ["text", "label"], "dtypes": {"text": "int64"}}, UnsupportedDataset, \
            r"'text' holds variable-length strings \(utf-8\), which cannot be cast to int64"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["names_length", "vlen_base", "vlen_vs_fixed", "field_missing", "field_shape",
                                  "key_lengths", "bytes_dtype", "text_dtype"])
def test_files_that_disagree_are_refused(tmp_path: Path, where: dict, kind: str) -> None:
    paths, kwargs, error, match = _mismatch(tmp_path, kind)
    with pytest.raises(error, match=match):
        open_ds(paths, where, mode="interleave", rank=1, world_size=2, **kwargs)


def test_vlen_base_dtypes_that_cast_safely_to_the_requested_one(tmp_path: Path, where: dict) -> None:
    """Files of int16 and float32 sequences, asked for as float64: served, each cast."""
    paths = write_files(tmp_path / "a", (4, 5), prefix="a")
    paths += write_files(tmp_path / "b", (3,), tokens=h5py.vlen_dtype(np.int16), prefix="b")
    want = h5_all(paths, "tokens")
    ds = open_ds(paths, where, x_key="tokens", dtype_x="float64", mode="global")
    try:
        assert_same(collate(ds.__getitems__(list(range(len(ds))))), want, "float64")
    finally:
        ds.close()


def test_compat_preload_refuses_vlen_from_many_files(files: list[Path]) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("H5SERVE_RUNTIME_DIR", NOWHERE)
        with pytest.raises(UnsupportedDataset, match="variable-length.*SharedH5Dataset serves"):
            RankMemCachedH5Dataset([str(p) for p in files], "tokens", log_fn=lambda _: None)


# ----- DDP: torchrun, 2 ranks over gloo, a 5-file glob, 3 fields ------------------------------


@pytest.mark.slow
def test_ddp_torchrun_five_file_glob_three_fields(tmp_path: Path) -> None:
    """tests/jobs/ddp_job.py --keys, global mode through make_loader: every rank's rows byte-equal to
    h5py's, the ranks together cover every row once per epoch; then lazily, the same order."""
    from .test_ddp import run_torchrun

    paths = write_files(tmp_path / "d", (201, 0, 300, 99, 404))  # 1004 rows: two ranks split them evenly
    total = 1004
    pattern = tmp_path / "d" / "run_*.h5"
    keys = {"image": "img", "mask": "mask", "label": "label"}
    extra = ("--keys", ",".join(f"{n}={k}" for n, k in keys.items()), "--feature", "image", "--workers", "1")
    want = {name: h5_all(paths, key) for name, key in keys.items()}
    d = Daemon().start()
    try:
        shm = run_torchrun(pattern, tmp_path / "shm", d.runtime_dir, "global", 2, *extra)
        segments = d.status()["segments"]
        assert len(segments) == 3 and all(len(s["files"]) == 5 for s in segments)  # one per key, shared
    finally:
        d.stop()
    assert [r["backend"] for r in shm] == ["shm", "shm"], [r["warnings"] for r in shm]
    assert all(r["files"] == [str(p) for p in paths] for r in shm)
    for epoch in range(2):
        assert sorted(shm[0]["epochs"][epoch] + shm[1]["epochs"][epoch]) == list(range(total))
        for rank in range(2):
            got = np.load(tmp_path / "shm" / f"rank{rank}_epoch{epoch}.npz")
            rows = got["label"]
            assert rows.tolist() == shm[rank]["epochs"][epoch]
            for name in keys:
                assert got[name].dtype == want[name].dtype and got[name].tobytes() == want[name][rows].tobytes()
    assert shm[0]["epochs"][0] != shm[0]["epochs"][1]  # reshuffled per epoch
    lazy = run_torchrun(pattern, tmp_path / "lazy", Path(NOWHERE), "global", 2, *extra)
    assert [r["backend"] for r in lazy] == ["lazy", "lazy"]
    assert [r["epochs"] for r in lazy] == [r["epochs"] for r in shm]
