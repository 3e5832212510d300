"""The stream window a node's memory allows for a file: what ``h5serve inspect`` recommends and
what automatic stream mode (client/streaming/automatic.py) serves a global or node dataset with when it
does not fit. Pure arithmetic (no I/O, no torch), so both give the same numbers.

The block is stream_order's default (whole chunks of every key, about 8 MiB), or smaller
whole chunks when the default would leave the window fewer than ``MIN_BLOCKS`` blocks (a
shuffle across a handful of blocks barely mixes). The window is the blocks ``limit`` holds,
each costing a segment per key in shared memory, a header page and its rows in whole pages
(``segment_cost``: tmpfs allocates pages, and the daemon's budget counts them), once the small
keys held whole (labels: ``held_whole``) have taken their room.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..util.units import PAGE_BYTES, allocated_bytes
from ..util.units import SEGMENT_HEADER_BYTES as HEADER_SIZE
from .sharding import GLOBAL, NODE, STREAM
from .stream_order import BlockLayout, block_unit, default_block_rows

__all__ = ["MIN_BLOCKS", "WHOLE_KEY_SHARE", "KeyShape", "StreamWindow", "block_cost", "daemon_window",
           "fitted_block_rows", "held_whole", "held_whole_bytes", "plan_window", "recommend", "segment_cost"]

MIN_BLOCKS = 8
WHOLE_KEY_SHARE = 16  # with a daemon: keys whose rows take at most 1/16 of its budget are held whole (labels)


def segment_cost(data_bytes: int) -> int:
    """What a segment of ``data_bytes`` bytes of rows costs in the daemon's budget: its header
    page and its rows in whole pages of tmpfs, as the daemon counts it (SegmentMeta.allocated_size)."""
    return allocated_bytes(HEADER_SIZE + data_bytes)


def block_cost(rows: int, row_bytes: Sequence[int]) -> int:
    """What a block of ``rows`` rows costs in the daemon's budget: a segment per key
    (``row_bytes``: each key's bytes a row)."""
    return sum(segment_cost(rows * b) for b in row_bytes)


@dataclass(frozen=True)
class KeyShape:
    """What the plan needs of a key: rows per chunk (1: contiguous), bytes a row (variable-length
    rows: an estimate), rows, and whether its rows are variable-length."""

    chunk_rows: int
    row_bytes: int
    rows: int
    vlen: bool = False

    @property
    def whole_cost(self) -> int:
        """Its rows held whole in the daemon's shared memory: one segment (``segment_cost``)."""
        return segment_cost(self.rows * self.row_bytes)


def held_whole_bytes(keys: Sequence[KeyShape], whole: Sequence[bool]) -> int:
    """The shared memory the keys held whole (``whole``, per key) take."""
    return sum(k.whole_cost for k, w in zip(keys, whole) if w)


def held_whole(keys: Sequence[KeyShape], budget: int, many_files: bool) -> list[bool]:
    """Which keys a daemon-served stream holds whole, as one segment for the job, rather than
    block by block: fixed-length keys of one file whose rows take, together, at most
    1/WHOLE_KEY_SHARE of ``budget``, the largest key always streamed. A label of 8 bytes a row
    costs its own acquire, load and attach per block otherwise, as much as a block of images
    does. Pure: every rank of a node decides alike from the same budget, and ``h5serve
    inspect`` as they do."""
    if many_files or len(keys) < 2:
        return [False] * len(keys)
    costs = [k.whole_cost for k in keys]
    largest = max(range(len(keys)), key=lambda i: costs[i])
    chosen, used = [False] * len(keys), 0
    for i in sorted(range(len(keys)), key=lambda i: costs[i]):
        if i != largest and not keys[i].vlen and used + costs[i] <= budget // WHOLE_KEY_SHARE:
            chosen[i], used = True, used + costs[i]
    return chosen


@dataclass(frozen=True)
class StreamWindow:
    """Blocks of ``block_rows`` rows (``block_bytes`` of rows, ``block_cost`` in shared memory),
    ``blocks`` of them in the file, ``capacity`` in a window of ``window`` bytes of rows; beside
    it, the keys held whole (``whole``, per key; ``whole_bytes`` of shared memory)."""

    block_rows: int
    block_bytes: int
    block_cost: int
    blocks: int
    capacity: int
    window: int
    whole: tuple[bool, ...] = ()
    whole_bytes: int = 0


def fitted_block_rows(unit: int, row_bytes: Sequence[int], total_rows: int, limit: int) -> int:
    """The default block (stream_order.default_block_rows: whole ``unit``s, about 8 MiB), or
    smaller whole units when ``limit`` bytes would hold fewer than MIN_BLOCKS of them, each
    costing a segment per key (``row_bytes``: each key's bytes a row; ``block_cost``); at least
    one unit."""
    together, keys = sum(row_bytes), len(row_bytes)
    rows = default_block_rows(unit, together, total_rows)
    if limit // block_cost(rows, row_bytes) < MIN_BLOCKS:
        # a key's segment is its header and rows and less than a page more (its last page's rest)
        small = (limit // MIN_BLOCKS - keys * (HEADER_SIZE + PAGE_BYTES - 1)) // max(together, 1)
        rows = min(rows, unit * max(small // unit, 1))
    return rows


def plan_window(chunk_rows: Sequence[int], row_bytes: Sequence[int], total_rows: int,
                limit: int) -> StreamWindow | None:
    """The window of at most ``limit`` bytes of shared memory for keys chunked by ``chunk_rows``
    rows (1 for a contiguous key) whose rows take ``row_bytes`` each (per key, in the same
    order); None when not even one block (one chunk of every key) fits."""
    rows = fitted_block_rows(block_unit(chunk_rows), row_bytes, total_rows, limit)
    block, cost = rows * sum(row_bytes), block_cost(rows, row_bytes)
    capacity = min(limit // cost, BlockLayout(total_rows, rows).n_blocks)
    if capacity < 1:
        return None
    return StreamWindow(rows, block, cost, BlockLayout(total_rows, rows).n_blocks, capacity, capacity * block)


def daemon_window(keys: Sequence[KeyShape], limit: int, many_files: bool = False) -> StreamWindow | None:
    """The window a daemon-served stream takes of ``limit`` for ``keys`` with the default window:
    the small keys held whole (``held_whole``), the window what is left (``plan_window``);
    None when not even one block fits. What automatic stream mode serves and ``h5serve
    inspect`` recommends."""
    whole = held_whole(keys, limit, many_files)
    whole_bytes = held_whole_bytes(keys, whole)
    window = plan_window([k.chunk_rows for k in keys], [k.row_bytes for k in keys], max(k.rows for k in keys),
                         limit - whole_bytes)
    return None if window is None else dataclasses.replace(window, whole=tuple(whole), whole_bytes=whole_bytes)


def recommend(needs: Mapping[str, int], mode: str | None, multi_node: bool, limit: int,
              keys: Sequence[KeyShape]) -> tuple[str, StreamWindow | None]:
    """What ``h5serve inspect`` recommends: the mode asked about (None: global, else node across
    nodes) when its need (``needs``: bytes by mode) fits ``limit`` (the budget, or /dev/shm's
    size when smaller); else stream, with the window a daemon of ``limit`` takes for
    ``keys`` (``daemon_window``). A sharded mode asked about, or data where not even one block
    fits, keeps the mode asked (read lazily where it does not fit). Stream asked about: stream,
    with that window (None: not even one block fits)."""
    if mode == STREAM:
        return STREAM, daemon_window(keys, limit) if keys else None
    wanted = [mode] if mode else [GLOBAL, NODE] if multi_node else [GLOBAL]
    chosen = next((m for m in wanted if needs.get(m, limit + 1) <= limit), None)
    if chosen is not None or not keys or wanted[0] not in (GLOBAL, NODE):
        return chosen or wanted[0], None
    window = daemon_window(keys, limit)
    return (STREAM, window) if window is not None else (wanted[0], None)
