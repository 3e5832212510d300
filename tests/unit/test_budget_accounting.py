"""What the daemon's budget counts (security findings 3 and 7: "budgets count what is
allocated"): a segment costs its pages in tmpfs, never its file size (a one-row block of 4,097
bytes takes two pages); a variable-length load costs, while it runs, the room its loader may
fill, so loads side by side never take the same free bytes; once loaded, its real pages. The
store is built here without a loader or a daemon: only its accounting runs."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from h5serve.daemon.loading.vlenload import Room
from h5serve.daemon.store.entries import Entry
from h5serve.daemon.store.store import SegmentStore
from h5serve.errors import BudgetExceeded
from h5serve.order.sharding import STREAM
from h5serve.segments import HEADER_SIZE, values_offset
from h5serve.util.units import PAGE_BYTES, allocated_bytes
from h5serve.wire.runtime import RuntimeLocation

from ..helpers import make_meta, short_workdir

pytestmark = pytest.mark.timeout(60)

BUDGET = 4 << 20


@pytest.fixture
def store() -> Iterator[SegmentStore]:
    with short_workdir("h5s-budget-") as tmp:
        shm = tmp / "shm"
        shm.mkdir()
        yield SegmentStore(RuntimeLocation(tmp / "rt"), shm, BUDGET, loaders=2)


def _block(start: int) -> object:
    """A stream block of one row of one byte: a 4,097-byte segment."""
    return make_meta(rows=1, row_shape=(), dtype="uint8", mode=STREAM, world_size=1, rank=0, total_rows=1200,
                     start=start)


def test_a_segment_costs_its_pages() -> None:
    meta = _block(0)
    assert meta.file_size == HEADER_SIZE + 1 and meta.allocated_size == 2 * PAGE_BYTES
    assert allocated_bytes(0) == 0 and allocated_bytes(PAGE_BYTES) == PAGE_BYTES
    assert allocated_bytes(PAGE_BYTES + 1) == 2 * PAGE_BYTES
    whole = make_meta(rows=PAGE_BYTES, row_shape=(), dtype="uint8")  # rows of whole pages: nothing more
    assert whole.allocated_size == whole.file_size == HEADER_SIZE + PAGE_BYTES


def test_the_budget_counts_pages_and_makes_room_by_them(store: SegmentStore) -> None:
    """1,200 ready one-row blocks count 1,200 x 8 KiB, not 1,200 x 4,097 bytes; making room for
    the next one evicts (least recently used first: their files are gone already) until its
    pages fit, leaving as many blocks as the budget holds pages for."""
    for start in range(1200):
        entry = Entry(f"b{start}", _block(start), "ready", last_used=float(start))
        store.entries[entry.name] = entry
    assert store.used_bytes() == 1200 * 2 * PAGE_BYTES
    assert store.status()["memory"]["segment_bytes"] == 1200 * (HEADER_SIZE + 1)
    store.make_room(_block(1200).allocated_size, _block(1200))
    assert len(store.entries) == BUDGET // (2 * PAGE_BYTES) - 1  # and the new block's pages
    assert store.used_bytes() + 2 * PAGE_BYTES == BUDGET
    assert min(int(name[1:]) for name in store.entries) == 1200 - len(store.entries)  # the oldest went


def _vlen(key: str, estimate: int) -> Entry:
    """A variable-length load asked for and waiting for a loader, estimated at ``estimate`` values."""
    meta = make_meta(rows=1100, row_shape=(), dtype="float32", key=key, mode="global", world_size=1, rank=0,
                     total_rows=1100, vlen="seq", values=estimate)
    return Entry(key, meta, "loading")


def test_variable_length_loads_count_their_room_while_they_run(store: SegmentStore) -> None:
    """Two loads estimated at almost nothing start side by side: each gets its estimate and half
    of what is free when it starts, counted until it is done, so together they stay within
    the budget whatever their rows turn out to be; once loaded, each counts its real pages."""
    first, second = _vlen("a", 0), _vlen("b", 16)
    store.entries.update(a=first, b=second)
    estimates = first.meta.allocated_size + second.meta.allocated_size
    assert store.used_bytes() == estimates  # waiting for a loader: their estimates
    for entry in (first, second):  # as _launch_pending does when it starts each one's loader
        entry.room = store._room_of(entry).limit
    assert first.room == first.meta.allocated_size + (BUDGET - estimates) // 2
    assert second.meta.allocated_size < second.room < first.room
    assert first.room % PAGE_BYTES == second.room % PAGE_BYTES == 0
    assert store.used_bytes() == first.room + second.room <= BUDGET
    with pytest.raises(BudgetExceeded):  # nothing else fits beside them now but what they left
        store.make_room(BUDGET - first.room - second.room + 1, make_meta())
    # the first one loaded 300,000 values, 1.1 MiB: counted at its real pages from now on
    first.meta, first.state, first.room = replace(first.meta, values=300_000), "ready", 0
    real = allocated_bytes(HEADER_SIZE + values_offset(1100) + 300_000 * 4)
    assert first.charge == real and store.used_bytes() == real + second.room


def test_a_room_stops_the_load_that_outgrows_it() -> None:
    meta = _vlen("tokens", 0).meta
    room = Room(3 * PAGE_BYTES, BUDGET)
    room.check(meta, 3 * PAGE_BYTES)  # every page of it may be used
    with pytest.raises(BudgetExceeded, match=r"/data/train.h5\[tokens\] all ranks \(global\) needs at least "
                                             r"16.0 KiB .* more than the 12.0 KiB the daemon's budget of 4.0 MiB "
                                             r"\(--max-memory\) had room for when its load started"):
        room.check(meta, 3 * PAGE_BYTES + 1)
    with pytest.raises(BudgetExceeded, match=r"more than 4.0 MiB, or use a mode that holds fewer rows"):
        room.check(meta, BUDGET + 1)


def test_the_load_index_follows_the_store_without_a_scan(store: SegmentStore) -> None:
    """Loads asked for are queued, started ones run, and an entry published, failed or dropped
    leaves the index by its own state: the loop's counts match a scan of every entry."""
    first, second = Entry("a", _block(1), "loading"), Entry("b", _block(2), "loading")
    for entry in (first, second):
        store.entries[entry.name] = entry
        store.loads.queue(entry)
    assert [e.name for e in store.loads.queued()] == ["a", "b"] and store.loads.loading() == 2
    first.process = object()  # type: ignore[assignment]
    store.loads.start(first)
    assert ([e.name for e in store.loads.running()], [e.name for e in store.loads.queued()]) == (["a"], ["b"])
    first.state = "ready"  # published
    del store.entries["b"]  # failed: dropped from the store
    assert (store.loads.running(), store.loads.queued(), store.loads_pending()) == ([], [], False)


def test_the_running_total_is_the_sum_of_charges_whatever_changes() -> None:
    """``Entries`` keeps the budget's total as entries come, go and change state, room or meta
    (the store reads it on every load instead of summing every segment): after any sequence
    it equals the sum it replaced, and an entry that left changes it no more."""
    import random

    from h5serve.daemon.store.entries import Entries

    entries = Entries()
    rng = random.Random(7)
    gone: list[Entry] = []
    for step in range(2000):
        op = rng.random()
        names = list(entries)
        if op < 0.35 or not names:
            name = f"b{rng.randrange(300)}"
            entries[name] = Entry(name, _block(rng.randrange(1000)), rng.choice(["loading", "ready"]),
                                  room=rng.choice([0, 3 * PAGE_BYTES, 40 * PAGE_BYTES]))
        elif op < 0.5:
            entry = entries.pop(rng.choice(names))
            assert entry is not None
            gone.append(entry)
        elif op < 0.6:
            del entries[rng.choice(names)]
        elif op < 0.75:
            entries[rng.choice(names)].state = rng.choice(["loading", "ready", "stale"])
        elif op < 0.85:
            entries[rng.choice(names)].room = rng.choice([0, 5 * PAGE_BYTES, 70 * PAGE_BYTES])
        elif op < 0.95:
            entry = entries[rng.choice(names)]
            entry.meta = make_meta(rows=rng.randrange(1, 9000), row_shape=(), dtype="uint8")  # another size
        elif gone:
            rng.choice(gone).state = "loading"  # left: must not count
        assert entries.ledger.total == sum(e.charge for e in entries.values()), step
    entries.clear()
    assert entries.ledger.total == 0
