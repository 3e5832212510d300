"""Fixtures: a real daemon per module or per test, real HDF5 files, a runtime dir where
nothing runs."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator

import pytest

from .helpers import Daemon, make_h5, short_tmpdir


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = Daemon()
    try:
        yield d.start()
    finally:
        d.stop()


@pytest.fixture(scope="module")
def shared_daemon() -> Iterator[Daemon]:
    d = Daemon()
    try:
        yield d.start()
    finally:
        d.stop()


@pytest.fixture
def no_daemon_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Point clients at a runtime dir where nothing runs."""
    empty = short_tmpdir("h5s-none-")
    monkeypatch.setenv("H5SERVE_RUNTIME_DIR", str(empty))
    yield empty
    shutil.rmtree(empty, ignore_errors=True)


@pytest.fixture
def h5file(tmp_path: Path) -> Path:
    return make_h5(tmp_path / "data.h5")
