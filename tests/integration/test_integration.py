"""The client against a real daemon process: bytes, workers, isolation, fallback, stop."""

from __future__ import annotations

import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from h5serve.client import EpochShuffleSampler, SharedH5Dataset, collate
from h5serve.errors import DaemonUnavailable
from h5serve.wire.connection import DaemonClient

from ..helpers import Daemon, h5serve_cli, make_h5, running_daemon


def expected(path: Path, key: str, indices: np.ndarray, dtype=None) -> np.ndarray:
    with h5py.File(path, "r") as f:
        data = f[key][...][indices]
    return data if dtype is None else data.astype(dtype)


@pytest.mark.parametrize("mode", ["contiguous", "interleave"])
@pytest.mark.parametrize("dtype_x", [None, np.float32, np.float16])
def test_shm_bytes_equal_h5py(shared_daemon: Daemon, h5file: Path, mode: str, dtype_x) -> None:
    for rank in range(3):
        ds = SharedH5Dataset(h5file, "x", "y", mode=mode, rank=rank, world_size=3, dtype_x=dtype_x,
                             runtime_dir=shared_daemon.runtime_dir, fallback="error")
        assert ds.backend == "shm"
        want = expected(h5file, "x", ds.indices, dtype_x)
        batch = collate(ds.__getitems__(list(range(len(ds)))))
        assert batch[0].numpy().dtype == want.dtype
        assert batch[0].numpy().tobytes() == want.tobytes()
        assert batch[1].tolist() == ds.indices.tolist()  # labels are row ids
        x, y = ds[len(ds) - 1]
        assert x.numpy().tobytes() == want[-1].tobytes() and int(y) == ds.indices[-1]
        ds.close()


def test_shards_partition_rows_and_cast_keeps_narrow_segment(shared_daemon: Daemon, h5file: Path) -> None:
    seen = []
    for rank in range(4):
        ds = SharedH5Dataset(h5file, "x", "y", rank=rank, world_size=4, dtype_x="float32",
                             runtime_dir=shared_daemon.runtime_dir)
        seen.extend(ds.indices.tolist())
    assert sorted(seen) == list(range(1000))
    segments = [s for s in shared_daemon.status()["segments"] if s["key"] == "x" and s["world_size"] == 4]
    assert len(segments) == 4 and {s["dtype"] for s in segments} == {"uint8"}  # cast per batch, not in shm


def test_default_collate_and_fast_collate_agree(shared_daemon: Daemon, h5file: Path) -> None:
    ds = SharedH5Dataset(h5file, "x", "y", rank=0, world_size=2, runtime_dir=shared_daemon.runtime_dir)
    sampler = EpochShuffleSampler(len(ds), seed=3)
    plain = list(DataLoader(ds, batch_size=64, sampler=sampler))
    fast = list(DataLoader(ds, batch_size=64, sampler=sampler, collate_fn=collate))
    assert len(plain) == len(fast) == 8
    for (xa, ya), (xb, yb) in zip(plain, fast):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    order = torch.cat([y for _, y in fast]).tolist()
    assert order == ds.indices[list(sampler)].tolist()


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_dataloader_workers(shared_daemon: Daemon, h5file: Path, context: str) -> None:
    ds = SharedH5Dataset(h5file, "x", "y", mode="interleave", rank=1, world_size=2,
                         runtime_dir=shared_daemon.runtime_dir)
    sampler = EpochShuffleSampler(len(ds), seed=7)
    sampler.set_epoch(1)
    loader = DataLoader(ds, batch_size=50, sampler=sampler, num_workers=2, multiprocessing_context=context,
                        collate_fn=collate, timeout=60)
    xs, ys = zip(*loader)
    order = ds.indices[list(sampler)]
    assert torch.cat(ys).tolist() == order.tolist()
    assert torch.cat(xs).numpy().tobytes() == expected(h5file, "x", order).tobytes()


def _zero_in_place(x: torch.Tensor) -> torch.Tensor:
    return x.mul_(0)


def test_in_place_transform_never_reaches_other_readers(shared_daemon: Daemon, h5file: Path) -> None:
    kwargs = dict(rank=0, world_size=1, runtime_dir=shared_daemon.runtime_dir)
    mutating = SharedH5Dataset(h5file, "x", "y", transform=_zero_in_place, **kwargs)
    clean = SharedH5Dataset(h5file, "x", "y", **kwargs)
    want = expected(h5file, "x", np.arange(1000))
    for context in ("fork", "spawn"):
        loader = DataLoader(mutating, batch_size=100, num_workers=2, multiprocessing_context=context, timeout=60)
        assert all(int(x.abs().sum()) == 0 for x, _ in loader)
    x, _ = mutating[5]
    assert int(x.abs().sum()) == 0
    sample, _ = clean[5]
    sample.add_(1)  # writing to a returned sample is allowed and stays private
    assert clean[5][0].numpy().tobytes() == want[5].tobytes()
    assert collate(clean.__getitems__(list(range(1000))))[0].numpy().tobytes() == want.tobytes()


def test_fallback_to_lazy_gives_same_rows_and_order(shared_daemon: Daemon, h5file: Path, no_daemon_env: Path) -> None:
    shm = SharedH5Dataset(h5file, "x", "y", mode="interleave", rank=2, world_size=3, dtype_x=np.float32,
                          runtime_dir=shared_daemon.runtime_dir)
    with pytest.warns(RuntimeWarning, match=str(no_daemon_env)):
        lazy = SharedH5Dataset(h5file, "x", "y", mode="interleave", rank=2, world_size=3, dtype_x=np.float32)
    assert (shm.backend, lazy.backend) == ("shm", "lazy")
    assert np.array_equal(shm.indices, lazy.indices)
    sampler = EpochShuffleSampler(len(shm), seed=11)
    for a, b in zip(DataLoader(shm, batch_size=37, sampler=sampler), DataLoader(lazy, batch_size=37, sampler=sampler)):
        assert a[0].numpy().tobytes() == b[0].numpy().tobytes() and torch.equal(a[1], b[1])
    for i in (0, 5, -1):
        assert shm[i][0].numpy().tobytes() == lazy[i][0].numpy().tobytes()


def test_fallback_error_raises(h5file: Path, no_daemon_env: Path) -> None:
    with pytest.raises(DaemonUnavailable, match="h5serve start"):
        SharedH5Dataset(h5file, "x", "y", fallback="error")


def test_stale_socket_without_daemon_falls_back_fast(h5file: Path, no_daemon_env: Path) -> None:
    (no_daemon_env / "h5serve.sock").touch()  # left behind by a SIGKILLed daemon
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = SharedH5Dataset(h5file, "x", "y", timeout=30)
    assert ds.backend == "lazy" and any("no h5serve daemon" in str(w.message) for w in caught)


def test_stop_mid_iteration_keeps_attached_dataset_working(h5file: Path) -> None:
    d = Daemon().start()
    try:
        ds = SharedH5Dataset(h5file, "x", "y", rank=0, world_size=1, runtime_dir=d.runtime_dir)
        assert ds.backend == "shm" and d.segment_files()
        loader = DataLoader(ds, batch_size=100, collate_fn=collate)
        it = iter(loader)
        got = [next(it) for _ in range(3)]
        assert h5serve_cli("stop", env=d.env).returncode == 0
        assert d.segment_files() == []  # unlinked, but our mapping stays valid
        got += list(it)
        xs = torch.cat([x for x, _ in got])
        assert xs.numpy().tobytes() == expected(h5file, "x", np.arange(1000)).tobytes()
        # spawned workers can no longer map the segments by name: they read the same rows lazily
        spawn = DataLoader(ds, batch_size=100, num_workers=2, multiprocessing_context="spawn", collate_fn=collate,
                           timeout=60)
        assert torch.cat([y for _, y in spawn]).tolist() == list(range(1000))
    finally:
        d.stop()


def test_second_job_attaches_without_reloading(shared_daemon: Daemon, tmp_path: Path) -> None:
    path = make_h5(tmp_path / "again.h5")
    SharedH5Dataset(path, "x", rank=0, world_size=1, runtime_dir=shared_daemon.runtime_dir).close()
    before = shared_daemon.status()["counters"]
    ds = SharedH5Dataset(path, "x", rank=0, world_size=1, runtime_dir=shared_daemon.runtime_dir)
    after = shared_daemon.status()["counters"]
    assert ds.backend == "shm"
    assert after.get("loads", 0) == before.get("loads", 0)
    assert after["hits"] > before["hits"]


def test_ping_says_the_memory_status_says(tmp_path: Path) -> None:
    """``ping`` answers the budget and the shared memory in use, the totals ``status`` shows,
    without the segment list (a client polling memory asks it, not status)."""
    with running_daemon("--max-memory", "64MiB") as d, DaemonClient(d.runtime_dir, timeout=30) as client:
        assert client.ping()["used"] == 0 and client.ping()["budget"] == 64 << 20
        SharedH5Dataset(make_h5(tmp_path / "p.h5"), "x", rank=0, world_size=1, runtime_dir=d.runtime_dir).close()
        memory = client.status()["memory"]
        assert memory["used"] > 0 and client.ping()["used"] == memory["used"]


def test_edited_file_is_never_served_stale(shared_daemon: Daemon, tmp_path: Path) -> None:
    path = make_h5(tmp_path / "edit.h5")
    first = SharedH5Dataset(path, "y", rank=0, world_size=1, runtime_dir=shared_daemon.runtime_dir)
    assert first[3].item() == 3
    with h5py.File(path, "r+") as f:
        f["y"][...] = np.arange(1000, dtype=np.int64) * 10
    second = SharedH5Dataset(path, "y", rank=0, world_size=1, runtime_dir=shared_daemon.runtime_dir)
    assert second.backend == "shm" and second[3].item() == 30


def test_input_only_and_empty_shard(shared_daemon: Daemon, tmp_path: Path) -> None:
    path = make_h5(tmp_path / "small.h5", rows=3)
    ds = SharedH5Dataset(path, "x", rank=4, world_size=5, runtime_dir=shared_daemon.runtime_dir, fallback="error")
    assert len(ds) == 0 and ds.backend == "shm" and list(DataLoader(ds, batch_size=2)) == []
    one = SharedH5Dataset(path, "x", rank=1, world_size=5, runtime_dir=shared_daemon.runtime_dir)
    assert len(one) == 1 and isinstance(one[0], torch.Tensor) and one[0].shape == (3, 4, 4)
    with pytest.raises(IndexError):
        one[1]


def _open_shard(args: tuple[str, str]) -> tuple[str, int]:
    path, runtime_dir = args
    ds = SharedH5Dataset(path, "x", "y", rank=0, world_size=2, runtime_dir=runtime_dir, fallback="error")
    return ds.backend, int(collate(ds.__getitems__(list(range(len(ds)))))[0].sum())


def test_concurrent_requests_load_once(tmp_path: Path) -> None:
    import concurrent.futures
    import multiprocessing

    path = make_h5(tmp_path / "flight.h5", rows=20_000)
    d = Daemon().start()
    try:
        with concurrent.futures.ProcessPoolExecutor(8, mp_context=multiprocessing.get_context("fork")) as pool:
            results = list(pool.map(_open_shard, [(str(path), str(d.runtime_dir))] * 8, timeout=120))
        want = int(expected(path, "x", np.arange(10_000)).astype(np.int64).sum())
        assert results == [("shm", want)] * 8
        assert d.status()["counters"]["loads"] == 2  # x and y, once each
    finally:
        d.stop()


def test_hung_daemon_means_fallback_not_hang(h5file: Path) -> None:
    import os
    import signal
    import time

    d = Daemon().start()
    os.kill(d.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.warns(RuntimeWarning, match="did not answer within 0.5s"):
            ds = SharedH5Dataset(h5file, "x", "y", runtime_dir=d.runtime_dir, timeout=0.5)
        assert ds.backend == "lazy" and ds[3][1].item() == 3
        assert time.monotonic() - start < 10
        with pytest.raises(DaemonUnavailable):
            SharedH5Dataset(h5file, "x", runtime_dir=d.runtime_dir, timeout=0.5, fallback="error")
    finally:
        os.kill(d.pid, signal.SIGCONT)
        d.stop()


def test_daemon_of_another_protocol_version_means_fallback_with_the_reason(shared_daemon: Daemon, h5file: Path) -> None:
    """A client upgraded while the node's daemon kept running (it runs across jobs)."""
    import json
    import subprocess
    import sys

    script = (
        "import json, warnings\n"
        "import h5serve.wire.protocol as protocol\n"
        "protocol.VERSION = 2  # what a newer client speaks\n"
        "from h5serve.client import SharedH5Dataset\n"
        "from h5serve.errors import ProtocolError\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        f"    ds = SharedH5Dataset({str(h5file)!r}, 'x', 'y', "
        f"runtime_dir={str(shared_daemon.runtime_dir)!r}, timeout=30)\n"
        "try:\n"
        f"    SharedH5Dataset({str(h5file)!r}, 'x', runtime_dir={str(shared_daemon.runtime_dir)!r}, fallback='error')\n"
        "    strict = 'served'\n"
        "except ProtocolError as exc:\n"
        "    strict = str(exc)\n"
        "print(json.dumps([ds.backend, int(ds[4][1]), [str(m.message) for m in w], strict]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    backend, label, warned, strict = json.loads(done.stdout.strip().splitlines()[-1])
    assert backend == "lazy" and label == 4
    assert any("different h5serve versions" in w and "h5serve stop; h5serve start" in w for w in warned), warned
    assert "different h5serve versions" in strict
