"""make_loader's DataLoader workers hand plain batches over through a ring of shared slots
(h5serve/client/ring.py): the same bytes as without workers, with every start method; a batch
is the training process's own memory (in-place changes and kept batches are safe); nothing is
left in /dev/shm or mapped after the loader is gone or a worker is SIGKILLed; batches the ring
cannot take arrive as ordinary tensors. Real daemon, real worker processes."""

from __future__ import annotations

import functools
import gc
import os
import signal
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from h5serve.client import SharedH5Dataset, collate, make_loader, ring, seed_worker
from h5serve.errors import SegmentError

from ..helpers import Daemon, make_h5, wait_for

pytestmark = pytest.mark.timeout(120)

ROWS = 1001  # rank 1 of 2 has 500 rows: batches of 32 end with a short one
BATCH = 32


@pytest.fixture(scope="module")
def h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_h5(tmp_path_factory.mktemp("ring") / "data.h5", rows=ROWS, row_shape=(3, 8, 8))


@pytest.fixture
def ds(h5: Path, shared_daemon: Daemon) -> Iterator[SharedH5Dataset]:
    d = SharedH5Dataset(h5, "x", "y", rank=1, world_size=2, runtime_dir=shared_daemon.runtime_dir, fallback="error")
    assert d.backend == "shm"
    yield d
    d.close()


def _all_released() -> bool:
    gc.collect()
    ring.release_dead_rings()
    return ring.mapped_rings() == 0


@pytest.fixture(autouse=True)
def rings_released_after_each_test() -> Iterator[None]:
    """Every test's loaders are gone when it ends: so is every ring, here and in /dev/shm."""
    assert wait_for(_all_released, timeout=20)
    yield
    assert wait_for(_all_released, timeout=20)
    assert _ring_maps() == [] and _shm_rings() == []


def _ring_maps() -> list[str]:
    """The worker rings this process has mapped, as /proc/self/maps names them."""
    with open("/proc/self/maps") as f:
        return sorted({line.split(None, 5)[-1].strip() for line in f if "h5serve-ring-" in line})


def _shm_rings() -> list[str]:
    return [name for name in os.listdir("/dev/shm") if "ring" in name]


def _batches(loader: Any, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader.batch_sampler.set_epoch(epoch)
    return [(x, y) for x, y in loader]


def _same(a: list[tuple[torch.Tensor, torch.Tensor]], b: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    assert [len(y) for _, y in a] == [len(y) for _, y in b]
    for (xa, ya), (xb, yb) in zip(a, b):
        assert xa.dtype == xb.dtype and ya.dtype == yb.dtype
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_workers_deliver_the_same_bytes_through_the_ring(ds: SharedH5Dataset, context: str) -> None:
    want = [_batches(make_loader(ds, BATCH, seed=5), epoch) for epoch in (0, 1)]
    loader = make_loader(ds, BATCH, seed=5, num_workers=2, multiprocessing_context=context)
    got = [_batches(loader, epoch) for epoch in (0, 1)]
    assert 0 < len(want[0][-1][1]) < BATCH  # the short last batch went through too
    for w, g in zip(want, got):
        _same(w, g)
    # both workers' rings are mapped here: the batches came through them, not as shm files
    assert ring.mapped_rings() == 2 and len(_ring_maps()) == 2
    del loader, got
    assert wait_for(_all_released, timeout=20)


def test_x_only_and_opt_out(h5: Path, shared_daemon: Daemon) -> None:
    ds = SharedH5Dataset(h5, "x", rank=1, world_size=2, runtime_dir=shared_daemon.runtime_dir, fallback="error")
    try:
        want = list(make_loader(ds, BATCH, seed=1))
        for use_ring, rings in ((True, 2), (False, 0)):
            loader = make_loader(ds, BATCH, seed=1, num_workers=2, multiprocessing_context="fork",
                                 worker_ring=use_ring)
            got = list(loader)
            assert all(isinstance(x, torch.Tensor) and torch.equal(x, w) for x, w in zip(got, want))
            assert len(got) == len(want)
            assert ring.mapped_rings() == rings
            del loader
            assert wait_for(_all_released, timeout=20)
    finally:
        ds.close()


def test_in_place_changes_and_kept_batches_are_safe(ds: SharedH5Dataset) -> None:
    want = [b for epoch in (0, 1, 2) for b in _batches(make_loader(ds, BATCH, seed=9), epoch)]
    loader = make_loader(ds, BATCH, seed=9, num_workers=2, multiprocessing_context="fork", prefetch_factor=1)
    kept = []
    for epoch in (0, 1, 2):  # 48 batches through 2 slots per worker: every slot reused many times
        for x, y in _batches(loader, epoch):
            w = want[len(kept)]
            assert torch.equal(x, w[0]) and torch.equal(y, w[1])  # earlier changes reached no later batch
            if len(kept) % 2:
                x.fill_(7)
                y.neg_()
            kept.append((x, y))
    assert len(kept) == len(want)
    for i, ((x, y), (wx, wy)) in enumerate(zip(kept, want)):
        if i % 2:
            assert bool((x == 7).all()) and torch.equal(y, -wy)
        else:
            assert torch.equal(x, wx) and torch.equal(y, wy)  # never overwritten by a later batch


def test_a_killed_worker_leaves_nothing_behind(ds: SharedH5Dataset) -> None:
    loader = make_loader(ds, BATCH, seed=2, num_workers=2, multiprocessing_context="fork", timeout=30)
    it = iter(loader)
    next(it), next(it), next(it)
    pids = [w.pid for w in it._workers]
    assert len(_ring_maps()) == 2 and all(any(f"h5serve-ring-{p}" in m for m in _ring_maps()) for p in pids)
    # torch's SIGCHLD handler raises as soon as the worker is gone: possibly before kill returns
    with pytest.raises(RuntimeError, match="DataLoader worker"):
        os.kill(pids[0], signal.SIGKILL)
        for _ in it:
            pass
    del it, loader
    assert wait_for(_all_released, timeout=20)
    assert _ring_maps() == [] and _shm_rings() == []
    for pid in pids:  # no process holds a worker's ring any more
        assert not os.path.exists(f"/proc/{pid}")


class _Sizes(torch.utils.data.Sampler):
    """Batches of the given sizes, in order."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __iter__(self) -> Iterator[np.ndarray]:
        start = 0
        for n in self.sizes:
            yield np.arange(start, start + n)
            start += n

    def __len__(self) -> int:
        return len(self.sizes)


def test_batches_the_ring_cannot_take_arrive_as_tensors(ds: SharedH5Dataset) -> None:
    # one worker: its ring is sized by the first batch (5 rows); 40 and 64 do not fit
    sizes = [5, 40, 3, 64, 5, 1, 40, 2]
    loader = DataLoader(ds, batch_sampler=_Sizes(sizes), collate_fn=collate, num_workers=1,
                        multiprocessing_context="fork", worker_init_fn=functools.partial(seed_worker, ring_slots=2))
    start = 0
    for (x, y), n in zip(loader, sizes):
        assert torch.equal(y, torch.as_tensor(ds.indices[start:start + n], dtype=torch.int64))
        assert torch.equal(x, torch.stack([ds[i][0] for i in range(start, start + n)]))
        start += n
    assert start == sum(sizes)
    assert ring.mapped_rings() == 1


def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x.float() / 255


def _summed(x: torch.Tensor) -> dict[str, int]:
    return {"sum": int(x.sum())}


@pytest.mark.parametrize(("transform", "through_ring"), [(_scaled, True), (_summed, False)])
def test_transformed_batches(ds: SharedH5Dataset, transform: Any, through_ring: bool) -> None:
    # tensors per sample are stacked into the ring, as default_collate would stack them; a dict
    # per sample is default_collate's business, and arrives as it always did
    ds.transform = transform
    try:
        want = list(make_loader(ds, BATCH, seed=4))
        got = list(make_loader(ds, BATCH, seed=4, num_workers=2, multiprocessing_context="fork"))
        assert ring.mapped_rings() == (2 if through_ring else 0)
    finally:
        ds.transform = None
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert type(g) is type(w) is list
        if through_ring:
            assert g[0].dtype == w[0].dtype == torch.float32 and torch.equal(g[0], w[0])
        else:
            assert torch.equal(g[0]["sum"], w[0]["sum"])
        assert torch.equal(g[1], w[1])


def test_a_reused_slot_is_an_error_not_other_rows() -> None:
    worker = ring.WorkerRing(slots=2, slot_bytes=4096)
    item = ring.ArrayLayout(0, np.dtype(np.int64).str, (4,))
    slot = worker.claim()
    worker.view(slot, item)[:] = [1, 2, 3, 4]
    first = ForkingPickler.dumps(ring.RingBatch(worker, slot, worker.stamp(slot), (item,), ring.TENSOR))
    assert torch.equal(ForkingPickler.loads(first), torch.tensor([1, 2, 3, 4]))
    assert worker.mapped_by_main()  # the descriptor crossed once; later batches do without
    slot = worker.claim()
    stale = ForkingPickler.dumps(ring.RingBatch(worker, slot, worker.stamp(slot), (item,), ring.TENSOR))
    worker.stamp(slot)  # something else was written into the slot meanwhile
    try:
        with pytest.raises(SegmentError, match="no longer holds"):
            ForkingPickler.loads(stale)
    finally:
        ring._rings().pop(worker.token).close()  # this process is its own "worker": it never exits
