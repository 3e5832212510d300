"""How many samples and batches every rank yields per epoch: pure functions, no I/O, no torch.

DDP all-reduces the gradients of every batch, so every rank must run the same number of
batches per epoch: a rank with one batch more waits in that batch's all-reduce forever (a
hang, not an error). Shards differ by a row when the rows do not divide evenly (513 rows over
2 ranks: 257 and 256; batch 256: 2 batches and 1). ``equal_epoch_size`` computes, from the
shard sizes of *all* ranks, one epoch size every rank can yield:

- ``drop_last=False``: every rank yields ``max(shard_sizes)`` samples (a shorter shard pads by
  repeating its own epoch order from the start, as ``torch.utils.data.DistributedSampler``
  pads), in ``ceil(max / batch_size)`` batches. The last batch holds ``max % batch_size``
  samples (or is full) on every rank alike: equal samples, then batches, so batch ``k`` has the
  same size everywhere.
- ``drop_last=True``: every rank yields ``floor(min / batch_size)`` full batches; the rest of
  each shard's order is dropped for that epoch.

Every sampling mode plugs in the same way: give it the sizes of all ranks' shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from ..util.checks import is_int

__all__ = ["EpochSize", "check_batch_size", "equal_epoch_size"]


@dataclass(frozen=True)
class EpochSize:
    """What every rank yields per epoch: ``samples`` indices in ``batches`` batches."""

    samples: int
    batches: int


def check_batch_size(batch_size: object) -> None:
    """Raised when ``batch_size`` is not a positive integer: ConfigError."""
    if not is_int(batch_size) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")


def _check_shard_sizes(shard_sizes: Sequence[int]) -> list[int]:
    sizes = list(shard_sizes)
    if not sizes:
        raise ConfigError("shard_sizes must name the shard size of every rank (at least one), got none")
    for size in sizes:
        if not is_int(size) or size < 0:
            raise ConfigError(f"shard sizes must be non-negative integers, got {size!r}")
    return sizes


def _describe(sizes: list[int]) -> str:
    low, high = min(sizes), max(sizes)
    held = f"{low} rows" if low == high else f"{low} to {high} rows"
    return f"the shards of {len(sizes)} rank{'s' if len(sizes) > 1 else ''} hold {held}"


def equal_epoch_size(shard_sizes: Sequence[int], batch_size: int, drop_last: bool) -> EpochSize:
    """The samples and batches every rank yields per epoch, given every rank's shard size.

    Raised when some rank would yield no batch while training needs one from each:
    ConfigError, naming the rows per rank and the batch size — with ``drop_last=True`` when the
    smallest shard holds fewer rows than a batch; with ``drop_last=False`` when a rank's shard
    is empty (it has nothing to repeat) while others are not.
    """
    check_batch_size(batch_size)
    sizes = _check_shard_sizes(shard_sizes)
    low, high = min(sizes), max(sizes)
    if drop_last:
        batches = low // batch_size
        if batches == 0:
            raise ConfigError(
                f"drop_last=True leaves no batch on any rank: every rank yields as many full batches as the "
                f"smallest shard holds, and rank {sizes.index(low)}'s shard has {low} rows, fewer than "
                f"batch_size {batch_size} ({_describe(sizes)}). Use a batch_size of at most {low}, "
                "drop_last=False (short shards repeat samples to fill the last batch), or fewer ranks"
            )
        return EpochSize(samples=batches * batch_size, batches=batches)
    if low == 0 and high > 0:
        raise ConfigError(
            f"rank {sizes.index(0)} has no rows, so it cannot repeat any to match the other ranks' "
            f"{-(-high // batch_size)} batches per epoch ({_describe(sizes)}): use fewer ranks than the "
            "dataset has rows"
        )
    return EpochSize(samples=high, batches=-(-high // batch_size))
