"""Variable-length rows (numeric sequences, variable-length strings): byte for byte what h5py
reads, in every mode, from shared memory and lazily, next to fixed fields, as lists, padded or
nested batches, in DataLoader workers (fork and spawn); segments that follow their file; every
bad input a clear error."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_collate

from h5serve.client import H5LazyDataset, SharedH5Dataset, collate, make_loader
from h5serve.client.ragged import Padded, RaggedList
from h5serve.errors import BudgetExceeded, ConfigError, DataError, ShmFull, UnsupportedDataset
from h5serve.order.sharding import GLOBAL, NODE

from ..helpers import (
    WORLD_4,
    Daemon,
    open_ds,
    rank_args,
    running_daemon,
    short_tmpdir,
    vlen_file,
    wait_for,
    watch_memory,
)

ROWS = 29  # odd: uneven shards
WORLD = WORLD_4  # node mode: 2 nodes of 2 ranks
MODES = ("contiguous", "interleave", NODE, GLOBAL)
VLEN_F4 = h5py.vlen_dtype(np.float32)


def _file(path: Path) -> Path:
    rng = np.random.default_rng(11)
    with h5py.File(path, "w") as f:
        tokens = f.create_dataset("tokens", (ROWS,), dtype=VLEN_F4, chunks=(5,))
        ids = f.create_dataset("ids", (ROWS,), dtype=h5py.vlen_dtype(np.dtype(">i2")))
        for i in range(ROWS):
            tokens[i] = rng.normal(size=i % 6).astype(np.float32)  # empty rows too
            ids[i] = rng.integers(-300, 300, size=(i * 7) % 5).astype(np.int16)
        f.create_dataset("text", data=[f"ñ·{i}" * (i % 3) for i in range(ROWS)], dtype=h5py.string_dtype())
        f.create_dataset("ascii", data=[b"a" * (i % 4) for i in range(ROWS)], dtype=h5py.string_dtype("ascii"))
        f["label"] = np.arange(ROWS, dtype=np.int64) * 3
        f["img"] = rng.integers(0, 255, (ROWS, 2, 3), dtype=np.uint8)
        events = f.create_dataset("events", (ROWS,), dtype=[("e", "<f8"), ("hits", h5py.vlen_dtype(np.int32))])
        for i in range(ROWS):
            events[i] = (float(i), np.arange(i % 4, dtype=np.int32) + i)
        f.create_dataset("short", (ROWS - 1,), dtype=VLEN_F4)
        f.create_dataset("of_compound", (ROWS,), dtype=h5py.vlen_dtype(np.dtype([("a", "i4"), ("b", "f4")])))
        f.create_dataset("of_refs", (ROWS,), dtype=h5py.vlen_dtype(h5py.ref_dtype))
        f.create_dataset("two_d", (ROWS, 2), dtype=VLEN_F4)
        bad = f.create_dataset("bad_utf8", (ROWS,), dtype=h5py.string_dtype())
        bad[3] = b"\xff\xfe"
    return path


@pytest.fixture(scope="module")
def vfile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _file(tmp_path_factory.mktemp("vlen") / "vlen.h5")


def h5_rows(path: Path, key: str) -> list[Any]:
    """h5py's own read of every row of ``key``: arrays, or str for strings."""
    with h5py.File(path, "r") as f:
        if key.startswith("events:"):
            data = f["events"].fields(key.split(":", 1)[1])[:]
        else:
            data = f[key][:]
            if h5py.check_string_dtype(f[key].dtype) is not None:
                encoding = h5py.check_string_dtype(f[key].dtype).encoding
                return [b.decode(encoding) for b in data]
    return list(data)


def assert_rows(got: Any, want: list[Any], dtype: Any = None) -> None:
    """Every row the same type, dtype and bytes as h5py's (cast with numpy when ``dtype``)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, str):
            assert type(g) is str and g == w
            continue
        assert isinstance(g, torch.Tensor) and g.dim() == 1
        w = w.astype(np.dtype(dtype) if dtype is not None else w.dtype.newbyteorder("="))
        assert g.numpy().dtype == w.dtype and g.numpy().tobytes() == w.tobytes()


def unpad(batch: Padded) -> list[torch.Tensor]:
    assert batch.lengths.dtype == torch.int64 and batch.values.shape == (len(batch.lengths), int(batch.lengths.max()))
    return [batch.values[i, :n] for i, n in enumerate(batch.lengths.tolist())]


# ----- bytes equal h5py's, every mode and backend, next to fixed fields ---------------------------
@pytest.mark.parametrize("mode", MODES)
def test_vlen_and_fixed_fields_equal_h5py(vfile: Path, where: dict, mode: str) -> None:
    keys = {"tokens": "tokens", "ids": "ids", "text": "text", "ascii": "ascii", "label": "label", "img": "img",
            "hits": "events:hits"}
    want = {name: h5_rows(vfile, key) for name, key in keys.items()}
    for rank in range(WORLD):
        ds = open_ds(vfile, where, keys=keys, dtypes={"ids": "float32"}, **rank_args(mode, rank))
        tup = open_ds(vfile, where, keys=["tokens", "label"], **rank_args(mode, rank))
        try:
            order = np.random.default_rng(rank).permutation(len(ds))
            local = np.concatenate([order, order[:3]])  # repeated rows too
            rows = ds.indices[local]
            batch = collate(ds.__getitems__(local))
            for name, column in batch.items():
                expected = [want[name][r] for r in rows]
                if name in ("label", "img"):
                    assert column.numpy().tobytes() == np.stack(expected).tobytes()
                else:
                    assert_rows(column, expected, "float32" if name == "ids" else None)
            assert isinstance(batch["tokens"], RaggedList) and isinstance(batch["text"], list)
            tokens, label = collate(tup.__getitems__(local))
            assert_rows(tokens, [want["tokens"][r] for r in rows])
            assert label.tolist() == [want["label"][r] for r in rows]
            # one sample at a time: the same rows
            for i in (0, len(ds) - 1):
                sample = ds[i]
                assert_rows([sample["tokens"]], [want["tokens"][ds.indices[i]]])
                assert sample["text"] == want["text"][ds.indices[i]]
        finally:
            ds.close()
            tup.close()


def test_padded_and_nested_batches(vfile: Path, where: dict) -> None:
    want = h5_rows(vfile, "tokens")
    local = [5, 0, 11, 4, 5]
    pad = open_ds(vfile, where, keys=["tokens", "text", "label"], ragged="pad", pad_value=-7.5, mode="interleave",
                  rank=1, world_size=2)
    nested = open_ds(vfile, where, x_key="tokens", y_key="label", ragged="nested")
    try:
        tokens, text, label = collate(pad.__getitems__(local))
        rows = pad.indices[local]
        assert isinstance(tokens, Padded) and tokens.lengths.tolist() == [len(want[r]) for r in rows]
        assert_rows(unpad(tokens), [want[r] for r in rows])
        longest = int(tokens.lengths.max())
        for i, n in enumerate(tokens.lengths.tolist()):
            assert (tokens.values[i, n:] == -7.5).all() and tokens.values.shape[1] == longest
        assert text == [h5_rows(vfile, "text")[r] for r in rows]  # strings stay str
        x, y = collate(nested.__getitems__(local))
        assert x.is_nested and x.layout == torch.jagged
        assert_rows(list(x.unbind()), [want[r] for r in local])
        assert y.tolist() == [3 * r for r in local]
        assert_rows([nested[6][0]], [want[6]])  # a sample: the row's tensor
    finally:
        pad.close()
        nested.close()


def test_x_only_transforms_and_default_collate(vfile: Path, where: dict) -> None:
    want = h5_rows(vfile, "tokens")
    ds = open_ds(vfile, where, x_key="tokens")
    tr = open_ds(vfile, where, keys={"t": "tokens", "s": "text"},
                 transforms={"t": lambda r: torch.nn.functional.pad(r, (0, 8 - len(r))), "s": len})
    try:
        batch = ds.__getitems__([3, 1, 28])
        assert_rows(collate(batch), [want[3], want[1], want[28]])
        assert_rows(list(batch), [want[3], want[1], want[28]])  # a list of per-sample rows for other collates
        assert_rows([ds[5]], [want[5]])
        # per-sample transforms, collated as usual
        out = default_collate(tr.__getitems__([1, 2, 7]))
        assert out["t"].shape == (3, 8) and out["t"][2, :1].tolist() == want[7][:1].tolist()
        assert out["s"].tolist() == [len(h5_rows(vfile, "text")[r]) for r in (1, 2, 7)]
        # keys=[...] batches pass through default_collate whole (as the tuple/dict batches do)
        tup = open_ds(vfile, where, keys=["tokens", "label"])
        try:
            tokens, label = DataLoader(tup, batch_size=4, collate_fn=default_collate).__iter__().__next__()
            assert_rows(tokens, want[:4]) and label.tolist() == [0, 3, 6, 9]
        finally:
            tup.close()
    finally:
        ds.close()
        tr.close()


@pytest.mark.parametrize("backend,ragged,context,workers", [
    ("shm", "list", "spawn", 1), ("shm", "pad", "fork", 2), ("lazy", "list", "fork", 2), ("lazy", "nested", "fork", 2),
])
def test_dataloader_workers(vfile: Path, request: pytest.FixtureRequest, backend: str, ragged: str, context: str,
                            workers: int) -> None:
    if backend == "shm":
        where = {"runtime_dir": request.getfixturevalue("shared_daemon").runtime_dir, "fallback": "error"}
    else:
        request.getfixturevalue("no_daemon_env")
        where = {"fallback": "lazy"}
    want, text = h5_rows(vfile, "tokens"), h5_rows(vfile, "text")
    ds = open_ds(vfile, where, keys=["tokens", "text", "label"], mode="interleave", rank=1, world_size=2,
                 ragged=ragged)
    try:
        loader = make_loader(ds, 4, num_workers=workers, multiprocessing_context=context, seed=3)
        seen = []
        for tokens, strings, label in loader:
            rows = (label // 3).tolist()
            got = unpad(tokens) if ragged == "pad" else list(tokens.unbind()) if ragged == "nested" else tokens
            assert_rows(got, [want[r] for r in rows])
            assert strings == [text[r] for r in rows]
            seen += rows
        assert set(seen) == set(ds.indices.tolist())  # (a row twice: padded to the larger shard's length)
        del loader
    finally:
        ds.close()


def test_gather_of_short_and_long_rows() -> None:
    """h5serve/hdf5/vlen.py's gather: the vectorised index and the slice per row (long rows) give
    the rows at the positions, in order, repeats and empty rows included."""
    from h5serve.hdf5.vlen import gather, offsets_of

    rng = np.random.default_rng(5)
    for top in (6, 3000):
        lengths = rng.integers(0, top, 40)
        values = rng.standard_normal(int(lengths.sum())).astype(np.float32)
        offsets = offsets_of(lengths)
        positions = np.array([3, 0, 39, 3, 17])
        flat, got = gather(offsets, values, positions)
        want = [values[offsets[p]:offsets[p + 1]] for p in positions]
        assert got.tolist() == [len(w) for w in want] and flat.tobytes() == np.concatenate(want).tobytes()


def test_ragged_list_crosses_processes_as_one_tensor() -> None:
    flat = torch.arange(10.0)
    rows = RaggedList.split(flat, [3, 0, 7])
    name, args = rows.__reduce__()[:2]
    assert args[0] is flat and args[1] == [3, 0, 7]
    rows.append(torch.zeros(1))  # changed since: pickles as the plain list it is
    assert rows.__reduce__()[1][0][-1].tolist() == [0.0]


def test_lazy_reads_cached_in_blocks_or_uncached_are_the_same(vfile: Path, no_daemon_env: Path) -> None:
    """The lazy backend's paths: the block cache before and after every block is read (small
    blocks, so a batch meets cached and unread ones), and uncached per-batch reads."""
    from h5serve.client.backends.vlencache import VlenCache
    from h5serve.hdf5.source import inspect_dataset
    from h5serve.order.sharding import Selection

    want = h5_rows(vfile, "ids")
    selection = Selection("interleave", 2, 1)
    rows = selection.indices(ROWS)
    with h5py.File(vfile, "r") as f:
        info = inspect_dataset(f, "ids", vlen=True)
        cache = VlenCache(info, selection, np.dtype("int32"), block_rows=3)
        for batch in ([0, 13, 4, 4], [1, 2, 0], list(range(len(rows)))[::-1], [7]):
            column = cache.take(lambda key: f[key], torch.tensor(batch))
            assert_rows(RaggedList.split(torch.from_numpy(column.values), column.lengths.tolist()),
                        [want[rows[i]] for i in batch], "int32")
        assert cache.whole is not None and cache.missing == 0
    uncached = open_ds(vfile, {"fallback": "lazy"}, keys=["ids", "text"], cache_bytes=0, mode="interleave", rank=1,
                       world_size=2)
    try:
        ids, text = collate(uncached.__getitems__([5, 0, 5, 13]))
        assert_rows(ids, [want[rows[i]] for i in (5, 0, 5, 13)])
        assert text == [h5_rows(vfile, "text")[rows[i]] for i in (5, 0, 5, 13)]
    finally:
        uncached.close()


# ----- segments follow their file ---------------------------------------------------------------
def test_changed_file_is_never_served_stale(tmp_path: Path, shared_daemon: Daemon) -> None:
    daemon = shared_daemon
    path = tmp_path / "v.h5"
    for version in (1, 2):
        tmp = tmp_path / "new.h5"
        with h5py.File(tmp, "w") as f:
            d = f.create_dataset("tokens", (6,), dtype=VLEN_F4)
            for i in range(6):
                d[i] = np.full(i + version, float(version), dtype=np.float32)
        os.replace(tmp, path)  # a new file at the path, as a rewrite should be
        ds = SharedH5Dataset(path, "tokens", runtime_dir=daemon.runtime_dir, fallback="error")
        try:
            assert_rows(collate(ds.__getitems__(list(range(6)))), h5_rows(path, "tokens"))
        finally:
            ds.close()
    assert wait_for(lambda: len([s for s in daemon.status()["segments"] if s["file"] == str(path.resolve())]) <= 1,
                    30), "the old file's segment was not evicted once stale and unheld"
    done = subprocess.run(["python", "-m", "h5serve", "status", "--verify"], env=daemon.env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "every one matches" in done.stdout, done.stdout + done.stderr


def _mount_small_tmpfs() -> Path | None:
    """A 1 MiB tmpfs (root only), or None."""
    if os.geteuid() != 0:
        return None
    mnt = short_tmpdir("h5s-tmpfs-")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        os.rmdir(mnt)
        return None
    return mnt


def test_restart_after_kill_adopts_vlen_segments(vfile: Path, daemon: Daemon) -> None:
    """A killed daemon's complete vlen segments are adopted by the next one (their values
    counted in the header), and serve the same rows with no load."""
    kwargs = {"keys": ["tokens", "text", "label"], "mode": "interleave", "rank": 1, "world_size": 3,
              "runtime_dir": daemon.runtime_dir, "fallback": "error"}
    SharedH5Dataset(vfile, **kwargs).close()
    before = daemon.segment_files()
    os.kill(daemon.pid, signal.SIGKILL)
    assert wait_for(lambda: not daemon.alive(), 10), "the SIGKILLed daemon is still alive"
    daemon.start()
    status = daemon.status()
    assert status["counters"]["adopted"] == 3 and daemon.segment_files() == before
    assert sorted(s["dtype"] for s in status["segments"]) == ["int64", "str utf-8", "vlen float32"]
    ds = SharedH5Dataset(vfile, **kwargs)
    try:
        tokens, text, label = collate(ds.__getitems__(list(range(len(ds)))))
        assert_rows(tokens, [h5_rows(vfile, "tokens")[r] for r in ds.indices])
        assert text == [h5_rows(vfile, "text")[r] for r in ds.indices]
        assert daemon.status()["counters"]["loads"] == 0
    finally:
        ds.close()


def test_capacity_errors(tmp_path: Path) -> None:
    """The budget counts the values (estimated from the first rows before the load); a
    /dev/shm that fills while the values grow is ShmFull (root: a 1 MiB tmpfs under a 4 MiB
    budget, whose room for the load is more than the tmpfs holds), never a SIGBUS, and leaves
    no temporary."""
    big = tmp_path / "big.h5"
    with h5py.File(big, "w") as f:
        v = f.create_dataset("tokens", (256,), dtype=VLEN_F4)
        for i in range(256):
            v[i] = np.ones(8192, dtype=np.float32)  # 8 MiB of values, 2 KiB of offsets
    sneaky = tmp_path / "sneaky.h5"
    with h5py.File(sneaky, "w") as f:
        v = f.create_dataset("tokens", (1100,), dtype=VLEN_F4)
        for i in range(1030, 1100):  # the estimate reads the first 1024 rows: empty
            v[i] = np.ones(4096, dtype=np.float32)  # 1.1 MiB in all > a 1 MiB tmpfs
    mnt = _mount_small_tmpfs()
    d = Daemon("--max-memory", "4M", *(("--shm-dir", str(mnt)) if mnt else ()))
    try:
        d.start()
        with pytest.raises(BudgetExceeded, match="needs 8.0 MiB"):
            SharedH5Dataset(big, "tokens", runtime_dir=d.runtime_dir, fallback="error")
        if mnt is None:
            pytest.skip("the ShmFull half mounts a small tmpfs: root only")
        with pytest.raises(ShmFull, match=r"not enough room .* needs .* free"):
            SharedH5Dataset(sneaky, "tokens", runtime_dir=d.runtime_dir, fallback="error")
        assert os.listdir(mnt) == []  # the failed temporary was removed
        assert d.status()["running"] is True
    finally:
        d.stop()
        if mnt is not None:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
            os.rmdir(mnt)


def test_longer_rows_than_the_estimate_never_take_more_than_the_budget(tmp_path: Path) -> None:
    """Finding 3: the budget counted a variable-length load by the mean length of its first
    1,024 rows, and a file whose first rows are empty loaded 48 MiB into a 4 MiB budget. Now
    each load may grow only to the room the budget gave it when it started, counted meanwhile:
    two such loads side by side (two loaders) are both stopped with BudgetExceeded naming the
    key and the budget, their temporaries removed, and the client reads the rows lazily; a
    file whose real rows do fit, though longer than its first rows said, is loaded and
    counted at its real size. The budget's count and the daemon's files in /dev/shm never
    pass the budget."""
    budget = 4 << 20
    hostile = vlen_file(tmp_path / "hostile.h5", {"a": 24, "b": 24})
    skewed = vlen_file(tmp_path / "skewed.h5", {"tokens": 1.5}, first_length=1)  # 1.5 MiB, estimated at 8 KiB
    with running_daemon("--max-memory", str(budget), "--loaders", "2") as d, watch_memory(d) as peaks:
        with pytest.warns(RuntimeWarning, match=r"hostile.h5\[a\] all ranks \(global\) needs at least 2[34].\d MiB "
                                                r".* the daemon's budget of 4.0 MiB \(--max-memory\)"):
            ds = SharedH5Dataset(hostile, keys=["a", "b"], runtime_dir=d.runtime_dir, fallback="lazy")
        try:
            assert ds.backend == "lazy"
            rows = [0, 1023, 1024, 1099, 1050]
            a, b = collate(ds.__getitems__(rows))
            assert_rows(a, [h5_rows(hostile, "a")[r] for r in rows])
            assert_rows(b, [h5_rows(hostile, "b")[r] for r in rows])
        finally:
            ds.close()
        # both loads ran (side by side: --loaders 2) and were stopped, not only the first
        assert wait_for(lambda: d.status()["counters"]["load_errors"] == 2, 30), d.status()
        assert d.segment_files() == []  # no temporary left
        ok = SharedH5Dataset(skewed, "tokens", runtime_dir=d.runtime_dir, fallback="error")
        try:
            assert ok.backend == "shm"
            assert_rows(collate(ok.__getitems__(list(range(1100)))), h5_rows(skewed, "tokens"))
            (segment,) = d.status()["segments"]
            st = os.stat(f"/dev/shm/{segment['name']}")
            assert segment["charged"] == st.st_blocks * 512 >= 3 << 19  # its real size, as tmpfs holds it
            assert d.status()["memory"]["used"] == segment["charged"]
        finally:
            ok.close()
    assert peaks.samples > 0 and peaks.used <= budget and peaks.allocated <= budget, vars(peaks)


# ----- errors -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    ({"ragged": "padded"}, "ragged must be one of 'list', 'pad', 'nested'"),
    ({"ragged": None}, "ragged must be one of"),
    ({"pad_value": 1}, "pad_value pads batches of ragged='pad'"),
    ({"ragged": "nested", "pad_value": 0}, "pad_value pads batches"),
    ({"ragged": "pad", "pad_value": "x"}, "pad_value must be a number"),
    ({"ragged": "pad", "pad_value": [0]}, "pad_value must be a number"),
])
def test_bad_ragged_arguments(vfile: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SharedH5Dataset(vfile, keys=["tokens", "label"], **kwargs)


@pytest.mark.parametrize("keys,kwargs,error,match", [
    (["label", "text"], {"ragged": "pad"}, ConfigError, "none of 'label', 'text' holds variable-length sequences"),
    (["label"], {"ragged": "nested"}, ConfigError, "none of 'label' holds"),
    (["ids"], {"ragged": "pad", "pad_value": 0.5}, ConfigError, "pad_value=0.5 cannot be held by key 'ids'.*int16"),
    (["ids"], {"ragged": "pad", "pad_value": 70000}, ConfigError, "pad_value=70000 cannot be held"),
    (["text"], {"dtypes": {"text": "uint8"}}, UnsupportedDataset, "'text' holds variable-length strings.*dtype unset"),
    (["text"], {"encoding": "latin-1"}, ConfigError, "encoding='latin-1' decodes byte string keys"),
    (["tokens"], {"dtypes": {"tokens": "U4"}}, ConfigError, "not a numeric dtype"),
    (["of_compound"], {}, UnsupportedDataset, "'of_compound'.*variable-length sequences of a compound type"),
    (["of_refs"], {}, UnsupportedDataset, "'of_refs'.*variable-length sequences of object references"),
    (["two_d"], {}, UnsupportedDataset, "'two_d'.*variable-length rows in 2 dimensions"),
    (["tokens", "short"], {}, Exception, "'tokens' has 29 rows, 'short' has 28 rows"),
])
def test_bad_inputs(vfile: Path, where: dict, keys: list, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        open_ds(vfile, where, keys=keys, **kwargs)


def test_nan_pads_floats_only(vfile: Path, no_daemon_env: Path) -> None:
    ds = open_ds(vfile, {"fallback": "lazy"}, keys=["tokens"], ragged="pad", pad_value=float("nan"))
    try:
        (tokens,) = collate(ds.__getitems__([0, 5]))
        assert tokens.values[0].isnan().all() and not tokens.values[1].isnan().any()  # rows of 0 and 5 values
    finally:
        ds.close()
    with pytest.raises(ConfigError, match="pad_value=nan cannot be held by key 'ids'"):
        open_ds(vfile, {"fallback": "lazy"}, keys=["ids"], ragged="pad", pad_value=float("nan"))


def test_undecodable_strings_name_the_key(vfile: Path, where: dict) -> None:
    ds = open_ds(vfile, where, keys=["bad_utf8", "label"])
    try:
        assert ds[0][0] == ""
        with pytest.raises(DataError, match="key 'bad_utf8'.*not valid utf-8, the encoding HDF5 records"):
            collate(ds.__getitems__([2, 3]))
        with pytest.raises(DataError, match="key 'bad_utf8'"):
            ds[3]
    finally:
        ds.close()


def test_readers_without_vlen_say_which_does(vfile: Path, no_daemon_env: Path) -> None:
    with pytest.raises(UnsupportedDataset, match="SharedH5Dataset serves variable-length rows"):
        H5LazyDataset(str(vfile), "tokens")
