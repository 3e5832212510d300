"""The stream arena beside a daemon that offers no arenas: a
client asks for arenas only when the daemon's ping offers them (``"arena"``: the layout's
version), and otherwise streams a segment per block, as with H5SERVE_ARENA=0: same rows, same
order, no arena file. Both kinds of daemon without arenas are real: this one started without the
variable, and an older daemon (the last main without the arena, its package taken from git)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.client import SharedH5Dataset, make_loader
from h5serve.errors import ProtocolError
from h5serve.segments.arena import ARENA_MARK
from h5serve.wire.connection import DaemonClient
from h5serve.wire.protocol import Acquire
from h5serve.wire.runtime import ARENA_ENV

from ..helpers import Daemon, make_h5, running_daemon
from ..users import as_user, root_only, throwaway_group, throwaway_user

pytestmark = pytest.mark.timeout(300)

ROWS, SHAPE, BLOCK_ROWS = 2049, (1024,), 128  # 17 blocks of 128 KiB (the last of 1 row)
BUDGET = 1024 * 1024
OLDER = "f556ca1"  # main before the arena was merged: its daemon knows nothing of Acquire.arena
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_h5(tmp_path_factory.mktemp("arena-fallback") / "data.h5", rows=ROWS, row_shape=SHAPE)


def _epoch(h5: Path, runtime_dir: Path) -> np.ndarray:
    """One epoch's rows in the order a rank gets them (each batch's x checked against the file)."""
    with h5py.File(h5) as f:
        x = f["x"][:]
    ds = SharedH5Dataset(h5, "x", "y", rank=0, world_size=1, runtime_dir=runtime_dir, fallback="error",
                         mode="stream", window="512KiB", block_rows=BLOCK_ROWS, timeout=60)
    try:
        seen = []
        for xb, yb in make_loader(ds, 32, seed=0):
            rows = yb.numpy()
            np.testing.assert_array_equal(xb.numpy(), x[rows])
            seen.append(rows)
        assert ds.backend == "shm"
    finally:
        ds.close()
    order = np.concatenate(seen)
    np.testing.assert_array_equal(np.sort(order), np.arange(ROWS))
    return order


def _no_arena_file(d: Daemon) -> None:
    assert not [name for name in d.segment_files() if ARENA_MARK in name]


def test_a_daemon_started_without_arenas(h5: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Started without ``H5SERVE_ARENA=1``: its ping offers no arena, an ``Acquire.arena`` is
    refused (ProtocolError), and a client with the variable set streams a segment per block,
    the rows and order of a client without it."""
    monkeypatch.setenv(ARENA_ENV, "0")
    with running_daemon("--max-memory", str(BUDGET), "--loaders", "2") as d:
        with DaemonClient(d.runtime_dir) as client:
            assert "arena" not in client.ping()
            with pytest.raises(ProtocolError, match="offers no stream arenas"):
                client.acquire(Acquire(str(h5), "x", 1, 0, "stream", None, rows=(0, BLOCK_ROWS), arena=BLOCK_ROWS))
        without = _epoch(h5, d.runtime_dir)
        monkeypatch.setenv(ARENA_ENV, "1")
        asked = _epoch(h5, d.runtime_dir)
        np.testing.assert_array_equal(asked, without)
        _no_arena_file(d)
        status = d.status()
        assert status["arenas"]["arenas"] == 0 and status["arenas"]["loads"] == 0
        assert status["counters"]["loads"] >= -(-ROWS // BLOCK_ROWS)  # blocks loaded as segments


def test_an_arena_daemon_is_asked_for_arenas(h5: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other side of the capability: started with the variable, the ping offers the layout's
    version and a client with it set takes its blocks from arenas, the same rows in the same order."""
    monkeypatch.setenv(ARENA_ENV, "1")
    with running_daemon("--max-memory", str(BUDGET), "--loaders", "2") as d:
        with DaemonClient(d.runtime_dir) as client:
            assert client.ping()["arena"] == 1
        monkeypatch.setenv(ARENA_ENV, "0")
        without = _epoch(h5, d.runtime_dir)
        monkeypatch.setenv(ARENA_ENV, "1")
        np.testing.assert_array_equal(_epoch(h5, d.runtime_dir), without)
        assert d.status()["arenas"]["arenas"] == 2  # x and y


def _older_package(where: Path) -> Path:
    """h5serve as it was at OLDER, unpacked under ``where`` (skips outside a git checkout)."""
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", OLDER, "h5serve"], capture_output=True,
                                 timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"the older daemon's package comes from git commit {OLDER} of this checkout: {exc}")
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, timeout=60, check=True)
    return where


def test_an_older_daemon(h5: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon of the release before the arena (its ping has no "arena", its status no
    "arenas"), with the variable set on both sides: the client streams a segment per block, the
    rows and order of a client without the variable, and makes no arena."""
    older = _older_package(tmp_path)
    monkeypatch.setenv(ARENA_ENV, "1")
    d = Daemon("--max-memory", str(BUDGET), "--loaders", "2")
    d.env["PYTHONPATH"] = str(older)
    try:
        d.start()
        assert "arenas" not in d.status()  # the older code runs
        with DaemonClient(d.runtime_dir) as client:
            assert "arena" not in client.ping()
        asked = _epoch(h5, d.runtime_dir)
        monkeypatch.setenv(ARENA_ENV, "0")
        np.testing.assert_array_equal(asked, _epoch(h5, d.runtime_dir))
        _no_arena_file(d)
    finally:
        d.stop()


@root_only
def test_a_shared_daemon_offers_no_arena_and_a_member_streams_its_own_segments(
        public_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``--group`` daemon never offers arenas, whatever the variable: an arena is one file every
    stream of a (file, key) shares, and the daemon hands a member only descriptors of what it was
    granted (docs/security.md, *Stream arenas*). A member in stream mode gets the rows and order
    of a client without the variable, from segments it alone was handed, and no arena file exists."""
    h5 = make_h5(public_dir / "data.h5", rows=ROWS, row_shape=SHAPE)
    with throwaway_group() as group, throwaway_user((group,)) as member:
        monkeypatch.setenv(ARENA_ENV, "1")  # asked for, by the daemon and its clients
        d = Daemon("--group", group.name, "--max-memory", str(BUDGET), "--loaders", "2")
        d.dir.chmod(0o755)
        try:
            d.start()
            with DaemonClient(d.runtime_dir) as client:
                assert "arena" not in client.ping()
                with pytest.raises(ProtocolError, match="offers no stream arenas"):
                    client.acquire(Acquire(str(h5), "x", 1, 0, "stream", None, rows=(0, BLOCK_ROWS),
                                           arena=BLOCK_ROWS))
            runtime_dir = d.runtime_dir
            status, order = as_user(member, lambda: _epoch(h5, runtime_dir).tolist(), timeout=120)
            assert status == "ok", order
            monkeypatch.setenv(ARENA_ENV, "0")
            np.testing.assert_array_equal(np.asarray(order), _epoch(h5, runtime_dir))
            _no_arena_file(d)
        finally:
            d.stop()
