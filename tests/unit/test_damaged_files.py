"""A file HDF5 finds truncated or damaged is a DataError that says so and what to do (copy or write
it again), not a SourceNotFound (which reads as a wrong path, and falls back to lazy reads that
fail the same way) nor a KeyNotFound (which lists the datasets, the damaged one among them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from h5serve.client import SharedH5Dataset
from h5serve.errors import DataError, KeyNotFound, SourceNotFound, falls_back
from h5serve.hdf5.identity import file_identity, open_h5, open_h5_verified

from ..helpers import damaged_header, truncated, write_small_h5

pytestmark = pytest.mark.filterwarnings("ignore:h5serve. no h5serve daemon:RuntimeWarning")


def _open(path: Path, mode: str, tmp_path: Path) -> SharedH5Dataset:
    return SharedH5Dataset(str(path), "x", "y", mode=mode, rank=0, world_size=1, runtime_dir=tmp_path / "none")


@pytest.mark.parametrize("mode", ["stream", "global", "contiguous"])
def test_a_truncated_file_says_it_is_truncated_and_by_how_much(tmp_path: Path, mode: str) -> None:
    path, held, size = truncated(tmp_path)
    with pytest.raises(DataError) as caught:
        _open(path, mode, tmp_path)
    assert not isinstance(caught.value, SourceNotFound) and not falls_back(caught.value)
    said = str(caught.value)
    assert f"{str(path)!r} is truncated" in said and "copy or write it again" in said
    assert f"it holds {held:,} bytes of the" in said  # HDF5 records the size it should have


def test_both_ways_of_opening_a_file_say_truncated(tmp_path: Path) -> None:
    path, _, _ = truncated(tmp_path)
    for opener in (lambda: open_h5(path), lambda: open_h5_verified(file_identity(path))):
        with pytest.raises(DataError, match="is truncated") as caught:
            opener()
        assert not isinstance(caught.value, SourceNotFound)


@pytest.mark.parametrize("mode", ["stream", "global"])
def test_a_damaged_object_header_says_the_file_is_damaged(tmp_path: Path, mode: str) -> None:
    path = damaged_header(tmp_path)
    with pytest.raises(DataError) as caught:
        _open(path, mode, tmp_path)
    assert not isinstance(caught.value, KeyNotFound) and not falls_back(caught.value)
    said = str(caught.value)
    assert "key 'x'" in said and "exists but cannot be opened" in said and "the file is damaged" in said
    assert "restore it from a good copy or write it again" in said


def test_not_an_hdf5_file_and_a_missing_key_stay_what_they_were(tmp_path: Path) -> None:
    text = tmp_path / "notes.h5"
    text.write_text("not HDF5")
    with pytest.raises(SourceNotFound, match="cannot be opened as an HDF5 file"):
        open_h5(text)
    with pytest.raises(KeyNotFound, match="datasets there: x, y"):
        SharedH5Dataset(str(write_small_h5(tmp_path / "ok.h5")), "nope", mode="global", runtime_dir=tmp_path / "none")
