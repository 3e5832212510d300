"""The stream window a node's memory allows for a file: what ``h5serve inspect`` recommends and
what automatic stream mode (client/automatic.py) serves a global or node dataset with when it
does not fit. Pure arithmetic (no I/O, no torch), so both give the same numbers.

The block is stream_order's default (whole chunks of every key, about 8 MiB), or smaller
whole chunks when the default would leave the window fewer than ``MIN_BLOCKS`` blocks (a
shuffle across a handful of blocks barely mixes). The window is the blocks ``limit`` holds,
each costing its rows and a header page per key in shared memory (as the daemon counts them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..util.units import SEGMENT_HEADER_BYTES as HEADER_SIZE
from .sharding import GLOBAL, NODE, STREAM
from .stream_order import BlockLayout, block_unit, default_block_rows

__all__ = ["MIN_BLOCKS", "StreamWindow", "fitted_block_rows", "plan_window", "recommend"]

MIN_BLOCKS = 8


@dataclass(frozen=True)
class StreamWindow:
    """Blocks of ``block_rows`` rows (``block_bytes`` of rows, ``block_cost`` in shared memory),
    ``blocks`` of them in the file, ``capacity`` in a window of ``window`` bytes of rows."""

    block_rows: int
    block_bytes: int
    block_cost: int
    blocks: int
    capacity: int
    window: int


def fitted_block_rows(unit: int, row_bytes: int, total_rows: int, limit: int, keys: int) -> int:
    """The default block (stream_order.default_block_rows: whole ``unit``s, about 8 MiB), or
    smaller whole units when ``limit`` bytes would hold fewer than MIN_BLOCKS of them, each
    costing its rows and a header page per key of ``keys`` (at least one unit)."""
    rows = default_block_rows(unit, row_bytes, total_rows)
    if limit // (rows * row_bytes + keys * HEADER_SIZE) < MIN_BLOCKS:
        small = (limit // MIN_BLOCKS - keys * HEADER_SIZE) // max(row_bytes, 1)
        rows = min(rows, unit * max(small // unit, 1))
    return rows


def plan_window(chunk_rows: Sequence[int], row_bytes: int, total_rows: int, limit: int) -> StreamWindow | None:
    """The window of at most ``limit`` bytes of shared memory for keys chunked by ``chunk_rows``
    rows (1 for a contiguous key) whose rows take ``row_bytes`` together; None when not even
    one block (one chunk of every key) fits."""
    keys = len(chunk_rows)
    rows = fitted_block_rows(block_unit(chunk_rows), row_bytes, total_rows, limit, keys)
    block, cost = rows * row_bytes, rows * row_bytes + keys * HEADER_SIZE
    capacity = min(limit // cost, BlockLayout(total_rows, rows).n_blocks)
    if capacity < 1:
        return None
    return StreamWindow(rows, block, cost, BlockLayout(total_rows, rows).n_blocks, capacity, capacity * block)


def recommend(needs: Mapping[str, int], mode: str | None, multi_node: bool, limit: int,
              keys: Sequence[tuple[int, int, int]]) -> tuple[str, StreamWindow | None]:
    """What ``h5serve inspect`` recommends: the mode asked about (None: global, else node across
    nodes) when its need (``needs``: bytes by mode) fits ``limit`` (the budget, or /dev/shm's
    free space when smaller); else stream, with the window ``limit`` holds for ``keys``
    (``(chunk rows or 1, row bytes, rows)`` each). A sharded mode asked about, or data where
    not even one block fits, keeps the mode asked (read lazily where it does not fit)."""
    wanted = [mode] if mode else [GLOBAL, NODE] if multi_node else [GLOBAL]
    chosen = next((m for m in wanted if needs.get(m, limit + 1) <= limit), None)
    if chosen is not None or not keys or wanted[0] not in (GLOBAL, NODE):
        return chosen or wanted[0], None
    window = plan_window([k[0] for k in keys], sum(k[1] for k in keys), max(k[2] for k in keys), limit)
    return (STREAM, window) if window is not None else (wanted[0], None)
