"""The stream arena and the daemon's memory: a slot that finds no
room is refused with the error a segment per block meets (BudgetExceeded from the store's
refusal, counted as one); slot loads count against the loads one uid may queue, together with
its segments' (MAX_QUEUED_LOADS_PER_UID); an arena is removed, every page of it given back, once
the last stream that had it open is closed (never while one has it open)."""

from __future__ import annotations

import fcntl
import re
from pathlib import Path

import numpy as np
import pytest

from h5serve.client import SharedH5Dataset, make_loader
from h5serve.client.streaming.arena_blocks import _Mapped
from h5serve.daemon.config import MAX_QUEUED_LOADS_PER_UID
from h5serve.errors import BudgetExceeded, CapacityError
from h5serve.segments.arena import ARENA_MARK, READY
from h5serve.wire.connection import DaemonClient
from h5serve.wire.protocol import Acquire
from h5serve.wire.runtime import ARENA_ENV

from ..helpers import make_h5, running_daemon, wait_for

pytestmark = pytest.mark.timeout(300)


def _numbers_out(message: str) -> str:
    return re.sub(r"[0-9][0-9.,]*\s*[KMGT]?i?B|[0-9]+", "N", message)


def test_no_room_for_a_slot_is_the_error_a_segment_meets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every slot the budget holds leased: a new block in the arena and the same block as a
    segment of its own are both refused with BudgetExceeded, the same words (numbers aside), each
    counted as a refusal."""
    monkeypatch.setenv(ARENA_ENV, "1")  # the daemon offers arenas
    path = make_h5(tmp_path / "small.h5", rows=1024, row_shape=(1024,))  # 16 whole blocks of 64 KiB
    blocks = [(a, a + 64) for a in range(0, 1024, 64)]
    with running_daemon("--max-memory", str(1024 * 1024), "--loaders", "1") as d, DaemonClient(d.runtime_dir) as c:
        answers = [c.acquire(Acquire(str(path), "x", 1, 0, "stream", None, rows=b, arena=64)) for b in blocks[:15]]
        arena = _Mapped(answers[0])
        try:
            for slot in np.flatnonzero(arena.table[:, 2] == READY).tolist():
                assert arena.lock(slot, fcntl.F_RDLCK)
            refusals = d.status()["counters"]["refusals"]
            with pytest.raises(BudgetExceeded) as in_arena:
                c.acquire(Acquire(str(path), "x", 1, 0, "stream", None, rows=blocks[15], arena=64))
            with pytest.raises(BudgetExceeded) as in_segment:
                c.acquire(Acquire(str(path), "x", 1, 0, "stream", None, rows=blocks[15]))
            assert _numbers_out(str(in_arena.value)) == _numbers_out(str(in_segment.value))
            assert "the daemon's budget is" in str(in_arena.value)
            assert d.status()["counters"]["refusals"] == refusals + 2
        finally:
            arena.close()


def test_slot_loads_count_against_the_loads_a_uid_may_queue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One exchange of more new blocks than a uid may queue, with one loader: arena blocks are
    refused past the bound as segment blocks are, with the same CapacityError (the bound's words);
    and slot loads waiting count with the uid's segment loads (arena blocks asked first leave
    room for fewer segment blocks)."""
    monkeypatch.setenv(ARENA_ENV, "1")  # the daemon offers arenas
    # past the bound by far more than the one loader finishes during an exchange (32 past it, a
    # storm once got every request queued: 32 tiny loads finished while the daemon read them)
    extra = 160
    n = MAX_QUEUED_LOADS_PER_UID + extra
    rows = 4 * (3 * n + 8)
    path = make_h5(tmp_path / "many.h5", rows=rows, row_shape=(1024,))  # blocks of 4 rows: a page each
    fresh = iter(range(0, rows, 4))  # every request a block not asked for before: a new load

    def storm(c: DaemonClient, arena: list[bool]) -> tuple[int, int, set[str]]:
        requests = [Acquire(str(path), "x", 1, 0, "stream", None, rows=(a, a + 4), arena=4 if slot else 0)
                    for a, slot in zip(fresh, arena)]
        replies = c.request_many(requests)
        refused = [(r, slot) for r, slot in zip(replies, arena) if isinstance(r, Exception)]
        assert all(isinstance(r, CapacityError) and not isinstance(r, BudgetExceeded) for r, _ in refused), refused
        return (len(refused), sum(not slot for _, slot in refused), {_numbers_out(str(r)) for r, _ in refused})

    with running_daemon("--max-memory", str(64 * 1024 * 1024), "--loaders", "1") as d, \
            DaemonClient(d.runtime_dir) as c:
        def drained() -> bool:
            status = d.status()
            return (not any(s["state"] == "loading" for s in status["segments"])
                    and status["arenas"]["slots"] == status["arenas"]["ready"])
        for slot in (True, False):  # the file resolved and both kinds' first loads done: the storms queue
            first = next(fresh)
            c.acquire(Acquire(str(path), "x", 1, 0, "stream", None, rows=(first, first + 4), arena=4 if slot else 0))
        results = {}
        storms = {"arena": [True] * n, "segment": [False] * n, "mixed": [True] * 200 + [False] * (n - 200)}
        for name, arena in storms.items():
            results[name] = storm(c, arena)
            assert wait_for(drained, 120)
        for refused, _, words in results.values():
            assert refused > 0, results
            assert len(words) == 1 and "MAX_QUEUED_LOADS_PER_UID" in next(iter(words)), words
        assert results["arena"][2] == results["segment"][2] == results["mixed"][2]
        # every refusal of the mixed storm is a segment block: the 200 slot loads asked first took room
        assert results["mixed"][1] == results["mixed"][0] > 0 and results["segment"][0] <= extra, results


def test_an_arena_goes_when_its_last_stream_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream's arenas stay while its dataset is open (the daemon's sweep finds them open and
    keeps them), and are unlinked, every page of them given back, once it is closed: the
    daemon's used bytes fall to nothing, the files leave tmpfs."""
    monkeypatch.setenv(ARENA_ENV, "1")
    path = make_h5(tmp_path / "data.h5", rows=2049, row_shape=(1024,))
    with running_daemon("--max-memory", str(1024 * 1024), "--loaders", "2") as d:
        ds = SharedH5Dataset(path, "x", "y", rank=0, world_size=1, runtime_dir=d.runtime_dir, fallback="error",
                             mode="stream", window="512KiB", block_rows=128, timeout=60)
        try:
            for _ in make_loader(ds, 32, seed=0):
                pass
            arenas = [name for name in d.segment_files() if ARENA_MARK in name]
            assert len(arenas) == 2 and d.status()["memory"]["used"] > 0
            # past its grace, a sweep finds the open arenas and keeps them
            assert wait_for(lambda: d.status()["arenas"]["kept"] >= 2, 30)
            assert [name for name in d.segment_files() if ARENA_MARK in name] == arenas
            assert d.status()["arenas"]["removed"] == 0
        finally:
            ds.close()

        def gone() -> bool:
            status = d.status()
            return (status["arenas"]["removed"] == 2 and status["arenas"]["arenas"] == 0
                    and status["memory"]["used"] == 0)
        assert wait_for(gone, 30), d.status()["arenas"]
        assert not [name for name in d.segment_files() if ARENA_MARK in name]
