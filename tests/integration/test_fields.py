"""Several fields per sample: ``keys=[...]`` (tuples) and ``keys={name: key}`` (dicts), compound
fields (``"events:energy"``), fixed-length byte strings; byte for byte what h5py reads, in every
mode, from shared memory and lazily, in DataLoader workers (fork and spawn); every mismatch a
clear error."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_collate

from h5serve.client import H5LazyDataset, RankMemCachedH5Dataset, SharedH5Dataset, collate
from h5serve.client.fields import DictBatch, TupleBatch
from h5serve.errors import ConfigError, DataError, KeyNotFound, LengthMismatch, UnsupportedDataset
from h5serve.order.sharding import GLOBAL, NODE

from ..helpers import WORLD_4, Daemon, open_ds, rank_args

ROWS = 29  # odd: uneven shards
WORLD = WORLD_4  # node mode: 2 nodes of 2 ranks
MODES = ("contiguous", "interleave", NODE, GLOBAL)
EVENT = np.dtype([("energy", ">f8"), ("pos", "<f4", (3,)), ("flag", "i1"), ("tag", "S6")])
# name -> key: every kind of field at once
ALL = {"img": "img", "mask": "mask", "label": "label", "cls": "meta/cls", "energy": "events:energy",
       "pos": "events:pos", "tag": "events:tag", "name": "names", "colon": "a:b"}
TEXT = {"tag", "name"}  # byte strings


def _file(path: Path) -> Path:
    rng = np.random.default_rng(7)
    events = np.zeros(ROWS, EVENT)
    events["energy"] = rng.normal(size=ROWS)
    events["pos"] = rng.normal(size=(ROWS, 3))
    events["flag"] = np.arange(ROWS) % 3 - 1
    events["tag"] = [b"t%d" % i if i % 5 else b"" for i in range(ROWS)]  # empty and short strings
    with h5py.File(path, "w") as f:
        f.create_dataset("img", data=rng.integers(0, 255, (ROWS, 3, 4), dtype=np.uint8), chunks=(5, 3, 4))
        f["mask"] = rng.random((ROWS, 4)) > 0.5
        f["label"] = np.arange(ROWS, dtype=np.int64) * 7
        f.create_dataset("meta/cls", data=(np.arange(ROWS) % 10).astype(">i2"))
        f.create_dataset("events", data=events, chunks=(6,))
        names = np.array([f"ñ{i}·x".encode() for i in range(ROWS)], dtype=h5py.string_dtype("utf-8", 16))
        f.create_dataset("names", data=names)
        f["a:b"] = np.arange(ROWS, dtype=np.int32) - 5  # literally named with ':'
        f["short"] = np.arange(ROWS - 1)
        f["bad_utf8"] = np.array([b"\xff\xfe"] * ROWS)
        nested = np.dtype([("inner", [("a", "i4")]), ("n", "i4")])
        f["nested"] = np.zeros(ROWS, nested)
    return path


@pytest.fixture(scope="module")
def fields_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _file(tmp_path_factory.mktemp("fields") / "fields.h5")


def h5_column(path: Path, key: str, rows: np.ndarray, dtype: Any = None, encoding: str | None = None) -> Any:
    """h5py's own read of ``key`` (a field with ``dataset:field``) at ``rows``."""
    with h5py.File(path, "r") as f:
        if key.startswith("events:"):
            data = f["events"].fields(key.split(":", 1)[1])[:]
        else:
            data = f[key][:]
    data = data[rows]
    if data.dtype.kind == "S":
        values = data.tolist()
        return [v.decode(encoding) for v in values] if encoding else values
    return data.astype(dtype) if dtype is not None else data


def assert_same(got: Any, want: Any) -> None:
    """Same dtype, shape and bytes as h5py's read (or the same list of bytes / str)."""
    if isinstance(want, list):
        assert got == want and all(type(g) is type(w) for g, w in zip(got, want))
        return
    assert isinstance(got, torch.Tensor)
    got = got.numpy()
    assert got.dtype == want.dtype.newbyteorder("=") and got.shape == want.shape
    assert got.tobytes() == want.astype(got.dtype).tobytes()


# ----- bytes equal h5py's, every layout, mode and backend ----------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_dict_and_tuple_batches_equal_h5py(fields_file: Path, where: dict, mode: str) -> None:
    dtypes = {"img": "float32", "cls": np.int64}
    for rank in range(WORLD):
        ds = open_ds(fields_file, where, keys=ALL, dtypes=dtypes, encoding="utf-8", **rank_args(mode, rank))
        tup = open_ds(fields_file, where, keys=["events:energy", "label", "names", "a:b"], **rank_args(mode, rank))
        try:
            assert len(ds) == len(tup) == len(ds.indices) and ds.total_rows == ROWS
            picks = np.r_[np.arange(len(ds))[::-1], [0, 0]] if len(ds) else np.arange(0)
            rows = ds.indices[picks]
            want = {name: h5_column(fields_file, key, rows, dtypes.get(name), "utf-8" if name in TEXT else None)
                    for name, key in ALL.items()}
            batch = ds.__getitems__(torch.from_numpy(picks))
            assert isinstance(batch, DictBatch) and len(batch) == len(picks)
            for got in (collate(batch), default_collate(batch)):
                assert type(got) is dict and list(got) == list(ALL)
                for name in ALL:
                    assert_same(got[name], want[name])
                    assert got[name] is batch.columns[name]  # passed through: no per-sample work
            if len(ds):
                sample = ds[int(picks[0])]
                assert list(sample) == list(ALL)
                for name in ALL:
                    w = want[name][:1] if isinstance(want[name], list) else want[name][:1]
                    g = [sample[name]] if name in TEXT else sample[name].unsqueeze(0)
                    assert_same(g, w)
            tb = tup.__getitems__(picks.tolist())
            assert isinstance(tb, TupleBatch)
            got_t, got_l = collate(tb), default_collate(tb)
            assert type(got_t) is tuple and type(got_l) is list and len(got_t) == 4
            for key, got_one, got_two in zip(tup.fields.keys, got_t, got_l):
                assert_same(got_one, h5_column(fields_file, key, rows))
                assert got_two is got_one
            if len(tup):
                assert type(tup[0]) is tuple and tup[0][2] == h5_column(fields_file, "names", tup.indices[:1])[0]
        finally:
            ds.close()
            tup.close()


def _double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def _upper(s: str) -> str:
    return s.upper()


def _loader_batches(ds: SharedH5Dataset, ctx: str, collate_fn: Any) -> list[Any]:
    loader = DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context=ctx, collate_fn=collate_fn,
                        timeout=120)
    return list(loader)


@pytest.mark.parametrize("ctx,mode", [("fork", m) for m in MODES] + [("spawn", "interleave")])
def test_dataloader_workers_equal_h5py(fields_file: Path, where: dict, ctx: str, mode: str) -> None:
    """Worker processes (forked, or spawned: the dataset is pickled) serve the same bytes, with
    and without transforms, through collate and default_collate."""
    keys = {"energy": "events:energy", "img": "img", "tag": "events:tag", "name": "names"}
    plain = open_ds(fields_file, where, keys=keys, **rank_args(mode, 1))
    with_tf = open_ds(fields_file, where, keys=keys, transforms={"img": _double, "name": _upper}, encoding="utf-8",
                      **rank_args(mode, 1))
    try:
        rows = plain.indices
        want = {name: h5_column(fields_file, key, rows) for name, key in keys.items()}
        for collate_fn in (collate, None) if ctx == "fork" else ():  # a spawned worker costs seconds: one loader
            batches = _loader_batches(plain, ctx, collate_fn)
            for name in keys:
                parts = [b[name] for b in batches]
                got = sum(parts, []) if name in ("tag", "name") else torch.cat(parts)
                assert_same(got, want[name])
        batches = _loader_batches(with_tf, ctx, None)
        assert_same(torch.cat([b["img"] for b in batches]), want["img"] * 2)
        assert_same(torch.cat([b["energy"] for b in batches]), want["energy"])
        assert_same(sum((b["name"] for b in batches), []), [v.decode().upper() for v in want["name"]])
        assert_same(sum((b["tag"] for b in batches), []), [v.decode() for v in want["tag"]])
    finally:
        plain.close()
        with_tf.close()


def test_x_y_with_a_field_and_byte_strings(fields_file: Path, where: dict) -> None:
    """x_key/y_key take field keys and byte strings too: (x, y) batches as before."""
    ds = open_ds(fields_file, where, x_key="events:pos", y_key="names", rank=0, world_size=1, dtype_x="float64")
    try:
        picks = [3, 1, 28]
        x, y = collate(ds.__getitems__(picks))
        assert_same(x, h5_column(fields_file, "events:pos", np.array(picks), np.float64))
        assert y == h5_column(fields_file, "names", np.array(picks))
        assert default_collate(ds.__getitems__(picks))[1] == y
        assert ds[28][1] == y[2]
    finally:
        ds.close()
    only = open_ds(fields_file, where, x_key="names", rank=0, world_size=1, encoding="utf-8",
                   transform=_upper)
    try:
        assert collate(only.__getitems__([0, 2])) == [v.upper() for v in h5_column(fields_file, "names", [0, 2], None,
                                                                                    "utf-8")]
    finally:
        only.close()


def test_daemon_stores_only_the_selected_fields(fields_file: Path, shared_daemon: Daemon) -> None:
    ds = SharedH5Dataset(fields_file, keys=["events:flag", "events:pos"], rank=0, world_size=1,
                         runtime_dir=shared_daemon.runtime_dir, fallback="error")
    try:
        segments = {s["key"]: s for s in shared_daemon.status()["segments"] if s["file"] == str(fields_file)}
        flag, pos = segments["events:flag"], segments["events:pos"]
        assert (flag["dtype"], flag["rows"]) == ("int8", ROWS) and (pos["dtype"], pos["rows"]) == ("float32", ROWS)
        # the data part holds one field's bytes per row, not the compound's EVENT.itemsize
        assert pos["bytes"] - flag["bytes"] == ROWS * (12 - 1)
    finally:
        ds.close()


def test_a_dataset_named_with_a_colon_wins(tmp_path: Path, where: dict) -> None:
    path = tmp_path / "colon.h5"
    with h5py.File(path, "w") as f:
        f["ev"] = np.array([(1, 2.0)] * 5, dtype=[("e", "i4"), ("f", "f8")])
        f["ev:e"] = np.arange(5, dtype=np.int16) + 100  # a dataset literally named like the field
        f["run:1"] = np.array([(7,)] * 5, dtype=[("e:x", "i2")])  # a ':' in the dataset and the field
    ds = open_ds(path, where, keys=["ev:e", "ev:f", "run:1:e:x"], rank=0, world_size=1)
    try:
        e, fld, ex = collate(ds.__getitems__([0, 4]))
        assert e.dtype == torch.int16 and e.tolist() == [100, 104]
        assert fld.tolist() == [2.0, 2.0] and ex.tolist() == [7, 7]
    finally:
        ds.close()


def test_predecessor_classes_take_field_keys(fields_file: Path, no_daemon_env: Path) -> None:
    lazy = H5LazyDataset(str(fields_file), "events:energy", "events:tag")
    x, y = lazy[4]
    assert x.item() == h5_column(fields_file, "events:energy", np.array([4]))[0] and y == b"t4"
    assert [s[1] for s in lazy.__getitems__([5, 6])] == [b"", b"t6"]
    mem = RankMemCachedH5Dataset(str(fields_file), "events:pos", "label", dtype_x=None, log_fn=lambda _: None)
    assert mem.backend == "memory"
    x, y = collate(mem.__getitems__([2, 0]))
    assert_same(x, h5_column(fields_file, "events:pos", mem.indices[[2, 0]]))


# ----- errors -----------------------------------------------------------------------------------
@pytest.mark.parametrize("keys,error,match", [
    (["img", "short", "label"], LengthMismatch, r"'img' has 29 rows, 'short' has 28 rows, 'label' has 29 rows"),
    (["events:nope"], KeyNotFound, r"'events:nope'.*no field 'nope'.*energy, pos, flag, tag"),
    (["label:x"], KeyNotFound, r"'label' .* not a compound type"),
    (["nothere:x"], KeyNotFound, r"'nothere:x' is not in"),
    (["events"], UnsupportedDataset, r"compound.*e\.g\. 'events:energy' \(fields: energy, pos, flag, tag\)"),
    (["nested:inner"], UnsupportedDataset, r"'nested:inner'.*compound type"),
])
def test_bad_keys(fields_file: Path, where: dict, keys: list[str], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        open_ds(fields_file, where, keys=keys, rank=0, world_size=1)


def test_no_dtype_for_byte_strings(fields_file: Path, where: dict) -> None:
    with pytest.raises(UnsupportedDataset, match=r"'names' holds fixed-length byte strings .*float32.*leave its dtype"):
        open_ds(fields_file, where, keys={"n": "names"}, dtypes={"n": "float32"}, rank=0, world_size=1)


def test_undecodable_bytes(fields_file: Path, where: dict) -> None:
    ds = open_ds(fields_file, where, keys=["bad_utf8"], encoding="utf-8", rank=0, world_size=1)
    try:
        with pytest.raises(DataError, match=r"'bad_utf8'.*not valid utf-8.*encoding"):
            ds.__getitems__([0, 1])
    finally:
        ds.close()


@pytest.mark.parametrize("kwargs,match", [
    ({"keys": ["img"], "x_key": "label"}, "keys= replaces x_key"),
    ({"keys": ["img"], "dtype_x": "float32"}, "keys= replaces dtype_x"),
    ({"keys": ["img"], "transform": _double}, "keys= replaces transform"),
    ({"x_key": "img", "dtypes": {"img": "f4"}}, "dtypes= and transforms= go with keys="),
    ({}, "pass the key"),
    ({"x_key": ["img", "label"]}, r"x_key must be one key.*keys=\[\.\.\.\]"),
    ({"keys": "img"}, "keys must be a list"),
    ({"keys": []}, "at least one"),
    ({"keys": ["img", "img"]}, "'img' more than once"),
    ({"keys": ["img", ""]}, "non-empty string"),
    ({"keys": {"": "img"}}, "non-empty string names"),
    ({"keys": {"a": 3}}, "non-empty string naming a dataset"),
    ({"keys": {"a": "img"}, "dtypes": {"b": "f4"}}, "dtypes names 'b', which is not among the fields 'a'"),
    ({"keys": {"a": "img"}, "dtypes": ["f4"]}, "dtypes must be a dict"),
    ({"keys": {"a": "img"}, "dtypes": {"a": "U3"}}, r"dtypes\['a'\]=<U3 is not a numeric dtype"),
    ({"keys": {"a": "img"}, "transforms": {"a": 3}}, r"transforms\['a'\] must be callable"),
    ({"keys": ["img"], "encoding": "klingon"}, "not a text encoding"),
    ({"x_key": "img", "dtype_y": "f4"}, "need a y_key"),
])
def test_bad_arguments(fields_file: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SharedH5Dataset(fields_file, rank=0, world_size=1, **kwargs)


def test_encoding_needs_byte_strings(fields_file: Path, where: dict) -> None:
    with pytest.raises(ConfigError, match="none of 'img', 'label' holds byte strings"):
        open_ds(fields_file, where, keys=["img", "label"], encoding="utf-8", rank=0, world_size=1)


def test_transform_attributes(fields_file: Path, no_daemon_env: Path) -> None:
    """x/y datasets keep settable transform/target_transform; keys= datasets refuse them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        xy = SharedH5Dataset(fields_file, "label", "a:b", rank=0, world_size=1)
        keyed = SharedH5Dataset(fields_file, keys=["label"], rank=0, world_size=1)
    xy.transform, xy.target_transform = _double, _double
    assert xy.transform is _double and [t.item() for t in xy[3]] == [42, -4]
    assert keyed.transform is None
    with pytest.raises(ConfigError, match="pass transforms="):
        keyed.transform = _double
