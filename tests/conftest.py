"""Fixtures: a real daemon per module or per test, real HDF5 files, a runtime dir where
nothing runs."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .helpers import Daemon, make_h5, short_tmpdir
from .users import PortablePython, portable_python


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


@pytest.fixture(scope="module")
def py() -> Iterator[PortablePython]:
    """h5serve as any user can run it (tests/users.py): for daemons and CLIs of other users."""
    with portable_python() as p:
        yield p


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A directory every user may enter, holding a world-readable HDF5 file ``data.h5``."""
    d = short_tmpdir("h5s-pub-")
    d.chmod(0o755)
    make_h5(d / "data.h5").chmod(0o644)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=["shm", "lazy"])
def where(request: pytest.FixtureRequest) -> dict[str, Any]:
    """How to open a dataset, both ways: from the module's daemon (``fallback="error"``), or
    lazily with no daemon (``fallback="lazy"``)."""
    if request.param == "shm":
        daemon: Daemon = request.getfixturevalue("shared_daemon")
        return {"runtime_dir": daemon.runtime_dir, "fallback": "error"}
    request.getfixturevalue("no_daemon_env")
    return {"fallback": "lazy"}
