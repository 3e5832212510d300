"""The draw of a node's rows across its window (h5serve/order/stream_draw.py): every rank gets
its share of every block, whatever the number of local ranks and the window; neighbours on a
rank seldom come from one block; the shuffle quality this buys at the bench's sizes; and the
draw before stratified runs (uniform keys) still resumes a checkpoint saved with it."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from h5serve.errors import ConfigError
from h5serve.order.stream_draw import draw_sequence
from h5serve.order.stream_order import BlockLayout, neighbour_entropy, node_epoch, node_sequence

pytestmark = pytest.mark.timeout(120)


def _node(layout: BlockLayout, window: int, local: int, run: int | None = None, seed: int = 3):
    return node_epoch(layout, seed=seed, epoch=1, num_nodes=1, node=0, window=window, local_world_size=local,
                      batch_size=16, run=run)


def _share_error(layout: BlockLayout, window: int, local: int, run: int | None = None) -> int:
    """The most rows by which a rank's count of a block misses the block's rows / local ranks
    (over the node's whole sequence, before the epoch is padded to equal batches)."""
    e = _node(layout, window, local, run)
    sequence = e.sequence[: layout.total_rows]
    worst = 0
    for rank in range(local):
        counts = np.bincount(layout.block_of(sequence[rank::local]), minlength=layout.n_blocks)
        worst = max(worst, int(np.abs(counts - layout.sizes(np.arange(layout.n_blocks)) / local).max() + 0.5))
    return worst


@pytest.mark.parametrize(("local", "window"), [(1, 4), (2, 4), (2, 6), (3, 6), (4, 4), (4, 8), (8, 8), (8, 9)])
def test_every_rank_gets_its_share_of_every_block(local: int, window: int) -> None:
    """A window whose block count is a multiple of the ranks used to put a block's rows on the
    same ranks; now each rank gets one row of every group of ``local`` rows of a block."""
    layout = BlockLayout(40_037, 500)  # blocks of 500 rows, the last of 37: groups not always whole
    assert _share_error(layout, window, local) <= 1
    if local > 1:  # the uniform draw scatters: what this test tells apart
        assert _share_error(layout, window, local, run=0) > 5


@pytest.mark.parametrize(("local", "window"), [(1, 5), (2, 6), (3, 6), (4, 8)])
def test_a_rank_seldom_reads_two_rows_of_one_block_in_a_row(local: int, window: int) -> None:
    """Uniform keys: about one neighbour pair in ``window`` from one block; stratified, about one
    in ``window ** 2`` (the last row of a stratum and the first of the next)."""
    layout = BlockLayout(60_000, 600)
    for run, most in ((None, 1.5 / window**2), (0, 0.5 / window)):
        e = _node(layout, window, local, run)
        rows = e.rank_rows(0)
        steady = slice(len(rows) // 4, 3 * len(rows) // 4)  # past the ramp, before the last blocks end together
        blocks = layout.block_of(rows[steady])
        same = float((blocks[1:] == blocks[:-1]).mean())
        assert (same < most) if run is None else (same > most), (run, same)


def test_the_bench_windows_beat_py1e_at_equal_memory() -> None:
    """The bench's file (87,381 rows, 2 ranks) through the windows its 5 / 10 / 25% budgets
    give: rank 0's entropy against py1e's at equal memory there (Streaming's get_shuffle, 8
    seeds: 13.91 / 14.52 / 14.77 bits, docs/benchmarks.md) and a full permutation's."""
    rows = 256 * 1024 * 1024 // 3072
    full = neighbour_entropy(np.random.default_rng(0).permutation(rows)[::2])
    for block, window, py1e in ((512, 5, 13.91), (1024, 6, 14.52), (2560, 6, 14.77)):
        layout = BlockLayout(rows, block)
        ours = [neighbour_entropy(node_epoch(layout, seed=s, epoch=0, num_nodes=1, node=0, window=window,
                                             local_world_size=2, batch_size=256).rank_rows(0)) for s in range(3)]
        uniform = neighbour_entropy(node_epoch(layout, seed=0, epoch=0, num_nodes=1, node=0, window=window,
                                               local_world_size=2, batch_size=256, run=0).rank_rows(0))
        assert min(ours) > max(py1e, uniform + 0.2), (block, ours, uniform)
        assert min(ours) > full - 0.1


def test_the_uniform_draw_is_the_one_checkpoints_were_saved_with() -> None:
    """run=0 gives, bit for bit, the sequence h5serve drew before stratified runs (pinned from
    that code): a state saved with it resumes its epoch on the same rows."""
    e = node_epoch(BlockLayout(10_007, 500), seed=5, epoch=2, num_nodes=2, node=1, window=4, local_world_size=2,
                   batch_size=32, run=0)
    assert e.sequence[:16].tolist() == [9988, 9638, 9529, 9916, 9944, 6721, 6523, 6708, 9554, 6823, 6534, 6735,
                                        6995, 9914, 9658, 6884]
    assert hashlib.sha256(e.sequence.astype("<i8").tobytes()).hexdigest()[:16] == "3c7bbe2c00c24bd8"


@pytest.mark.parametrize("run", [0, 1, 2, 3, 7])
def test_every_row_once_with_blocks_of_mixed_sizes(run: int) -> None:
    rng = np.random.default_rng(run)
    sizes = rng.integers(1, 40, 50)
    starts = np.cumsum(sizes) - sizes + 1000
    lo = np.maximum(np.arange(50.0) - 4, 0)
    hi = np.arange(50.0) + 1
    got = draw_sequence(starts, sizes, lo, hi, run, rng)
    assert got.dtype == np.int64
    assert np.array_equal(np.sort(got), 1000 + np.arange(int(sizes.sum())))
    if run > 1:  # each group's rows together: no more stretches of one block than groups
        owner = np.searchsorted(starts, got, "right") - 1
        stretches = 1 + int(np.count_nonzero(np.diff(owner)))
        assert stretches <= int((-(-sizes // run)).sum()) < len(got)


def test_deterministic_and_a_bad_run_is_refused() -> None:
    layout = BlockLayout(5000, 250)
    a = node_sequence(layout, np.arange(20), 4, seed=1, epoch=0, node=0, run=3)
    assert np.array_equal(a, node_sequence(layout, np.arange(20), 4, seed=1, epoch=0, node=0, run=3))
    assert not np.array_equal(a, node_sequence(layout, np.arange(20), 4, seed=1, epoch=0, node=0, run=2))
    for bad in (-1, 1.5, "2"):
        with pytest.raises(ConfigError, match="run must be a non-negative integer"):
            node_sequence(layout, np.arange(20), 4, seed=1, epoch=0, node=0, run=bad)  # type: ignore[arg-type]
