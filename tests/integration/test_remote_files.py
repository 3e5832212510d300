"""Many s3:// objects (a list or a pattern) as one dataset through the node's daemon (issue 34):
every object's rows fetched by ranged GETs into the one segment of the set, once per node, in
modes global, contiguous, interleave and node; stream mode's blocks each from the object holding
them. A real moto S3 server on loopback behind the counting proxy, a real daemon, real torchrun
ranks (fixtures: tests/integration/test_remote_daemon.py).

- the rows and order of the same files on disk, in every mode;
- 2 torchrun ranks on one daemon: GET bytes at the proxy about the rows' bytes once, not per rank;
- one object rewritten: SourceChanged for the old description, never the old segment nor a mix;
- a shared daemon fetches only under ``--allow-url``, every object of the set.
"""

from __future__ import annotations

import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from h5serve import AccessDenied, SourceChanged
from h5serve.client import SharedH5Dataset, make_loader
from h5serve.hdf5.remote import remote_identity
from h5serve.wire.connection import DaemonClient
from h5serve.wire.protocol import Acquire

from ..helpers import Daemon, torchrun_two_ranks
from .test_remote import BUCKET, FaultyProxy, every_row, rows_at, s3, s3_endpoint, upload  # noqa: F401 - fixtures
from .test_remote_daemon import allow_listed, daemon, proxy, use  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(240)

ROWS, SHAPE, PARTS = 3000, (32, 32), 3  # uint8: 3 MiB of x per object in 64-row chunks, 9 MiB in all
JOB = Path(__file__).parents[1] / "jobs" / "remote_job.py"


def make_part(path: Path, part: int, salt: int = 0, rows: int = ROWS) -> Path:
    first = part * rows
    x = ((np.arange(rows * 1024, dtype=np.int64).reshape(rows, *SHAPE) + part * 7 + salt) % 251).astype(np.uint8)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x, chunks=(64, *SHAPE))
        f.create_dataset("y", data=np.arange(first, first + rows, dtype=np.int64))
    return path


@pytest.fixture
def parts(tmp_path: Path) -> list[Path]:
    return [make_part(tmp_path / f"part_{i}.h5", i) for i in range(PARTS)]


def uploaded(s3: Any, parts: list[Path], prefix: str) -> str:  # noqa: F811
    for path in parts:
        upload(s3, path, f"{prefix}/{path.name}")
    return f"s3://{BUCKET}/{prefix}/part_*.h5"


def test_every_mode_gives_the_rows_and_order_of_the_files_on_disk(daemon: Daemon, s3: Any,  # noqa: F811
                                                                  parts: list[Path], proxy: FaultyProxy,  # noqa: F811
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    pattern = uploaded(s3, parts, "modes")
    use(daemon, monkeypatch)
    shapes = {"global": {}, "contiguous": {"rank": 1, "world_size": 3}, "interleave": {"rank": 2, "world_size": 3},
              "node": {"local_rank": 1, "local_world_size": 2, "node_rank": 1, "num_nodes": 2}}
    for mode, where in shapes.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # fetched by the daemon: no "read here" warning
            remote = SharedH5Dataset(pattern, "x", "y", mode=mode, fallback="error", **where)
        here = SharedH5Dataset([str(p) for p in parts], "x", "y", mode=mode, fallback="lazy", **where)
        assert remote.backend == "shm", mode
        assert len(remote.files) == PARTS
        np.testing.assert_array_equal(remote.indices, here.indices)
        for a, b in zip(every_row(remote), every_row(here)):
            np.testing.assert_array_equal(a, b)
        remote.close()
        here.close()
    status = daemon.status()
    assert status["remote"]["loads"] == 8  # x and y of each mode's rows, each one segment of the set
    verified = daemon.cli("status", "--verify")
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_stream_mode_over_many_objects_gives_the_batches_of_the_files_on_disk(
        daemon: Daemon, s3: Any, parts: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    pattern = uploaded(s3, parts, "stream")
    use(daemon, monkeypatch)
    stream = {"mode": "stream", "window": "2MiB", "block_rows": 512}
    remote = SharedH5Dataset(pattern, "x", "y", fallback="error", **stream)
    here = SharedH5Dataset([str(p) for p in parts], "x", "y", fallback="error", **stream)
    assert remote.backend == here.backend == "shm"
    got = [(np.asarray(x).copy(), np.asarray(y).copy()) for x, y in make_loader(remote, 250, seed=2)]
    want = [(np.asarray(x).copy(), np.asarray(y).copy()) for x, y in make_loader(here, 250, seed=2)]
    assert len(got) == len(want) and sum(len(y) for _, y in got) == PARTS * ROWS
    for (gx, gy), (wx, wy) in zip(got, want):
        np.testing.assert_array_equal(gy, wy)
        np.testing.assert_array_equal(gx, wx)
    remote.close()
    here.close()
    assert any(s["file"].startswith("s3://") and s["mode"] == "stream" for s in daemon.status()["segments"])


def test_two_ranks_fetch_the_objects_about_once(daemon: Daemon, s3: Any, proxy: FaultyProxy,  # noqa: F811
                                                tmp_path: Path) -> None:
    # 6 MiB objects: each object's HDF5 metadata (each rank's description, the daemon's inspections and loads of x
    # and y: about 0.2 MB per object in all) is a fixed cost per object; 3 MiB objects made it 1.063x
    parts = [make_part(tmp_path / f"part_{i}.h5", i, rows=2 * ROWS) for i in range(PARTS)]
    pattern = uploaded(s3, parts, "ddp")
    rows = PARTS * 2 * ROWS * (1024 + 8)
    before = proxy.get_bytes
    reports = torchrun_two_ranks(JOB, [pattern, str(tmp_path / "out")], tmp_path / "out", daemon.runtime_dir, 180)
    fetched = proxy.get_bytes - before
    expected: dict[int, int] = {}
    for path in parts:
        with h5py.File(path) as f:
            expected.update({int(label): zlib.crc32(row.tobytes()) for label, row in zip(f["y"][:], f["x"][:])})
    seen: dict[int, int] = {}
    for report in reports:
        assert report["backend"] == "shm" and report["rows"] == PARTS * 2 * ROWS
        seen.update({int(k): v for k, v in report["seen"].items()})
    assert seen == expected
    status = daemon.status()["remote"]
    print(f"{PARTS} objects, 2 ranks, global: {fetched:,} GET bytes for {rows:,} bytes of rows "
          f"({fetched / rows:.3f}x); the daemon fetched {status['fetched_bytes']:,} in {status['loads']} loads")
    assert fetched <= 1.05 * rows, f"{fetched / rows:.3f}x the rows: fetched more than once per node"


def test_a_rewritten_object_of_the_set_is_source_changed(daemon: Daemon, s3: Any, parts: list[Path],  # noqa: F811
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pattern = uploaded(s3, parts, "rewrite")
    use(daemon, monkeypatch)
    first = SharedH5Dataset(pattern, "x", "y", mode="global", fallback="error")
    assert first.backend == "shm"
    urls = list(first.files)
    old = [remote_identity(u) for u in urls]
    upload(s3, make_part(tmp_path / "newer.h5", 1, salt=9), "rewrite/part_1.h5")
    with DaemonClient(str(daemon.runtime_dir)) as client, pytest.raises(SourceChanged, match="changed since"):
        client.acquire(Acquire(urls[0], "x", 1, 0, "global", files=tuple(urls),
                               pins=tuple((i.size, i.etag, i.version_id) for i in old)),
                       deadline=time.monotonic() + 60)
    fresh = SharedH5Dataset(pattern, "x", "y", mode="global", fallback="error")
    assert fresh.backend == "shm"
    newer = make_part(tmp_path / "newer_again.h5", 1, salt=9)
    with h5py.File(newer) as f:
        want = f["x"][:10]
    x, y = rows_at(fresh, np.arange(ROWS, ROWS + 10))
    np.testing.assert_array_equal(x, want)  # the new object's rows, in the new segment
    np.testing.assert_array_equal(y, np.arange(ROWS, ROWS + 10))
    first.close()
    fresh.close()


def test_a_shared_daemon_fetches_a_set_only_under_its_allow_list(s3: Any, parts: list[Path],  # noqa: F811
                                                                 proxy: FaultyProxy,  # noqa: F811
                                                                 allow_listed: Daemon) -> None:  # noqa: F811
    d = allow_listed
    allowed = uploaded(s3, parts, "allowed")
    upload(s3, parts[0], "elsewhere/part_0.h5")
    mixed = [f"s3://{BUCKET}/allowed/part_1.h5", f"s3://{BUCKET}/elsewhere/part_0.h5"]
    assert SharedH5Dataset(allowed, "x", "y", mode="global", fallback="error").backend == "shm"
    with pytest.raises(AccessDenied, match="--allow-url") as info:
        SharedH5Dataset(mixed, "x", "y", mode="global", fallback="error")
    assert mixed[1] in str(info.value)
    with pytest.warns(RuntimeWarning, match="--allow-url"):  # read here, with the job's own credentials
        assert SharedH5Dataset(mixed, "x", "y", mode="global").backend == "lazy"
    assert not [s for s in d.status()["segments"] if s["file"] == mixed[0]]
