"""Stream mode's bad input over every kind of data, refused before any block is read with a
ConfigError naming the numbers: a block that is not whole chunks of every key of every file
(the file named), a window smaller than one block (variable-length rows: counting their values),
or than one batch on every local rank needs; a window that is not a size (naming window=). A
block larger than the file is cut to it; a file of no rows is refused rather than trained on
silently; the default window without a daemon is shared by the loader's workers; the fallback
warning says when the order differs from a daemon's."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.client import SharedH5Dataset, make_loader
from h5serve.client.streaming.backend import StreamConfig
from h5serve.errors import ConfigError, DataError
from h5serve.order.stream_order import BlockLayout

pytestmark = pytest.mark.filterwarnings("ignore:h5serve. no h5serve daemon:RuntimeWarning")


def _part(path: Path, rows: int, chunk: int, vlen: bool = False) -> str:
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.zeros((rows, 4), np.float32), chunks=(chunk, 4))
        if vlen:
            v = f.create_dataset("v", (rows,), dtype=h5py.vlen_dtype(np.float64), chunks=(chunk,))
            for i in range(rows):
                v[i] = np.zeros(100)  # 800 bytes of values a row
    return str(path)


def _open(paths: object, runtime: Path, **kwargs: object) -> SharedH5Dataset:
    return SharedH5Dataset(paths, mode="stream", rank=0, world_size=1, runtime_dir=runtime,
                           **kwargs)  # type: ignore[arg-type]


def test_a_block_of_many_files_must_be_whole_chunks_of_every_file(tmp_path: Path) -> None:
    files = [_part(tmp_path / "a.h5", 300, 16), _part(tmp_path / "b.h5", 300, 24)]
    with pytest.raises(ConfigError, match=r"block_rows=32 is not a whole number of chunks: blocks must be multiples of "
                                          r"48 rows \(x: 16 rows a chunk in .*a.h5, x: 24 rows a chunk in .*b.h5\); "
                                          r"use block_rows=48 \(the smallest block\) or a multiple of it"):
        _open(files, tmp_path / "none", keys=["x"], block_rows=32, window="1MiB")
    ds = _open(files, tmp_path / "none", keys=["x"], block_rows=96, window="1MiB")
    try:
        assert ds.stream is not None and ds.stream.config.layout.n_blocks == 2 * 4  # 3 of 96 and one of 12, per file
    finally:
        ds.close()


def test_a_window_smaller_than_a_block_of_variable_length_rows_counts_their_values(tmp_path: Path) -> None:
    path = _part(tmp_path / "v.h5", 256, 32, vlen=True)
    # a row: 16 bytes of x, an 8-byte offset and 800 bytes of values
    with pytest.raises(ConfigError, match=r"window='20KiB' is 20.0 KiB, smaller than one block \(32 rows x 824 bytes "
                                          r"\(variable-length rows: their mean length in the first rows\) = 25.8 KiB"
                                          r"\): pass a window of at least 25.8 KiB"):
        _open(path, tmp_path / "none", keys=["x", "v"], block_rows=32, window="20KiB")


def test_a_window_smaller_than_one_batch_on_every_local_rank_is_refused(tmp_path: Path) -> None:
    files = [_part(tmp_path / "a.h5", 300, 16), _part(tmp_path / "b.h5", 100, 16)]
    ds = SharedH5Dataset(files, keys=["x"], mode="stream", block_rows=32, window=3 * 32 * 16, rank=0, world_size=2,
                         local_rank=0, local_world_size=2, node_rank=0, num_nodes=1, runtime_dir=tmp_path / "none")
    try:
        with pytest.raises(ConfigError, match=r"the window holds 3 blocks of 32 rows, but one batch on each of the 2 "
                                              r"local ranks \(16 x 2 = 32 rows\) can need 3 blocks besides the window's"
                                              r" own: pass a window of at least 4 blocks"):
            make_loader(ds, 16)
    finally:
        ds.close()


def test_a_window_that_is_not_a_size_names_window(tmp_path: Path) -> None:
    path = _part(tmp_path / "a.h5", 1024, 256)
    with pytest.raises(ConfigError, match=r"^window='abc' is not a size: pass bytes as an int, or a string like "
                                          r"'2GiB'"):
        _open(path, tmp_path / "none", keys=["x"], window="abc")


def test_block_rows_under_one_chunk_suggests_the_smallest_block_once(tmp_path: Path) -> None:
    path = _part(tmp_path / "a.h5", 1024, 256)
    with pytest.raises(ConfigError) as caught:
        _open(path, tmp_path / "none", keys=["x"], block_rows=100, window="1MiB")
    assert "use block_rows=256 (the smallest block) or a multiple of it" in str(caught.value)
    assert "256 or 256" not in str(caught.value)
    with pytest.raises(ConfigError, match=r"use e.g. block_rows=256 or 512$"):  # between two: both
        _open(path, tmp_path / "none", keys=["x"], block_rows=300, window="1MiB")


def test_a_window_under_one_chunk_does_not_suggest_smaller_blocks(tmp_path: Path) -> None:
    path = _part(tmp_path / "a.h5", 1024, 256)  # a row: 16 bytes, a chunk 4 KiB
    with pytest.raises(ConfigError) as caught:
        _open(path, tmp_path / "none", keys=["x"], window="1KiB")
    said = str(caught.value)
    assert "pass a window of at least 4.0 KiB" in said and "blocks are one chunk already" in said
    assert "smaller blocks" not in said
    with pytest.raises(ConfigError, match=r"or smaller blocks \(block_rows=, a multiple of 256\)"):  # 2 chunks a block
        _open(path, tmp_path / "none", keys=["x"], block_rows=512, window="6KiB")


def test_block_rows_past_the_file_is_cut_to_the_file(tmp_path: Path) -> None:
    path = _part(tmp_path / "a.h5", 1000, 256)  # 1,000 rows of 16 bytes: four chunks, the last short
    ds = _open(path, tmp_path / "none", keys=["x"], block_rows=256 * 400, window=1024 * 16)
    try:
        assert ds.stream is not None
        config = ds.stream.config
        assert (config.layout.block_rows, config.layout.n_blocks, config.capacity) == (1024, 1, 1)
        assert config.block_bytes == 1024 * 16  # a window of the file's (whole chunks') bytes holds it
        assert sum(len(x) for (x,) in make_loader(ds, 100, seed=1)) == 1000
    finally:
        ds.close()


def test_a_file_of_no_rows_is_refused_by_make_loader(tmp_path: Path) -> None:
    path = tmp_path / "empty.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", shape=(0, 4), maxshape=(None, 4), dtype=np.float32, chunks=(64, 4))
    for mode in ("stream", "global", "contiguous"):
        ds = SharedH5Dataset(str(path), keys=["x"], mode=mode, rank=0, world_size=1, runtime_dir=tmp_path / "none")
        try:
            with pytest.raises(DataError, match=rf"{path} has no rows: every epoch would have no batch"):
                make_loader(ds, 8)
        finally:
            ds.close()


def test_the_default_window_without_a_daemon_is_shared_by_the_workers(tmp_path: Path) -> None:
    path = _part(tmp_path / "a.h5", 1024, 256)
    ds = _open(path, tmp_path / "none", keys=["x"])
    fixed = _open(path, tmp_path / "none", keys=["x"], window="64KiB")
    try:
        assert ds.stream is not None and fixed.stream is not None
        config = ds.stream.config
        assert config.worker_room == config.window_bytes // config.block_bytes > 0
        assert make_loader(ds, 8, num_workers=2).batch_sampler.capacity == config.capacity_for(2)
        assert fixed.stream.config.worker_room == 0  # a window you pass is what each process holds
        assert fixed.stream.config.capacity_for(3) == fixed.stream.config.capacity
    finally:
        ds.close()
        fixed.close()
    config = StreamConfig(BlockLayout(1000, 100), 1600, 6, 9600, worker_room=6)
    assert [config.capacity_for(w) for w in (0, 1, 2, 3, 6)] == [6, 6, 3, 2, 1]
    with pytest.raises(ConfigError, match=r"holds 6 blocks of 1.6 KiB, fewer than one for each of 7 workers: use "
                                          r"fewer workers, pass window="):
        config.capacity_for(7)
    assert StreamConfig(BlockLayout(1000, 100), 1600, 10, 10 ** 9, worker_room=10 ** 6).capacity_for(8) == 10


def test_the_fallback_warning_says_when_the_order_differs_from_a_daemons(tmp_path: Path) -> None:
    path = _part(tmp_path / "a.h5", 1024, 256)
    with pytest.warns(RuntimeWarning) as caught:
        _open(path, tmp_path / "none", keys=["x"]).close()
    said = " ".join(str(w.message) for w in caught)
    assert "same order" not in said and "another order than a daemon's" in said and "Pass window=" in said
    with pytest.warns(RuntimeWarning) as caught:
        _open(path, tmp_path / "none", keys=["x"], window="1MiB").close()
    assert "same rows, same order" in " ".join(str(w.message) for w in caught)
    with pytest.warns(RuntimeWarning) as caught:
        SharedH5Dataset(path, keys=["x"], mode="global", rank=0, world_size=1, runtime_dir=tmp_path / "none").close()
    said = " ".join(str(w.message) for w in caught)
    assert "same order as a daemon that holds them whole" in said and "auto_stream=False" in said
