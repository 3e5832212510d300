"""hdf5/description.py: the one description of a dataset's files that the lazy, many-files,
compat and stream readers are given, with every check they relied on made once."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.errors import DataError, KeyNotFound, LengthMismatch, UnsupportedDataset
from h5serve.hdf5.description import DatasetDescription, check_rows, describe


def open_files() -> int:
    return h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE)


def write(path: Path, rows: int, dtype: str = "uint8", y_rows: int | None = None, chunks: int = 4) -> str:
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(rows * 3, dtype=dtype).reshape(rows, 3), chunks=(min(chunks, rows), 3))
        f.create_dataset("y", data=np.arange(rows if y_rows is None else y_rows, dtype=np.int64))
        f.create_dataset("name", data=np.array([b"ab"] * rows, dtype="S2"))
        v = f.create_dataset("v", (rows,), dtype=h5py.vlen_dtype(np.float32))
        for i in range(rows):
            v[i] = np.arange(i % 3, dtype=np.float32)
    return str(path)


def test_one_file_is_described_and_closed(tmp_path: Path) -> None:
    path = write(tmp_path / "a.h5", 10)
    before = open_files()
    d = describe((path,), ("x", "y"), (np.dtype(np.float32), None))
    assert open_files() == before  # closed: nothing held across a DataLoader's fork
    assert (d.files, d.total_rows, d.file_rows) == ((path,), 10, (10,))
    assert d.out_dtypes == [np.dtype(np.float32), np.dtype(np.int64)]
    assert d.keys[0].dtype == np.uint8 and d.keys[0].row_shape == (3,) and d.infos[0].chunk_rows == 4
    assert d.vlen_kinds == ["", ""]
    assert pickle.loads(pickle.dumps(d)) == d  # handed to spawned DataLoader workers with their backend


def test_many_files_are_one_dataset(tmp_path: Path) -> None:
    paths = [write(tmp_path / f"{i}.h5", n) for i, n in enumerate((4, 5, 6))]
    d = describe(paths, ("x", "y", "v"), (None, None, None), pattern=str(tmp_path / "*.h5"))
    assert (d.total_rows, d.file_rows, d.pattern) == (15, (4, 5, 6), str(tmp_path / "*.h5"))
    assert [k.file_rows for k in d.keys] == [(4, 5, 6)] * 3
    assert d.vlen_kinds == ["", "", "seq"] and d.out_dtypes[2] == np.float32
    assert [len(k.infos) for k in d.keys] == [3, 3, 3]


def test_files_of_different_dtypes_hold_the_requested_one(tmp_path: Path) -> None:
    paths = [write(tmp_path / "a.h5", 4, "uint8"), write(tmp_path / "b.h5", 4, "uint16")]
    d = describe(paths, ("x",), (np.dtype(np.float32),))
    assert d.keys[0].dtype == np.float32 and d.out_dtypes == [np.dtype(np.float32)]
    said = f"{paths[1]}: dataset 'x' has dtype uint16, but {paths[0]} has uint8"
    with pytest.raises(DataError, match=re.escape(said)):
        describe(paths, ("x",), (None,))


def test_keys_of_different_lengths_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "a.h5", 10, y_rows=9)
    with pytest.raises(LengthMismatch, match="'x' has 10 rows, 'y' has 9 rows"):
        describe((path,), ("x", "y"), (None, None))


def test_rows_must_pair_up_file_by_file(tmp_path: Path) -> None:
    # equal totals (10 and 10) that pair row i of x with another sample's y: refused, naming the file
    paths = [write(tmp_path / "a.h5", 4, y_rows=5), write(tmp_path / "b.h5", 6, y_rows=5)]
    with pytest.raises(LengthMismatch, match=re.escape(f"{paths[0]}: 'x' has 4 rows but 'y' has 5")):
        describe(paths, ("x", "y"), (None, None))


def test_check_rows_is_the_shm_backends_check_too() -> None:
    check_rows(("x", "y"), (10, 10))
    check_rows(("x", "y"), (10, 10), ("/only.h5",), ((3, 7), (4, 6)))  # one file: file rows are not compared
    with pytest.raises(LengthMismatch, match="'x' has 10 rows, 'y' has 11 rows"):
        check_rows(("x", "y"), (10, 11))
    with pytest.raises(LengthMismatch, match="/b.h5: 'x' has 7 rows but 'y' has 6"):
        check_rows(("x", "y"), (10, 10), ("/a.h5", "/b.h5"), ((3, 7), (3, 6)))


def test_what_cannot_be_served_is_refused_as_before(tmp_path: Path) -> None:
    path = write(tmp_path / "a.h5", 4)
    with pytest.raises(UnsupportedDataset, match="byte strings"):
        describe((path,), ("name",), (np.dtype(np.float32),))
    with pytest.raises(KeyNotFound, match="'nope'"):
        describe((path,), ("x", "nope"), (None, None))
    with pytest.raises(UnsupportedDataset, match="this reader"):  # H5LazyDataset and the compat preload
        describe((path,), ("v",), (None,), vlen=False)
    assert isinstance(describe((path,), ("name",), (None,)), DatasetDescription)
