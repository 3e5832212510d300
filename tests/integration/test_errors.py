"""Every bad input a user can hit gives an H5ServeError subclass that says what to do, on
both backends, and the daemon keeps serving afterwards."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import msgpack
import numpy as np
import pytest
import zmq

from h5serve.client import H5LazyDataset, RankMemCachedH5Dataset, SharedH5Dataset
from h5serve.errors import (
    ERROR_CODES,
    BudgetExceeded,
    ConfigError,
    DataError,
    H5ServeError,
    KeyNotFound,
    LengthMismatch,
    RemoteError,
    ShmFull,
    SourceNotFound,
    UnsupportedDataset,
    error_from_code,
    falls_back,
)

from ..helpers import Daemon, damaged_header, short_tmpdir, tmpfs, truncated


@pytest.fixture(scope="module")
def bad_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bad") / "bad.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros((100, 2), dtype=np.float32)
        f["y_short"] = np.zeros(99, dtype=np.int64)
        f["scalar"] = 3.0
        f["strings"] = np.array([b"a", b"b"] * 50)
        f.create_dataset("vlen", shape=(100,), dtype=h5py.vlen_dtype(np.dtype([("a", "<i4"), ("b", "<f8")])))
        f["compound"] = np.zeros(100, dtype=[("a", "<i4"), ("b", "<f8")])
        f.create_group("grp/inner")
    return path


@pytest.fixture(params=["daemon", "lazy"])
def where(request: pytest.FixtureRequest, shared_daemon: Daemon, no_daemon_env: Path) -> dict:
    if request.param == "daemon":
        return {"runtime_dir": shared_daemon.runtime_dir, "fallback": "error"}
    return {"fallback": "lazy"}


CASES = [
    ("x", "y_short", LengthMismatch, "100 rows.*99"),
    ("missing", None, KeyNotFound, "'missing' is not in .*datasets there: .*x"),
    ("scalar", None, UnsupportedDataset, "scalar"),
    ("vlen", None, UnsupportedDataset, "'vlen'.*variable-length sequences of a compound type"),
    ("compound", None, UnsupportedDataset, "dtype"),
    ("grp", None, KeyNotFound, "group"),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("x_key,y_key,error,match", CASES)
def test_bad_dataset(bad_file: Path, where: dict, x_key: str, y_key, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        SharedH5Dataset(bad_file, x_key, y_key, rank=0, world_size=1, **where)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_missing_file(tmp_path: Path, where: dict) -> None:
    with pytest.raises(SourceNotFound, match="nope.h5"):
        SharedH5Dataset(tmp_path / "nope.h5", "x", **where)
    (tmp_path / "text.h5").write_text("not hdf5")
    with pytest.raises(SourceNotFound, match="cannot be opened as an HDF5 file"):
        SharedH5Dataset(tmp_path / "text.h5", "x", **where)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_truncated_and_damaged_files_say_so(tmp_path: Path, where: dict) -> None:
    """From the daemon as from h5py: a DataError saying truncated (or damaged) and what to do,
    not a SourceNotFound or KeyNotFound."""
    cut, _, _ = truncated(tmp_path)
    for mode in ("global", "stream"):
        with pytest.raises(DataError, match="is truncated.*copy or write it again") as caught:
            SharedH5Dataset(cut, "x", "y", mode=mode, rank=0, world_size=1, **where)
        assert not isinstance(caught.value, SourceNotFound)
    with pytest.raises(DataError, match="key 'x'.*exists but cannot be opened.*the file is damaged") as caught:
        SharedH5Dataset(damaged_header(tmp_path), "x", "y", mode="global", rank=0, world_size=1, **where)
    assert not isinstance(caught.value, KeyNotFound)


def test_a_truncated_file_is_not_read_lazily_after_the_daemon_refused_it(tmp_path: Path,
                                                                         shared_daemon: Daemon) -> None:
    """The daemon's DataError does not fall back (h5py would fail the same way): no fallback warning."""
    import warnings

    cut, _, _ = truncated(tmp_path)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(DataError, match="is truncated"):
        warnings.simplefilter("always")
        SharedH5Dataset(cut, "x", "y", mode="global", rank=0, world_size=1, runtime_dir=shared_daemon.runtime_dir)
    assert [str(w.message) for w in caught if "lazily" in str(w.message)] == []


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"mode": "striped"}, "mode must be one of"),
        ({"world_size": 0, "rank": 0}, "world_size must be >= 1"),
        ({"world_size": 2, "rank": 2}, r"rank must be in \[0, 1\]"),
        ({"world_size": 2, "rank": -1}, r"rank must be in \[0, 1\]"),
        ({"dtype_x": "notadtype"}, "not a numpy dtype"),
        ({"dtype_x": "U4"}, "not a numeric dtype"),
        ({"fallback": "maybe"}, "fallback must be one of"),
    ],
)
def test_bad_arguments(bad_file: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SharedH5Dataset(bad_file, "x", **kwargs)


def test_bad_rank_from_environment(bad_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="rank must be in"):
        SharedH5Dataset(bad_file, "x")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_seed_classes_raise_the_same_errors(bad_file: Path, no_daemon_env: Path) -> None:
    with pytest.raises(KeyNotFound):
        H5LazyDataset(str(bad_file), "missing")
    with pytest.raises(LengthMismatch):
        H5LazyDataset(str(bad_file), "x", "y_short")
    with pytest.raises(UnsupportedDataset):
        RankMemCachedH5Dataset(str(bad_file), "strings", log_fn=lambda _: None)


def test_daemon_survives_malformed_frames(shared_daemon: Daemon) -> None:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"ipc://{shared_daemon.runtime_dir}/h5serve.sock")
        garbage = [
            b"", b"\xc1", os.urandom(100), msgpack.packb([1, 2]), msgpack.packb({"v": 1, "id": 1, "op": "nope"}),
            msgpack.packb({"v": 1, "id": 2, "op": "acquire", "path": 5}),
            msgpack.packb({"v": 99, "id": 3, "op": "ping"}),
            msgpack.packb({"v": 1, "id": 4, "op": "acquire", "path": "/x", "key": "k", "world_size": 2, "rank": 5}),
            b"\xdb\xff\xff\xff\xff",  # str of 4 GiB declared
        ]
        for frame in garbage:
            sock.send(frame)
            assert sock.poll(5000), f"no reply to {frame[:20]!r}"
            reply = msgpack.unpackb(sock.recv())
            assert reply["ok"] is False and reply["code"] == "protocol", reply
        sock.send_multipart([b"a", b"b", b"c"])
        assert sock.poll(5000) and msgpack.unpackb(sock.recv())["code"] == "protocol"
    finally:
        ctx.destroy(linger=0)
    assert shared_daemon.status()["running"] is True


def test_budget_exceeded_falls_back_or_raises(tmp_path: Path) -> None:
    path = tmp_path / "big.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.ones((1000, 256), dtype=np.uint8)
    d = Daemon("--max-memory", "64K").start()
    try:
        with pytest.raises(BudgetExceeded, match="--max-memory") as refused:
            SharedH5Dataset(path, "x", runtime_dir=d.runtime_dir, fallback="error")
        # nothing is in use: the message says what was needed against the whole budget, not "the rest is in use"
        assert "more than the daemon's whole budget of 64.0 KiB" in str(refused.value)
        assert "in use" not in str(refused.value)
        with pytest.warns(RuntimeWarning, match="budget"):
            ds = SharedH5Dataset(path, "x", runtime_dir=d.runtime_dir)
        assert ds.backend == "lazy" and int(ds[999].sum()) == 256
        assert d.status()["counters"]["refusals"] >= 2
        # 40 KB held by a job, then 40 KB more: fits the budget alone, not beside the first
        for name in ("half.h5", "other.h5"):
            with h5py.File(tmp_path / name, "w") as f:
                f["x"] = np.ones((2, 20_000), dtype=np.uint8)
        held = SharedH5Dataset(tmp_path / "half.h5", "x", runtime_dir=d.runtime_dir, fallback="error")
        with pytest.raises(BudgetExceeded) as refused:
            SharedH5Dataset(tmp_path / "other.h5", "x", runtime_dir=d.runtime_dir, fallback="error")
        assert "held by segments jobs are using" in str(refused.value) and held.backend == "shm"
    finally:
        d.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_full_shm_filesystem_is_a_clear_error_not_sigbus(tmp_path: Path) -> None:
    with tmpfs("1m") as mnt:
        d = Daemon("--shm-dir", str(mnt), "--max-memory", "1G")
        try:
            d.start()
            path = tmp_path / "big.h5"
            with h5py.File(path, "w") as f:
                f["x"] = np.ones((4096, 1024), dtype=np.uint8)  # 4 MiB > 1 MiB tmpfs
            with pytest.raises(ShmFull, match=r"needs 4\.0 MiB, .* free"):
                SharedH5Dataset(path, "x", runtime_dir=d.runtime_dir, fallback="error")
            with pytest.warns(RuntimeWarning):
                ds = SharedH5Dataset(path, "x", runtime_dir=d.runtime_dir)
            assert ds.backend == "lazy" and ds[0].shape == (1024,)
            assert os.listdir(mnt) == []  # the failed temporary was removed
            assert d.status()["running"] is True
        finally:
            d.stop()


def test_every_error_is_an_h5serve_error() -> None:
    for cls in (BudgetExceeded, ConfigError, KeyNotFound, LengthMismatch, ShmFull, SourceNotFound, UnsupportedDataset):
        assert issubclass(cls, H5ServeError)


# Which daemon errors a client with fallback="lazy" reads lazily after, class by class. A new
# error class fails these tests until it is classified here (and, if it differs from its
# parent, by its ``falls_back`` in errors.py).
FALLS_BACK = {
    "H5ServeError": True, "ConfigError": False, "DataError": False, "SourceNotFound": True,
    "KeyNotFound": False, "UnsupportedDataset": False, "LengthMismatch": False, "SourceChanged": True,
    "AccessDenied": True, "CapacityError": True, "ShmFull": True, "BudgetExceeded": True, "SegmentError": True,
    "DaemonUnavailable": True, "UntrustedDaemon": True, "DaemonAlreadyRunning": True, "HostError": True,
    "AddressInUse": True, "NoPermission": True, "OutOfResources": True, "ProtocolError": True,
    "RemoteError": True, "ObjectNotFound": True, "ObjectAccessDenied": True, "ObjectStoreError": True,
}


def _every_module_imported() -> None:
    """Import every h5serve module, so that an error class defined outside errors.py is a
    subclass the enumeration below can see."""
    import importlib
    import pkgutil

    import h5serve

    for module in pkgutil.walk_packages(h5serve.__path__, "h5serve."):
        if not module.name.endswith("__main__"):  # `python -m` entry points run the CLI on import
            importlib.import_module(module.name)


def _subclasses(cls: type) -> list[type]:
    """``cls`` and every class below it, by ``__subclasses__``, recursively."""
    found = [cls]
    for sub in cls.__subclasses__():
        found += [c for c in _subclasses(sub) if c not in found]
    return found


_every_module_imported()
EVERY_ERROR = _subclasses(H5ServeError)


@pytest.mark.parametrize("cls", EVERY_ERROR, ids=lambda c: c.__name__)
def test_every_error_class_is_classified_and_on_the_wire(cls: type[H5ServeError]) -> None:
    assert cls.__name__ in FALLS_BACK, (
        f"{cls.__module__}.{cls.__name__} is a new error: decide whether a client with fallback='lazy' reads "
        "lazily after it (set falls_back in errors.py if it differs from its parent) and add it to FALLS_BACK"
    )
    assert falls_back(cls("x")) is FALLS_BACK[cls.__name__]
    assert cls.__module__ == "h5serve.errors", "every error class lives in errors.py, in its tree"
    assert "code" in vars(cls) and ERROR_CODES[cls.code] is cls, f"{cls.__name__} needs a wire code of its own"
    assert type(error_from_code(cls.code, "m")) is cls


def test_the_tree_in_errors_py_draws_every_class_where_it_is() -> None:
    """The tree at the top of errors.py is the map a reader uses: every class on it, at its depth."""
    import re

    import h5serve.errors as errors_module

    columns = {m.group(2): len(m.group(1)) for m in
               re.finditer(r"^( *(?:[│ ]   )*(?:[├└]── )?)(\w+) ", errors_module.__doc__ or "", re.M)}
    for cls in EVERY_ERROR:
        depth = sum(1 for c in cls.__mro__ if issubclass(c, H5ServeError)) - 1
        assert cls.__name__ in columns, f"draw {cls.__name__} in the tree at the top of errors.py"
        assert columns[cls.__name__] == 4 + 4 * depth, f"{cls.__name__} is drawn at the wrong depth"
    assert set(FALLS_BACK) == {c.__name__ for c in EVERY_ERROR}, "FALLS_BACK names a class that is gone"


class ErrorDaemon:
    """A peer that speaks the real protocol on a real runtime dir (socket, locked pidfile) and
    answers every request with one error code: the only way to meet every code a daemon can
    send, since a healthy daemon sends few of them."""

    def __init__(self, code: str) -> None:
        import fcntl
        import threading

        from h5serve.wire.protocol import decode_request, encode_error

        self.dir = short_tmpdir("h5s-err-")
        self.dir.chmod(0o700)
        self._lock = os.open(self.dir / "h5serve.pid", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.bind(f"ipc://{self.dir}/h5serve.sock")
        self._stop = threading.Event()

        def serve() -> None:
            while not self._stop.is_set():
                if sock.poll(50):
                    identity, frame = sock.recv_multipart()
                    request_id, _ = decode_request(frame)
                    sock.send_multipart([identity, encode_error(request_id, code, f"daemon says {code}")])
            sock.close(linger=0)

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()

    def close(self) -> None:
        import shutil

        self._stop.set()
        self._thread.join(10)
        self._ctx.term()
        os.close(self._lock)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.mark.parametrize("cls", EVERY_ERROR, ids=lambda c: c.__name__)
def test_every_daemon_error_falls_back_or_raises_as_errors_py_decides(cls: type[H5ServeError],
                                                                     tmp_path: Path) -> None:
    import warnings

    code = cls.code
    assert cls.__name__ in FALLS_BACK, f"classify {cls.__name__} in FALLS_BACK and errors.py"
    assert falls_back(cls("x")) is FALLS_BACK[cls.__name__]
    data = tmp_path / "data.h5"
    with h5py.File(data, "w") as f:
        f["x"] = np.arange(12, dtype=np.float32).reshape(6, 2)
    daemon = ErrorDaemon(code)
    try:
        if FALLS_BACK[cls.__name__]:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ds = SharedH5Dataset(data, "x", runtime_dir=daemon.dir, timeout=5)
            assert ds.backend == "lazy" and ds[5].tolist() == [10.0, 11.0]
            assert any(f"daemon says {code}" in str(w.message) for w in caught)
        else:
            with pytest.raises(cls, match=f"daemon says {code}"):
                SharedH5Dataset(data, "x", runtime_dir=daemon.dir, timeout=5)
        with pytest.raises(cls, match=f"daemon says {code}"):
            SharedH5Dataset(data, "x", runtime_dir=daemon.dir, timeout=5, fallback="error")
    finally:
        daemon.close()


def test_an_unknown_error_code_is_a_remote_error_and_falls_back() -> None:
    """A newer daemon's code this client does not know: RemoteError, read lazily."""
    assert type(error_from_code("from-the-future", "?")) is RemoteError and falls_back(RemoteError("?"))
