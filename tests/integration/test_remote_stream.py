"""Stream mode over one s3:// object through the node's daemon (issue 34): each block of the
window fetched by the daemon with ranged GETs straight into its segment, once per node. A real
moto S3 server on loopback behind the counting proxy, a real daemon (``h5serve start``), real
torchrun ranks (tests/integration/test_remote_daemon.py has the fixtures and global mode).

- the batches, rows and order of the file on disk, with and without a daemon;
- 2 torchrun ranks on one daemon: the GET bytes at the proxy about the blocks' bytes once, not per rank;
- an object rewritten mid-epoch: SourceChanged at the next block, never rows of both versions;
- a shared daemon fetches only under ``--allow-url``: elsewhere AccessDenied with fallback="error",
  the warning and reads here with fallback="lazy", as in global mode;
- forked and spawned DataLoader workers, and a global dataset the daemon has no room for
  (streamed automatically): the batches of the file on disk.
"""

from __future__ import annotations

import warnings
import zlib
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from h5serve import AccessDenied, SourceChanged
from h5serve.client import SharedH5Dataset, make_loader

from ..helpers import Daemon, torchrun_two_ranks
from .test_remote import BUCKET, FaultyProxy, s3, s3_endpoint, upload  # noqa: F401 - fixtures
from .test_remote_daemon import ROWS, allow_listed, daemon, local, make_file, proxy, use  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(240)

JOB = Path(__file__).parents[1] / "jobs" / "remote_job.py"
STREAM = {"mode": "stream", "window": "4MiB", "block_rows": 1024}  # 1 MiB blocks of x, 12 of them, 4 at once


def batches(ds: SharedH5Dataset, seed: int = 3) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.asarray(x).copy(), np.asarray(y).copy()) for x, y in make_loader(ds, 200, seed=seed)]


def test_stream_mode_gives_the_batches_of_the_file_on_disk_with_and_without_a_daemon(
        daemon: Daemon, s3: Any, local: Path, proxy: FaultyProxy,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    url = upload(s3, local, "stream/train.h5")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no daemon: read here, said by a warning
        alone = SharedH5Dataset(local, "x", "y", fallback="lazy", **STREAM)
        assert alone.backend == "lazy"
        want = batches(alone)
        alone.close()
    use(daemon, monkeypatch)
    here = SharedH5Dataset(local, "x", "y", fallback="error", **STREAM)
    assert here.backend == "shm"
    assert all((a[0] == b[0]).all() and (a[1] == b[1]).all() for a, b in zip(batches(here), want))
    here.close()
    before = proxy.get_bytes
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # fetched by the daemon: no "read here" warning
        remote = SharedH5Dataset(url, "x", "y", fallback="error", **STREAM)
    assert remote.backend == "shm"
    got = batches(remote)
    assert len(got) == len(want) and sum(len(y) for _, y in got) == ROWS
    for (gx, gy), (wx, wy) in zip(got, want):
        np.testing.assert_array_equal(gy, wy)
        np.testing.assert_array_equal(gx, wx)
    again = batches(remote, seed=4)  # another epoch's order: blocks fetched again as the window slides
    assert sorted(np.concatenate([y for _, y in again]).tolist()) == list(range(ROWS))
    remote.close()
    status = daemon.status()
    streamed = [s for s in status["segments"] if s["file"] == url and s["mode"] == "stream"]
    assert streamed, "no stream block of the object went through the daemon"
    print(f"stream, 2 epochs: {proxy.get_bytes - before:,} GET bytes; daemon: {status['remote']}")


def test_two_ranks_fetch_each_block_once_per_node(daemon: Daemon, s3: Any, local: Path,  # noqa: F811
                                                  proxy: FaultyProxy, tmp_path: Path) -> None:  # noqa: F811
    url = upload(s3, local, "stream-ddp/train.h5")
    data = ROWS * (1024 + 8)  # the rows of x and y: every block is used once in the epoch
    before, heads = proxy.get_bytes, proxy.methods.get("HEAD", 0)
    job_args = [url, str(tmp_path / "out"), "--mode", "stream", "--batch", "128"]
    reports = torchrun_two_ranks(JOB, job_args, tmp_path / "out", daemon.runtime_dir, 180)
    fetched = proxy.get_bytes - before
    with h5py.File(local) as f:
        x = f["x"][:]
    ranks = [{int(k): v for k, v in r["seen"].items()} for r in reports]
    assert all(r["backend"] == "shm" for r in reports)
    assert not set(ranks[0]) & set(ranks[1])  # each row to one rank
    assert {**ranks[0], **ranks[1]} == {i: zlib.crc32(x[i].tobytes()) for i in range(ROWS)}
    status = daemon.status()
    blocks = [s for s in status["segments"] if s["file"] == url and s["mode"] == "stream"]
    print(f"stream, 2 ranks: {fetched:,} GET bytes for {data:,} bytes of rows ({fetched / data:.3f}x); the daemon "
          f"fetched {status['remote']['fetched_bytes']:,} in {status['remote']['loads']} loads; "
          f"{proxy.methods.get('HEAD', 0) - heads} HEAD requests; {len(blocks)} block segments")
    assert fetched <= 1.1 * data, f"{fetched / data:.3f}x the rows: blocks fetched more than once per node"
    assert fetched >= data  # every block was fetched (nothing read from elsewhere)


def test_an_object_rewritten_mid_epoch_is_source_changed_never_a_mix(
        daemon: Daemon, s3: Any, local: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    url = upload(s3, local, "stream-rewrite/train.h5")
    use(daemon, monkeypatch)
    newer = make_file(tmp_path / "newer.h5", salt=5)
    with h5py.File(local) as f:
        old = f["x"][:]
    ds = SharedH5Dataset(url, "x", "y", fallback="error", **STREAM)
    assert ds.backend == "shm"
    seen = 0
    with pytest.raises(SourceChanged, match="changed since"):
        for step, (x, y) in enumerate(make_loader(ds, 200, seed=3)):
            np.testing.assert_array_equal(np.asarray(x), old[np.asarray(y)])  # the old version's rows, only
            seen += len(y)
            if step == 2:
                upload(s3, newer, "stream-rewrite/train.h5")
    assert 600 <= seen < ROWS  # it stopped within the epoch, at a block not yet asked for
    ds.close()


def test_a_shared_daemon_streams_only_under_its_allow_list(s3: Any, local: Path, proxy: FaultyProxy,  # noqa: F811
                                                           allow_listed: Daemon) -> None:  # noqa: F811
    d = allow_listed
    allowed = upload(s3, local, "allowed/train.h5")
    other = upload(s3, local, "elsewhere/train.h5")
    ok = SharedH5Dataset(allowed, "x", "y", fallback="error", **STREAM)
    assert ok.backend == "shm"
    ok.close()
    with pytest.raises(AccessDenied, match="--allow-url") as info:
        SharedH5Dataset(other, "x", "y", fallback="error", **STREAM)
    assert other in str(info.value)
    with pytest.warns(RuntimeWarning, match="--allow-url"):  # read here, with the job's own credentials
        here = SharedH5Dataset(other, "x", "y", **STREAM)
    assert here.backend == "lazy"
    assert sum(len(y) for _, y in make_loader(here, 500, seed=1)) == ROWS
    here.close()
    assert not [s for s in d.status()["segments"] if s["file"] == other]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_stream_the_object_as_the_file_on_disk(
        daemon: Daemon, s3: Any, local: Path, proxy: FaultyProxy, context: str,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Stream mode over an object with 2 DataLoader workers (forked or spawned, each its own
    client of the daemon): the batches of the same file on disk through the same daemon with the
    same workers (two epochs with forked workers)."""
    url = upload(s3, local, f"stream-workers-{context}/train.h5")
    use(daemon, monkeypatch)
    workers = {"num_workers": 2, "multiprocessing_context": context}
    here = SharedH5Dataset(local, "x", "y", fallback="error", **STREAM)
    remote = SharedH5Dataset(url, "x", "y", fallback="error", **STREAM)
    try:
        assert here.backend == remote.backend == "shm"
        for seed in (3, 4) if context == "fork" else (3,):  # spawned workers start in seconds each
            want = [(np.asarray(x), np.asarray(y)) for x, y in make_loader(here, 200, seed=seed, **workers)]
            got = [(np.asarray(x), np.asarray(y)) for x, y in make_loader(remote, 200, seed=seed, **workers)]
            assert len(got) == len(want) and sorted(np.concatenate([y for _, y in got]).tolist()) == list(range(ROWS))
            for (gx, gy), (wx, wy) in zip(got, want):
                np.testing.assert_array_equal(gy, wy)
                np.testing.assert_array_equal(gx, wx)
    finally:
        here.close()
        remote.close()
    streamed = [s for s in daemon.status()["segments"] if s["file"] == url and s["mode"] == "stream"]
    assert streamed, "the workers' blocks of the object did not go through the daemon"


def test_a_global_object_the_daemon_has_no_room_for_is_streamed_as_the_file_on_disk(
        s3: Any, local: Path, proxy: FaultyProxy, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Automatic stream mode for an object: a daemon whose budget (6 MiB) is half the object's
    rows streams a ``mode="global"`` dataset with the warning, in the order the same file on
    disk gets from the same daemon, every row once."""
    url = upload(s3, local, "auto/train.h5")
    d = Daemon("--allow-url", f"s3://{BUCKET}/", "--max-memory", "6MiB")
    try:
        d.start()
        use(d, monkeypatch)
        opened = []
        for path in (local, url):
            with pytest.warns(RuntimeWarning, match=r"more than the daemon's budget of 6.0 MiB: streaming it instead"):
                ds = SharedH5Dataset(path, "x", "y", mode="global", rank=0, world_size=1, fallback="error")
            opened.append(ds)
            assert ds.mode == "stream" and ds.requested_mode == "global" and ds.backend == "shm"
        here, remote = opened
        want, got = batches(here), batches(remote)
        assert sorted(np.concatenate([y for _, y in got]).tolist()) == list(range(ROWS))
        assert len(got) == len(want)
        for (gx, gy), (wx, wy) in zip(got, want):
            np.testing.assert_array_equal(gy, wy)
            np.testing.assert_array_equal(gx, wx)
        for ds in opened:
            ds.close()
        memory = d.status()["memory"]
        assert memory["used"] <= memory["budget"]
    finally:
        d.stop()
