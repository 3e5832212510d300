"""Stream blocks asked ahead of need: the wire's ``prefetch`` flag (strict, not sent when false),
the daemon's eviction order for it (daemon/prefetch.py), and the sampler's room for prefetching
(blocks asked before their first use, memory still within the node's capacity)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from h5serve.client import StreamSampler
from h5serve.client.node_sampler import NodePlace
from h5serve.client.stream_sampler import prefetch_room
from h5serve.daemon.entries import Entry
from h5serve.daemon.prefetch import Prefetched
from h5serve.errors import ProtocolError
from h5serve.protocol import VERSION, Acquire, decode_request, encode_request
from h5serve.sharding import STREAM
from h5serve.stream_order import BlockLayout

from ..helpers import make_meta

LAYOUT = BlockLayout(20_000, 128)


def _frame(**fields: object) -> bytes:
    base = {"v": VERSION, "id": 3, "op": "acquire", "path": "/d.h5", "key": "x", "world_size": 2, "rank": 1}
    return msgpack.packb({**base, **fields})


def test_a_prefetch_round_trips_and_other_acquires_are_the_messages_they_were() -> None:
    req = Acquire("/d.h5", "x", 2, 1, STREAM, rows=(0, 128), prefetch=True)
    assert decode_request(encode_request(4, req)) == (4, req)
    assert "prefetch" not in msgpack.unpackb(encode_request(1, Acquire("/d.h5", "x", 2, 1, STREAM, rows=(0, 128))))
    assert decode_request(_frame(mode="stream", rows=[0, 1], prefetch=False))[1].prefetch is False


@pytest.mark.parametrize("fields", [
    {"mode": "stream", "rows": [0, 5], "prefetch": 1},
    {"mode": "stream", "rows": [0, 5], "prefetch": "yes"},
    {"mode": "stream", "rows": [0, 5], "prefetch": None},
    {"mode": "global", "prefetch": True},  # stream blocks only
])
def test_bad_prefetch_fields_are_refused(fields: dict) -> None:
    with pytest.raises(ProtocolError):
        decode_request(_frame(**fields))


def _entry(name: str, last_used: float) -> Entry:
    entry = Entry(name, make_meta(), "ready")
    entry.last_used = last_used
    return entry


def test_a_prefetch_never_evicts_a_block_prefetched_and_not_needed_yet() -> None:
    p = Prefetched()
    old, unclaimed, claimed = _entry("old", 1.0), _entry("unclaimed", 0.5), _entry("claimed", 2.0)
    p.asked("unclaimed", prefetch=True, started=True)
    p.asked("claimed", prefetch=True, started=True)
    p.asked("claimed", prefetch=False, started=False)  # a rank needed it: claimed for good
    p.asked("old", prefetch=True, started=False)  # a prefetch of a block already there claims nothing
    entries = [old, unclaimed, claimed]
    assert p.eviction_order(entries, prefetch=True) == [old, claimed]
    # a needed block may evict anything no client holds, the unclaimed last
    assert p.eviction_order(entries, prefetch=False) == [old, claimed, unclaimed]
    p.forget(["old", "claimed"])  # evicted or failed: gone from the record
    assert p.unclaimed == set()


def _sampler(prefetch: bool, capacity: int = 16, local_rank: int = 0) -> StreamSampler:
    return StreamSampler(LAYOUT, 64, NodePlace(local_rank, 2, 0, 1), capacity, seed=3, prefetch=prefetch)


def test_the_sampler_keeps_room_to_ask_for_blocks_before_their_first_use() -> None:
    plain, ahead = _sampler(False), _sampler(True)
    assert ahead.window == plain.window - prefetch_room(16, LAYOUT.n_blocks) == plain.window - 4
    asked_before: dict[int, int] = {}
    for step, batch in enumerate(ahead):
        assert len(batch.alive) + len(batch.ahead) <= ahead.capacity  # never more than the node holds
        for block in batch.ahead.tolist():
            asked_before.setdefault(block, step)
        for block in set((batch.rows // LAYOUT.block_rows).tolist()):
            asked_before.setdefault(block, step)
    lead = [first for first in asked_before.values()]
    assert len(lead) == LAYOUT.n_blocks
    # every block but the first window's is asked for steps before a batch needs it
    first_use: dict[int, int] = {}
    for step, batch in enumerate(_sampler(True)):
        for block in set((batch.rows // LAYOUT.block_rows).tolist()):
            first_use.setdefault(block, step)
    early = [first_use[b] - asked_before[b] for b in first_use if first_use[b] > 0]
    assert np.median(early) >= 4, early  # 2 without the room: a block asked a step or two ahead


def test_a_window_saved_without_the_room_still_resumes() -> None:
    old = _sampler(False)
    old.set_epoch(1)
    rows = np.concatenate([b.rows for b in old])
    state = old.state_dict(consumed=64 * 10)
    new = _sampler(True)
    new.load_state_dict(state)
    assert new.window == old.window
    np.testing.assert_array_equal(np.concatenate([b.rows for b in new]), rows[64 * 10:])
