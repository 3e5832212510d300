"""Stream mode on the wire: an acquire names one block by its global rows, checked strictly;
Selection and SegmentMeta hold it as a row range (the segment's identity), so a block is one
segment whoever asks; the client's window against the daemon's budget."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from h5serve.client.streaming.backend import StreamAsk, resolve_stream
from h5serve.errors import ConfigError, ProtocolError
from h5serve.hdf5.source import DatasetInfo
from h5serve.order.sharding import STREAM, RowRange, Selection
from h5serve.segments import SegmentMeta
from h5serve.wire.protocol import VERSION, Acquire, decode_request, encode_request

from ..helpers import make_meta


def _frame(**fields: object) -> bytes:
    base = {"v": VERSION, "id": 3, "op": "acquire", "path": "/d.h5", "key": "x", "world_size": 2, "rank": 1}
    return msgpack.packb({**base, **fields})


def test_a_stream_acquire_round_trips_with_its_rows() -> None:
    req = Acquire("/d.h5", "x", 2, 1, STREAM, rows=(256, 512))
    assert decode_request(encode_request(7, req)) == (7, req)
    assert decode_request(_frame(mode="stream", rows=[0, 1]))[1].rows == (0, 1)


def test_other_acquires_are_the_messages_they_were() -> None:
    assert "rows" not in msgpack.unpackb(encode_request(1, Acquire("/d.h5", "x", 2, 1, "global")))


@pytest.mark.parametrize("fields", [
    {"mode": "stream"},  # no rows
    {"mode": "stream", "rows": None},
    {"mode": "stream", "rows": [5]},
    {"mode": "stream", "rows": [5, 5]},  # empty
    {"mode": "stream", "rows": [6, 5]},
    {"mode": "stream", "rows": [-1, 5]},
    {"mode": "stream", "rows": [0, 2**63]},
    {"mode": "stream", "rows": [True, 5]},
    {"mode": "stream", "rows": [0.0, 5]},
    {"mode": "stream", "rows": "0:5"},
    {"mode": "stream", "rows": [0, 5, 1]},
    {"mode": "global", "rows": [0, 5]},  # rows outside stream mode
    {"mode": "stream", "rows": [0, 5], "span": 2},
])
def test_bad_stream_fields_are_refused(fields: dict) -> None:
    with pytest.raises(ProtocolError):
        decode_request(_frame(**fields))


def test_a_block_is_its_rows_whoever_asks() -> None:
    a = Selection(STREAM, 4, 3, block=(100, 200))
    b = Selection(STREAM, 1, 0, block=(100, 200))
    assert a.rows(1000) == b.rows(1000) == RowRange(100, 200) == Selection("node", 10, 1, 1).rows(1000)
    assert list(a.indices(1000)) == list(range(100, 200)) and a.first(1000) == 100
    with pytest.raises(ConfigError, match=r"\[100, 200\) reach past the dataset's 150 rows"):
        a.rows(150)
    for bad in [None, (5, 5), (-1, 3), (3, 1), (0, 1, 2)]:
        with pytest.raises(ConfigError):
            Selection(STREAM, 1, 0, block=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="mode='stream' only"):
        Selection("global", 1, 0, block=(0, 5))


def test_a_block_segment_is_named_by_its_rows() -> None:
    block = make_meta(rows=50, mode=STREAM, world_size=2, rank=1, total_rows=1000, start=100)
    assert block.row_range == RowRange(100, 150)
    assert SegmentMeta.from_wire(block.to_wire()) == block
    other_rank = make_meta(rows=50, mode=STREAM, world_size=4, rank=3, total_rows=1000, start=100)
    assert block.identity() == other_rank.identity()  # one segment for every rank and job
    assert block.identity() != make_meta(rows=50, mode=STREAM, total_rows=1000, start=150).identity()
    assert "start" not in make_meta().to_wire()  # other segments' headers are as before


def _info(rows: int = 8192, chunk: int = 64) -> list[DatasetInfo]:
    x = DatasetInfo(key="x", rows=rows, row_shape=(1024,), dtype=np.dtype("uint8"), chunk_rows=chunk, chunked=True)
    y = DatasetInfo(key="y", rows=rows, row_shape=(), dtype=np.dtype("int64"), chunk_rows=chunk, chunked=True)
    return [x, y]


def test_a_window_of_tiny_blocks_holds_what_the_budget_holds_pages_for() -> None:
    """1,200 one-row blocks of one byte under a 4 MiB budget: two pages a block, 512 blocks
    (the window counted 4,097 bytes a block and took 1,023, twice the budget in tmpfs)."""
    x = DatasetInfo(key="x", rows=1200, row_shape=(), dtype=np.dtype("uint8"), chunk_rows=1, chunked=True)
    config = resolve_stream([x], StreamAsk(None, 1, budget=4 << 20))
    assert (config.block_bytes, config.block_cost, config.capacity) == (1, 8192, 512)


def test_the_window_fits_the_daemons_budget_or_says_by_how_much() -> None:
    block = 128 * (1024 + 8)
    cost = (4096 + 128 * 1024) + 8192  # a segment per key in whole pages: y's 1 KiB of rows takes a page
    config = resolve_stream(_info(), StreamAsk("1MiB", 128, budget=2 << 20))
    assert (config.capacity, config.block_cost, config.budget) == ((1 << 20) // block, cost, 2 << 20)
    without = resolve_stream(_info(), StreamAsk("1MiB", 128))
    assert without.capacity == config.capacity  # the same order without a daemon
    assert resolve_stream(_info(), StreamAsk(None, 128, budget=2 << 20)).capacity == (2 << 20) // cost
    with pytest.raises(ConfigError, match=r"window='3MiB' \(3.0 MiB\) is larger than the daemon's budget of 2.0 MiB"):
        resolve_stream(_info(), StreamAsk("3MiB", 128, budget=2 << 20))
    with pytest.raises(ConfigError, match=r"holds 7 blocks \(those in use and those prefetched ahead of them\), "
                                          r"which take 7 x 140.0 KiB = 980.0 KiB .* budget of "
                                          r"950.0 KiB: pass a window of at most 774.0 KiB \(6 blocks\)"):
        resolve_stream(_info(), StreamAsk(7 * block, 128, budget=950 * 1024))
    with pytest.raises(ConfigError, match="the daemon's budget is 100.0 KiB, smaller than one block"):
        resolve_stream(_info(), StreamAsk(None, 128, budget=100 * 1024))
