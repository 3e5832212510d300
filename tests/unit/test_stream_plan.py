"""stream_plan: the window a node's memory allows, and what inspect recommends."""

from __future__ import annotations

from h5serve.order.stream_plan import MIN_BLOCKS, KeyShape, block_cost, plan_window, recommend, segment_cost
from h5serve.segments import HEADER_SIZE
from h5serve.util.units import PAGE_BYTES, allocated_bytes

MiB = 1 << 20


def test_the_default_block_when_the_window_holds_enough_of_them() -> None:
    w = plan_window([64, 1], [1024, 8], 1_000_000, 1024 * MiB)
    assert w is not None and w.block_rows % 64 == 0 and 7 * MiB <= w.block_bytes <= 9 * MiB
    # a segment per key, its header page and rows in whole pages, as the daemon's budget counts them
    x, y = w.block_rows * 1024, w.block_rows * 8
    assert w.block_cost == allocated_bytes(HEADER_SIZE + x) + allocated_bytes(HEADER_SIZE + y)
    assert w.capacity * w.block_cost <= 1024 * MiB
    assert w.window == w.capacity * w.block_bytes and w.blocks == -(-1_000_000 // w.block_rows)


def test_smaller_whole_chunks_when_the_default_would_leave_few_blocks() -> None:
    w = plan_window([64, 1], [1024, 8], 8193, 2 * MiB)
    assert w is not None and w.block_rows % 64 == 0 and w.capacity >= MIN_BLOCKS
    assert w.capacity * w.block_cost <= 2 * MiB
    assert plan_window([64], [1 * MiB], 1000, 32 * MiB) is None  # not even one chunk of 64 MiB fits


def test_recommend() -> None:
    keys = [KeyShape(64, 1032, 8193)]
    needs = {"contiguous": 9 * MiB, "interleave": 9 * MiB, "global": 9 * MiB, "node": 9 * MiB}
    assert recommend(needs, None, False, 20 * MiB, keys) == ("global", None)
    mode, window = recommend(needs, None, False, 2 * MiB, keys)
    assert mode == "stream" and window is not None and window.capacity * window.block_cost <= 2 * MiB
    assert recommend(needs, "node", False, 2 * MiB, keys)[0] == "stream"
    assert recommend(needs, "contiguous", False, 2 * MiB, keys) == ("contiguous", None)
    assert recommend({**needs, "node": MiB}, None, True, 2 * MiB, keys) == ("node", None)  # across nodes it fits


def test_tiny_blocks_cost_their_pages() -> None:
    """One-row blocks of one byte: 4,097 bytes of file, two pages of tmpfs, as the daemon's budget
    counts them (finding 7: the window counted 4,097 and held twice the budget in pages)."""
    assert segment_cost(1) == 2 * PAGE_BYTES and segment_cost(0) == HEADER_SIZE
    assert block_cost(1, [1, 8]) == 4 * PAGE_BYTES
    w = plan_window([1], [1], 8 * MiB, 64 * PAGE_BYTES)  # a window of 64 pages: small blocks of whole pages
    assert w is not None and w.block_cost == segment_cost(w.block_rows) and w.capacity >= MIN_BLOCKS
    assert w.capacity * w.block_cost <= 64 * PAGE_BYTES
