"""stream_plan: the window a node's memory allows, and what inspect recommends."""

from __future__ import annotations

from h5serve.order.stream_plan import MIN_BLOCKS, KeyShape, plan_window, recommend
from h5serve.segments import HEADER_SIZE

MiB = 1 << 20


def test_the_default_block_when_the_window_holds_enough_of_them() -> None:
    w = plan_window([64, 1], 1024 + 8, 1_000_000, 1024 * MiB)
    assert w is not None and w.block_rows % 64 == 0 and 7 * MiB <= w.block_bytes <= 9 * MiB
    assert w.block_cost == w.block_bytes + 2 * HEADER_SIZE and w.capacity * w.block_cost <= 1024 * MiB
    assert w.window == w.capacity * w.block_bytes and w.blocks == -(-1_000_000 // w.block_rows)


def test_smaller_whole_chunks_when_the_default_would_leave_few_blocks() -> None:
    w = plan_window([64, 1], 1024 + 8, 8193, 2 * MiB)
    assert w is not None and w.block_rows % 64 == 0 and w.capacity >= MIN_BLOCKS
    assert w.capacity * w.block_cost <= 2 * MiB
    assert plan_window([64], 1 * MiB, 1000, 32 * MiB) is None  # not even one chunk of 64 MiB fits


def test_recommend() -> None:
    keys = [KeyShape(64, 1032, 8193)]
    needs = {"contiguous": 9 * MiB, "interleave": 9 * MiB, "global": 9 * MiB, "node": 9 * MiB}
    assert recommend(needs, None, False, 20 * MiB, keys) == ("global", None)
    mode, window = recommend(needs, None, False, 2 * MiB, keys)
    assert mode == "stream" and window is not None and window.capacity * window.block_cost <= 2 * MiB
    assert recommend(needs, "node", False, 2 * MiB, keys)[0] == "stream"
    assert recommend(needs, "contiguous", False, 2 * MiB, keys) == ("contiguous", None)
    assert recommend({**needs, "node": MiB}, None, True, 2 * MiB, keys) == ("node", None)  # across nodes it fits
