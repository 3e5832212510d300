"""Stream mode's bad input over every kind of data, refused before any block is read with a
ConfigError naming the numbers: a block that is not whole chunks of every key of every file
(the file named), a window smaller than one block (variable-length rows: counting their values),
or than one batch on every local rank needs."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.client import SharedH5Dataset, make_loader
from h5serve.errors import ConfigError

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
                                          r"use e.g. block_rows=48 or 48"):
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
