"""Stream blocks asked ahead of need: the wire's ``prefetch`` flag (strict, not sent when false)
and the daemon's eviction order for it (daemon/store/prefetch.py)."""

from __future__ import annotations

import msgpack
import pytest

from h5serve.daemon.store.entries import Entry
from h5serve.daemon.store.prefetch import Prefetched
from h5serve.errors import ProtocolError
from h5serve.order.sharding import STREAM
from h5serve.wire.protocol import VERSION, Acquire, decode_request, encode_request

from ..helpers import make_meta


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
    # a needed block may evict anything no client holds, least recently used first (as before)
    assert p.eviction_order(entries, prefetch=False) == [unclaimed, old, claimed]
    p.forget(["old", "claimed"])  # evicted or failed: gone from the record
    assert p.unclaimed == set()
