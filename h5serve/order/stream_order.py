"""Stream mode's order: which rows every rank reads, per epoch, through a sliding window of
blocks. Pure functions of (seed, epoch, block layout, node count, window): no I/O, no torch,
so the client's samplers and (later) the daemon's window compute the same order.

A *block* is ``block_rows`` consecutive rows of the file, a whole number of HDF5 chunks of
every key (the last block may be shorter): the unit read, held and freed. Of many files (one
dataset of their rows concatenated), each file is cut into blocks of its own, its last one
short when its rows are not whole blocks: a block never spans two files. Per epoch:

1. The full blocks are permuted from ``(seed, epoch)`` and dealt round-robin to the
   ``num_nodes`` nodes; the short blocks, in an order permuted per epoch, each go to the
   first node with the fewest rows so far (one file: its short last block to the first node
   with the fewest full blocks, the same every epoch). The nodes differ by at most one block
   (``node_rows``; with short blocks of several sizes a node's count may change from epoch to
   epoch, and every node computes every node's); a node reads only the blocks dealt to it.
2. A node's ``m`` blocks, in dealt order ``k = 0..m-1``, are drawn through a window of ``W``
   blocks: every row of block ``k`` gets a key in ``[lo_k, hi_k)``, and the node's sequence
   is its rows sorted by key. The keys are stratified (h5serve/order/stream_draw.py): block
   ``k``'s rows, permuted, in groups of ``L`` (the local ranks) spread evenly over its range,
   each group's rows together, so every rank draws from every block of the window in its
   share and seldom reads two rows of one block in a row. Steady state ``[k - W + 1, k + 1)``: ``W``
   blocks are in use at every key, each draining at the same rate, and block ``k + 1``
   starts as block ``k - W + 1`` ends. The window ramps up: ``lo_k = max(k - W + 1,
   floor(k / 2))``, so at key ``j`` the rows come from at most ``min(j + 2, W)`` blocks: the epoch's
   first batch draws from two blocks (what a window loads before it can serve), not from
   ``W`` (which made the first batch wait for the whole first window), and the window is
   full from key ``W - 2`` (about the first ``2W`` blocks' rows) on. The last ``W`` blocks
   end together (``hi = m``), so the epoch's last rows are drawn from ``W`` blocks, not
   from one. At any key at most ``W`` blocks hold unread rows (``lo_k >= k - W + 1``;
   ``resident_counts`` checks it; unit tests count it at every position). Vectorised: one
   merge of the blocks' ascending keys, O(n log m).
3. The node's sequence is dealt to its ``L`` local ranks (position ``p`` to local rank
   ``p % L``) with equal sample and batch counts on every rank of every node
   (h5serve/order/equalise.py over every rank's share): padded by repeating the sequence's last
   rows (which come from the last ``W`` blocks, still held), or cut.

``first_use``/``last_use`` of every block in the dealt sequence say when a window must hold
it: load before its first use, free after its last (found in O(rows), no sort).

Resuming with another number of ranks per node (same nodes, same window): the rows a node
has not served yet, ``sequence[offset:]`` of the sequence drawn for the old ranks (``run``),
are dealt to the new ranks (``offset``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..errors import ConfigError
from ..util.checks import is_int
from ..util.units import format_bytes
from .equalise import check_batch_size, equal_epoch_size
from .sharding import STREAM
from .stream_draw import block_rows, draw_sequence

__all__ = [
    "STREAM",
    "DEFAULT_BLOCK_BYTES",
    "BlockLayout",
    "NodeEpoch",
    "block_unit",
    "check_block_rows",
    "default_block_rows",
    "max_node_blocks",
    "node_blocks",
    "node_rows",
    "node_sequence",
    "window_for",
    "node_epoch",
    "resident_counts",
    "neighbour_entropy",
]

DEFAULT_BLOCK_BYTES = 8 * 1024 * 1024  # the block the layout picks: whole chunks, about this large
MAX_BLOCK_BYTES = 16 * 1024 * 1024  # ... and more only when one chunk (of every key) is larger
_TAG_BLOCKS, _TAG_KEYS, _TAG_SHORT, _TAG_DEAL = 0x5B10C, 0x5EED, 0x5407, 0xDEA1  # a random stream per purpose


def _positive(name: str, value: object) -> int:
    if not is_int(value, numpy=True) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class BlockLayout:
    """``total_rows`` rows cut into blocks of ``block_rows`` (the last may be shorter).

    ``file_rows``: the rows of each of many files whose rows are concatenated (one dataset of
    several files, h5serve/hdf5/files.py): each file is cut into blocks on its own, its last
    block shorter when its rows are not a multiple of ``block_rows``, so a block never spans
    two files. Blocks are numbered across the files in order (file 0's first). Empty: one file.

    Raised for a negative total, a block size below 1, or ``file_rows`` that do not add up to
    ``total_rows``: ConfigError.
    """

    total_rows: int
    block_rows: int
    file_rows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not is_int(self.total_rows, numpy=True) or self.total_rows < 0:
            raise ConfigError(f"total_rows must be a non-negative integer, got {self.total_rows!r}")
        _positive("block_rows", self.block_rows)
        if self.file_rows:
            rows = tuple(int(n) for n in self.file_rows)
            if any(n < 0 for n in rows) or sum(rows) != self.total_rows:
                raise ConfigError(f"file_rows {rows[:8]!r}{'...' if len(rows) > 8 else ''} must be non-negative and "
                                  f"add up to total_rows={self.total_rows}")
            object.__setattr__(self, "file_rows", rows if len(rows) > 1 else ())

    @cached_property
    def bounds(self) -> np.ndarray:
        """Every block's first global row, then ``total_rows`` (int64, ``n_blocks + 1`` of them)."""
        if not self.file_rows:
            return np.append(np.arange(0, self.total_rows, self.block_rows, dtype=np.int64), self.total_rows)
        starts = [off + np.arange(0, n, self.block_rows, dtype=np.int64)
                  for off, n in zip(self.file_starts[:-1].tolist(), self.file_rows)]
        return np.append(np.concatenate(starts), self.total_rows).astype(np.int64)

    @cached_property
    def file_starts(self) -> np.ndarray:
        """Each file's first global row, then ``total_rows`` (one file: ``[0, total_rows]``)."""
        counts = self.file_rows or (self.total_rows,)
        return np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))]).astype(np.int64)

    @property
    def n_blocks(self) -> int:
        return len(self.bounds) - 1

    @property
    def full_blocks(self) -> int:
        """Blocks of ``block_rows`` rows."""
        return int((np.diff(self.bounds) == self.block_rows).sum())

    @cached_property
    def short_ids(self) -> np.ndarray:
        """The blocks shorter than ``block_rows`` (one file: at most its last), in order."""
        return np.flatnonzero(np.diff(self.bounds) != self.block_rows).astype(np.int64)

    @cached_property
    def full_ids(self) -> np.ndarray:
        """The blocks of ``block_rows`` rows, in order."""
        return np.flatnonzero(np.diff(self.bounds) == self.block_rows).astype(np.int64)

    def span(self, block: int) -> tuple[int, int]:
        """Global rows ``[a, b)`` of ``block``."""
        return int(self.bounds[block]), int(self.bounds[int(block) + 1])

    def locate(self, block: int) -> tuple[int, int, int]:
        """``(file, a, b)``: the file holding ``block`` and its rows ``[a, b)`` in that file."""
        a, b = self.span(block)
        i = int(np.searchsorted(self.file_starts, a, "right")) - 1
        start = int(self.file_starts[i])
        return i, a - start, b - start

    def sizes(self, blocks: np.ndarray) -> np.ndarray:
        """Rows of each of ``blocks``."""
        blocks = np.asarray(blocks, dtype=np.int64)
        return self.bounds[blocks + 1] - self.bounds[blocks]

    def block_of(self, rows: np.ndarray) -> np.ndarray:
        """The block holding each of the global ``rows``."""
        rows = np.asarray(rows, dtype=np.int64)
        if not self.file_rows:
            return rows // self.block_rows
        return np.searchsorted(self.bounds, rows, "right") - 1


def block_unit(chunk_rows: Sequence[int]) -> int:
    """The rows every block is a multiple of: whole chunks of every key (their least common
    multiple; ``1`` for a key stored contiguously, pass 1 for it)."""
    unit = 1
    for rows in chunk_rows:
        unit = math.lcm(unit, _positive("chunk rows", rows))
    return unit


def default_block_rows(unit: int, row_bytes: int, total_rows: int, target: int = DEFAULT_BLOCK_BYTES) -> int:
    """Whole ``unit``s (chunks) of rows, about ``target`` bytes of ``row_bytes`` rows (at
    least one unit; never more units than the file has rows)."""
    unit, row_bytes = _positive("unit", unit), max(int(row_bytes), 1)
    units = max(round(target / (unit * row_bytes)), 1)
    return unit * min(units, max(-(-int(total_rows) // unit), 1))


def check_block_rows(block_rows: object, unit: int, chunks: str = "") -> int:
    """``block_rows`` when it is a positive multiple of ``unit`` (whole chunks).

    Raised when it is not: ConfigError naming both numbers (``chunks`` says which keys'
    chunks make up ``unit``)."""
    rows = _positive("block_rows", block_rows)
    if rows % unit:
        lower, upper = rows // unit * unit, (rows // unit + 1) * unit
        fix = (f"use e.g. block_rows={lower} or {upper}" if lower else
               f"use block_rows={unit} (the smallest block) or a multiple of it")
        raise ConfigError(
            f"block_rows={rows} is not a whole number of chunks: blocks must be multiples of {unit} rows"
            f"{f' ({chunks})' if chunks else ''}; {fix}")
    return rows


def _rng(seed: int, epoch: int, tag: int, node: int = 0) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed) % 2**64, int(epoch) % 2**64, tag, int(node)]))


def _check_nodes(layout: BlockLayout, num_nodes: int) -> int:
    nodes = _positive("num_nodes", num_nodes)
    if layout.total_rows and layout.n_blocks < nodes:
        raise ConfigError(
            f"{layout.n_blocks} blocks of {layout.block_rows} rows cannot be dealt to {nodes} nodes (a node reads "
            f"whole blocks): use smaller blocks (block_rows=) or fewer nodes")
    return nodes


def _deal(layout: BlockLayout, nodes: int, seed: int, epoch: int, shuffle: bool) -> list[np.ndarray]:
    """Every node's blocks this epoch, in the order its window takes them (module docstring,
    step 1). The short blocks (a file's last, when its rows are not whole blocks) are dealt
    one at a time, in an order permuted per epoch, each to the first node with the fewest
    rows; each is put anywhere in its node's order but last when the node has a full block
    (the tail that pads the epoch stays full-sized). ``shuffle=False``: each node's blocks in
    file order."""
    full = layout.full_ids
    if shuffle:
        full = _rng(seed, epoch, _TAG_BLOCKS).permutation(full)
    mine = [full[j::nodes] for j in range(nodes)]
    rows = [len(m) * layout.block_rows for m in mine]
    shorts: list[list[int]] = [[] for _ in range(nodes)]
    order = layout.short_ids
    if shuffle and len(order) > 1:
        order = _rng(seed, epoch, _TAG_DEAL).permutation(order)
    for block, size in zip(order.tolist(), layout.sizes(order).tolist()):
        j = rows.index(min(rows))
        shorts[j].append(block)
        rows[j] += size
    for j in range(nodes):
        if not shuffle:
            mine[j] = np.sort(np.concatenate([mine[j], np.asarray(shorts[j], dtype=np.int64)]))
            continue
        rng = _rng(seed, epoch, _TAG_SHORT, j) if shorts[j] else None
        for block in shorts[j]:
            assert rng is not None
            where = int(rng.integers(0, len(mine[j]))) if len(mine[j]) else 0
            mine[j] = np.insert(mine[j], where, block)
    return mine


def node_rows(layout: BlockLayout, num_nodes: int, *, seed: int = 0, epoch: int = 0,
              shuffle: bool = True) -> list[int]:
    """Rows every node reads in ``epoch``, node 0 first: the same every epoch unless many
    files leave short blocks of several sizes (they are dealt per epoch); the nodes differ by
    at most one block.

    Raised when there are fewer blocks than nodes: ConfigError."""
    nodes = _check_nodes(layout, num_nodes)
    if len(layout.short_ids) <= 1:  # no dealing needed: full blocks round-robin, the short one to the fewest
        rows = [len(range(j, layout.full_blocks, nodes)) * layout.block_rows for j in range(nodes)]
        if len(layout.short_ids):
            rows[rows.index(min(rows))] += int(layout.sizes(layout.short_ids)[0])
        return rows
    return [int(layout.sizes(m).sum()) for m in _deal(layout, nodes, seed, epoch, shuffle)]


def max_node_blocks(layout: BlockLayout, num_nodes: int, node: int) -> int:
    """The most blocks ``node`` reads in any epoch (what its window must hold to hold them all)."""
    nodes = _check_nodes(layout, num_nodes)
    full = len(range(node, layout.full_blocks, nodes))
    shorts = len(layout.short_ids)
    if shorts <= 1:
        return full + (1 if shorts and layout.full_blocks % nodes == node else 0)
    return full + shorts if nodes > 1 else layout.n_blocks


def node_blocks(layout: BlockLayout, num_nodes: int, node: int, *, seed: int, epoch: int,
                shuffle: bool = True) -> np.ndarray:
    """The blocks ``node`` reads this epoch, in the order its window takes them."""
    nodes = _check_nodes(layout, num_nodes)
    if not 0 <= node < nodes:
        raise ConfigError(f"node must be in [0, {nodes - 1}], got {node}")
    return _deal(layout, nodes, seed, epoch, shuffle)[node]


def _key_ranges(m: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """``[lo_k, hi_k)`` of the keys of block ``k`` of ``m`` through a window of ``window`` blocks."""
    w = min(window, m)
    k = np.arange(m, dtype=np.float64)
    lo = np.maximum(k - w + 1, np.floor(k / 2))  # the ramp: block k starts at k/2 until the window is full
    hi = np.where(k < m - w, k + 1, float(m))
    return lo, hi


def node_sequence(layout: BlockLayout, blocks: np.ndarray, window: int, *, seed: int, epoch: int, node: int,
                  shuffle: bool = True, run: int = 1) -> np.ndarray:
    """The global rows of ``blocks`` in the order the node serves them (module docstring,
    step 2): int64, each row once, drawn in stratified runs of ``run`` rows (the node's local
    ranks; 0: uniform keys, the draw before runs; h5serve/order/stream_draw.py).
    ``shuffle=False``: the blocks' rows in file order, one block after another."""
    window = _positive("window", window)
    if not is_int(run, numpy=True) or run < 0:
        raise ConfigError(f"run must be a non-negative integer, got {run!r}")
    blocks = np.asarray(blocks, dtype=np.int64)
    sizes = layout.sizes(blocks)
    starts = layout.bounds[blocks]
    if not shuffle or not int(sizes.sum()):
        return block_rows(starts, sizes)
    lo, hi = _key_ranges(len(blocks), window)
    return draw_sequence(starts, sizes, lo, hi, run, _rng(seed, epoch, _TAG_KEYS, node))


def window_for(capacity: int, blocks: int, block_rows: int, batch_size: int, local_world_size: int,
               block_bytes: int = 0) -> int:
    """The order's window ``W`` (blocks) for a node that holds at most ``capacity`` blocks:
    every block of the node when they fit, else ``capacity`` minus the blocks one step (a
    batch on each of the ``L`` local ranks, ``batch_size * L`` consecutive rows of the
    sequence) can start as the window slides: ``ceil(batch_size * L / block_rows) + 1``.

    Raised when that leaves no block: ConfigError naming the numbers (``block_bytes``, when
    given, to say how large a window would do)."""
    capacity, blocks = _positive("window (blocks)", capacity), int(blocks)
    check_batch_size(batch_size)
    if blocks <= capacity:
        return max(blocks, 1)
    step = batch_size * _positive("local_world_size", local_world_size)
    turnover = -(-2 * step // _positive("block_rows", block_rows)) + 1
    if capacity - turnover < 1:
        need = f" ({format_bytes((turnover + 1) * block_bytes)})" if block_bytes else ""
        raise ConfigError(
            f"the window holds {capacity} blocks of {block_rows} rows, but one batch on each of the "
            f"{local_world_size} local ranks ({batch_size} x {local_world_size} = {step} rows) can need "
            f"{turnover} blocks besides the window's own: pass a window of at least {turnover + 1} blocks{need}, "
            "a smaller batch_size, or smaller blocks (block_rows=)")
    return capacity - turnover


@dataclass(frozen=True)
class NodeEpoch:
    """One node's epoch, dealt: ``sequence`` (global rows, ``samples * local_world_size`` of
    them; local rank ``l`` reads ``sequence[l::L]``), and for every block the node reads
    (``blocks``), the first and last position in ``sequence`` that uses it."""

    sequence: np.ndarray
    local_world_size: int
    samples: int
    batches: int
    blocks: np.ndarray
    first_use: np.ndarray
    last_use: np.ndarray

    def rank_rows(self, local_rank: int) -> np.ndarray:
        """Local rank ``local_rank``'s ``samples`` rows, in order."""
        return self.sequence[local_rank :: self.local_world_size]


def _pad(sequence: np.ndarray, length: int) -> np.ndarray:
    """``sequence`` cut to ``length``, or padded by repeating its last rows."""
    if length <= len(sequence):
        return sequence[:length]
    if not len(sequence):
        raise ConfigError(f"an empty node sequence cannot be padded to {length} samples")
    extra = length - len(sequence)
    tail = np.tile(sequence, -(-extra // len(sequence)))[-extra:] if extra > len(sequence) else sequence[-extra:]
    return np.concatenate([sequence, tail])


def _uses(layout: BlockLayout, sequence: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The blocks ``sequence`` uses (in block order), each one's first and last position: O(rows)."""
    if not len(sequence):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    ids = layout.block_of(sequence)
    where = np.arange(len(ids), dtype=np.int64)
    first = np.full(layout.n_blocks, len(ids), dtype=np.int64)
    last = np.full(layout.n_blocks, -1, dtype=np.int64)
    np.minimum.at(first, ids, where)  # O(rows), where np.unique sorts them
    np.maximum.at(last, ids, where)
    blocks = np.flatnonzero(last >= 0).astype(np.int64)
    return blocks, first[blocks], last[blocks]


def node_epoch(layout: BlockLayout, *, seed: int, epoch: int, num_nodes: int, node: int, window: int,
               local_world_size: int, batch_size: int, drop_last: bool = False, shuffle: bool = True,
               offset: int = 0, run: int | None = None) -> NodeEpoch:
    """Node ``node``'s epoch dealt to its ``local_world_size`` ranks, equal samples and
    batches on every rank of every node (every node runs ``local_world_size`` ranks).
    ``offset``: the node has served the first ``offset`` rows of its sequence already (a
    resume; every node the same number): only the rest is dealt. ``run``: the runs the
    sequence is drawn in (node_sequence), by default ``local_world_size``; a resume with
    another number of local ranks passes the saved one, so that the sequence is the same.

    Raised for bad arguments, fewer blocks than nodes, or when ``drop_last`` (or a resume
    near an epoch's end) leaves some rank without a batch: ConfigError."""
    local = _positive("local_world_size", local_world_size)
    check_batch_size(batch_size)
    if not is_int(offset, numpy=True) or offset < 0:
        raise ConfigError(f"offset must be a non-negative integer, got {offset!r}")
    left = [max(n - int(offset), 0) for n in node_rows(layout, num_nodes, seed=seed, epoch=epoch, shuffle=shuffle)]
    sizes = [len(range(rank, n, local)) for n in left for rank in range(local)]
    size = equal_epoch_size(sizes, batch_size, drop_last)
    blocks = node_blocks(layout, num_nodes, node, seed=seed, epoch=epoch, shuffle=shuffle)
    sequence = node_sequence(layout, blocks, window, seed=seed, epoch=epoch, node=node, shuffle=shuffle,
                             run=local if run is None else run)
    dealt = _pad(sequence[int(offset):], size.samples * local)
    used, first, last = _uses(layout, dealt)
    return NodeEpoch(dealt, local, size.samples, size.batches, used, first, last)


def resident_counts(first_use: np.ndarray, last_use: np.ndarray, length: int, step: int = 1) -> np.ndarray:
    """How many blocks a window holds at each of ``length`` positions (``step > 1``: at each
    step of ``step`` positions, a block held from the step of its first use to that of its
    last), when it loads every block just before its first use and frees it after its last."""
    steps = -(-int(length) // int(step))
    delta = np.zeros(steps + 1, dtype=np.int64)
    np.add.at(delta, np.asarray(first_use) // step, 1)
    np.add.at(delta, np.asarray(last_use) // step + 1, -1)
    return np.cumsum(delta)[:steps]


def neighbour_entropy(order: np.ndarray) -> float:
    """MosaicML Streaming's shuffle-quality figure: the entropy (bits) of the absolute
    differences between neighbouring indices of ``order`` (file order: 0; a full permutation of
    n rows: about log2(n) - 0.6)."""
    order = np.asarray(order, dtype=np.int64)
    if len(order) < 2:
        return 0.0
    counts = np.bincount(np.abs(np.diff(order)))
    p = counts[counts > 0] / (len(order) - 1)
    return float(-(p * np.log2(p)).sum()) + 0.0  # never -0.0
