"""Which global rows belong to which rank: pure functions, no I/O.

``balanced_contiguous_shard`` and ``interleaved_indices`` keep the predecessor's semantics
(the first ``total % world_size`` ranks get one extra row in contiguous mode).

Every mode's rows are one ``RowRange``, ``range(start, stop, step)`` over the global rows: a
contiguous shard is ``range(a, b)``, an interleaved one ``range(r, total, W)``, the whole file
(``mode="global"``) ``range(0, total)``, a node's block (``mode="node"``: the union of the
contiguous shards of the consecutive ranks ``rank .. rank + span - 1`` on one node)
``range(a, b)``, one block of stream mode (``mode="stream"``, ``block=(a, b)``: explicit global
rows, h5serve/order/stream_order.py) ``range(a, b)``. The range, not the mode, is what a segment
holds, so selections with the same rows (world size 1 in any mode, and global; a stream block
asked by any rank of any job) share one segment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..util.checks import is_int

__all__ = [
    "MODES",
    "GLOBAL",
    "NODE",
    "ALL_MODES",
    "STREAM",
    "WIRE_MODES",
    "RowRange",
    "Selection",
    "balanced_contiguous_shard",
    "interleaved_indices",
    "shard_indices",
    "shard_sizes",
    "as_rows",
    "validate_shard",
    "validate_span",
    "validate_block",
    "node_selection",
    "resolve_rank_world",
]

MODES = ("contiguous", "interleave")  # the sharded modes: every rank its own rows
GLOBAL = "global"  # every rank the whole file, one copy per node
NODE = "node"  # every rank of a node the union of the node's contiguous shards, one copy per node
ALL_MODES = (*MODES, GLOBAL, NODE)  # a dataset's modes that select rows by rank (stream mode deals blocks)
STREAM = "stream"  # SharedH5Dataset(mode="stream"); on the wire: one block, explicit rows ``block=(a, b)``
WIRE_MODES = (*ALL_MODES, STREAM)  # what an acquire may ask for


@dataclass(frozen=True)
class RowRange:
    """Global rows ``range(start, stop, step)``, in canonical form: two ranges are equal
    exactly when they hold the same rows in the same order (an empty range is ``(0, 0, 1)``,
    one row has step 1, ``stop`` is one past the last row)."""

    start: int
    stop: int
    step: int = 1

    @classmethod
    def of(cls, start: int, count: int, step: int = 1) -> RowRange:
        """The ``count`` rows ``start, start + step, ...`` in canonical form."""
        if count <= 0:
            return cls(0, 0, 1)
        step = 1 if count == 1 else int(step)
        return cls(int(start), int(start) + (int(count) - 1) * step + 1, step)

    def __len__(self) -> int:
        return len(range(self.start, self.stop, self.step))

    @property
    def span(self) -> tuple[int, int]:
        """The global rows ``[first, last)`` that hold the range (``(0, 0)`` when empty)."""
        return (self.start, self.stop) if len(self) else (0, 0)

    def indices(self) -> np.ndarray:
        return np.arange(self.start, self.stop, self.step, dtype=np.int64)

    def covers(self, total: int) -> bool:
        """Whether the range is all ``total`` rows in file order (what global mode holds)."""
        return self == RowRange.of(0, total)

    def __str__(self) -> str:
        return f"{self.start}:{self.stop}:{self.step}"


@dataclass(frozen=True)
class Selection:
    """One rank's share of the rows: ``mode`` over ``world_size`` ranks, this ``rank``
    (``mode="global"``: every rank has all rows; ``mode="node"``: ``rank`` is the node's first
    rank and ``span`` its number of consecutive ranks, whose contiguous shards the node holds;
    ``mode="stream"``: the global rows ``block = (start, stop)`` of one block, whoever asks).

    Raised for a bad mode, rank or world size, a ``span`` that is not 1 outside node mode
    or reaches past the last rank, or a ``block`` that is not ``0 <= start < stop`` in stream
    mode or is given in another: ConfigError. ``rows(total)`` raises ConfigError for a block
    past the dataset's last row.
    """

    mode: str
    world_size: int
    rank: int
    span: int = 1
    block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        validate_shard(GLOBAL if self.mode == STREAM else self.mode, self.world_size, self.rank)
        validate_span(self.mode, self.world_size, self.rank, self.span)
        validate_block(self.mode, self.block)
        if self.block is not None:
            object.__setattr__(self, "block", (int(self.block[0]), int(self.block[1])))

    def rows(self, total: int) -> RowRange:
        """The global rows of this selection of ``total`` rows, in local order.

        Raised when a stream block reaches past ``total``: ConfigError naming both."""
        _check_total(total)
        if self.mode == STREAM:
            assert self.block is not None  # validate_block
            start, stop = self.block
            if stop > total:
                raise ConfigError(f"stream block rows [{start}, {stop}) reach past the dataset's {total} rows: ask "
                                  "for blocks of the dataset as it is (the file may have changed since it was opened)")
            return RowRange.of(start, stop - start)
        if self.mode == GLOBAL:
            return RowRange.of(0, total)
        if self.mode == NODE:
            start = balanced_contiguous_shard(total, self.world_size, self.rank)[0]
            stop = balanced_contiguous_shard(total, self.world_size, self.rank + self.span - 1)[1]
            return RowRange.of(start, stop - start)
        if self.mode == "contiguous":
            start, end = balanced_contiguous_shard(total, self.world_size, self.rank)
            return RowRange.of(start, end - start)
        return RowRange.of(self.rank, len(range(self.rank, total, self.world_size)), self.world_size)

    def indices(self, total: int) -> np.ndarray:
        if self.mode in (NODE, STREAM):
            return self.rows(total).indices()
        return shard_indices(total, self.world_size, self.rank, self.mode)

    def first(self, total: int) -> int:
        """Global row of local position 0 (local ``k`` is global ``first + k * step``)."""
        if self.mode == STREAM:
            return self.rows(total).start
        if self.mode in ("contiguous", NODE):
            return balanced_contiguous_shard(total, self.world_size, self.rank)[0]
        return 0 if self.mode == GLOBAL else self.rank

    @property
    def step(self) -> int:
        return self.world_size if self.mode == "interleave" else 1

    def count(self, total: int) -> int:
        return len(self.rows(total))

    def sizes(self, total: int) -> list[int]:
        """Rows in the dataset of every rank of this selection's world, rank 0 first (node
        mode: every rank's contiguous shard, what it is dealt per epoch before equalising; a
        stream block: every rank may read all of it)."""
        if self.mode == STREAM:
            return [self.count(total)] * self.world_size
        return shard_sizes(total, self.world_size, "contiguous" if self.mode == NODE else self.mode)


def as_rows(selection: Selection | RowRange, total: int) -> RowRange:
    """The RowRange of a Selection (of ``total`` rows), or a RowRange as it is."""
    return selection if isinstance(selection, RowRange) else selection.rows(total)


def validate_shard(mode: str, world_size: int, rank: int) -> None:
    """Raise ConfigError unless (mode, world_size, rank) describe a valid selection."""
    if mode not in ALL_MODES:
        raise ConfigError(f"mode must be one of {', '.join(map(repr, ALL_MODES))}, got {mode!r}")
    _check_rank_world(world_size, rank)


def validate_span(mode: str, world_size: int, rank: int, span: int) -> None:
    """Raised when ``span`` (ranks in a node's block) is not a positive integer, is not 1
    outside node mode, or reaches past rank ``world_size - 1``: ConfigError."""
    if not is_int(span, numpy=True) or span < 1:
        raise ConfigError(f"span must be a positive integer (ranks on the node), got {span!r}")
    if span != 1 and mode != NODE:
        raise ConfigError(f"span is the number of ranks on a node, for mode='node' only (mode={mode!r}, span={span})")
    if rank + span > world_size:
        raise ConfigError(f"a node of {span} ranks from rank {rank} reaches past the last rank {world_size - 1}")


def validate_block(mode: str, block: object) -> None:
    """Raised when ``block`` is not ``(start, stop)`` with ``0 <= start < stop`` in stream mode,
    or is given in another mode: ConfigError."""
    if mode != STREAM:
        if block is not None:
            raise ConfigError(f"block rows are for mode='stream' only (mode={mode!r}, block={block!r})")
        return
    if (not isinstance(block, (tuple, list)) or len(block) != 2 or not all(is_int(v, numpy=True) for v in block)
            or not 0 <= block[0] < block[1]):
        raise ConfigError(f"a stream block is its global rows (start, stop) with 0 <= start < stop, got {block!r}")


def _check_rank_world(world_size: int, rank: int) -> None:
    if not is_int(world_size, numpy=True):
        raise ConfigError(f"world_size must be an integer, got {world_size!r}")
    if not is_int(rank, numpy=True):
        raise ConfigError(f"rank must be an integer, got {rank!r}")
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, {world_size - 1}] for world_size={world_size}, got {rank}")


def _check_total(total: int) -> None:
    if not is_int(total, numpy=True) or total < 0:
        raise ConfigError(f"total must be a non-negative integer, got {total!r}")


def balanced_contiguous_shard(total: int, world_size: int, rank: int) -> tuple[int, int]:
    """Start (inclusive) and end (exclusive) of ``rank``'s contiguous slice of ``total`` rows."""
    validate_shard("contiguous", world_size, rank)
    _check_total(total)
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def interleaved_indices(total: int, world_size: int, rank: int) -> np.ndarray:
    """Rows ``rank, rank + world_size, rank + 2 * world_size, ...`` below ``total``."""
    validate_shard("interleave", world_size, rank)
    _check_total(total)
    return np.arange(rank, total, world_size, dtype=np.int64)


def shard_indices(total: int, world_size: int, rank: int, mode: str = "contiguous") -> np.ndarray:
    """Global row numbers of ``rank``'s shard, in local order, as an int64 array."""
    validate_shard(mode, world_size, rank)
    if mode == GLOBAL:
        _check_total(total)
        return np.arange(total, dtype=np.int64)
    if mode == "contiguous":
        start, end = balanced_contiguous_shard(total, world_size, rank)
        return np.arange(start, end, dtype=np.int64)
    return interleaved_indices(total, world_size, rank)


def shard_sizes(total: int, world_size: int, mode: str = "contiguous") -> list[int]:
    """Rows in every rank's shard, rank 0 first. Both sharded modes give the same sizes: the
    first ``total % world_size`` ranks hold one row more. Global mode: every rank has all rows."""
    validate_shard(mode, world_size, 0)
    _check_total(total)
    if mode == GLOBAL:
        return [int(total)] * int(world_size)
    base, extra = divmod(int(total), int(world_size))
    return [base + 1] * extra + [base] * (int(world_size) - extra)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from exc


def resolve_rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """Rank and world size: explicit arguments, else an initialized torch.distributed
    process group, else the RANK / WORLD_SIZE variables torchrun sets, else 0 / 1."""
    if rank is None or world_size is None:
        dist_rank, dist_world = None, None
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist_rank, dist_world = dist.get_rank(), dist.get_world_size()
        except ImportError:  # torch is a dependency, but sharding itself does not need it
            pass
        if world_size is None:
            world_size = dist_world if dist_world is not None else _env_int("WORLD_SIZE")
            world_size = 1 if world_size is None else world_size
        if rank is None:
            rank = dist_rank if dist_rank is not None else _env_int("RANK")
            rank = 0 if rank is None else rank
    _check_rank_world(world_size, rank)
    return int(rank), int(world_size)


def node_selection(world_size: int, ranks: tuple[int, ...] | list[int]) -> Selection:
    """The node-mode Selection of a node running global ``ranks`` (ascending) of ``world_size``:
    the union of their contiguous shards, one block of rows.

    Raised when the node's ranks are not consecutive (their shards would not be one block):
    ConfigError, saying how to launch instead.
    """
    ranks = [int(r) for r in ranks]
    if not ranks:
        raise ConfigError("a node needs at least one rank")
    if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
        shown = ",".join(map(str, ranks[:16])) + ("..." if len(ranks) > 16 else "")
        raise ConfigError(
            f"mode='node' needs the ranks on a node to be consecutive, this node runs ranks {shown}: launch "
            "with consecutive ranks per node (torchrun does; with srun use --distribution=block), or pass "
            "local_rank/local_world_size/node_rank/num_nodes explicitly, or use mode='global' (every row once "
            "per node) or mode='contiguous'"
        )
    return Selection(NODE, int(world_size), ranks[0], len(ranks))
