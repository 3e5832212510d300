"""Stream mode's order (h5serve/order/stream_order.py): every row once per epoch, equal counts on
every rank, deterministic, a node reads only its blocks, the window is never exceeded (counted
at every position and every step), and the shuffle quality against a full permutation."""

from __future__ import annotations

import numpy as np
import pytest

from h5serve.errors import ConfigError
from h5serve.order.equalise import equal_epoch_size
from h5serve.order.stream_order import (
    BlockLayout,
    block_unit,
    check_block_rows,
    default_block_rows,
    neighbour_entropy,
    node_blocks,
    node_epoch,
    node_rows,
    node_sequence,
    resident_counts,
    window_for,
)

LAYOUT = BlockLayout(100_003, 1000)  # 100 full blocks and a short one of 3 rows


def _epoch(layout: BlockLayout, nodes: int, local: int, window: int, *, seed: int = 1, epoch: int = 0,
           batch: int = 64, drop_last: bool = False, shuffle: bool = True, offset: int = 0,
           run: int | None = None) -> list:
    return [node_epoch(layout, seed=seed, epoch=epoch, num_nodes=nodes, node=n, window=window,
                       local_world_size=local, batch_size=batch, drop_last=drop_last, shuffle=shuffle, offset=offset,
                       run=run)
            for n in range(nodes)]


@pytest.mark.parametrize(("nodes", "local"), [(1, 1), (1, 3), (2, 2), (3, 4)])
def test_every_row_once_per_epoch_and_equal_counts(nodes: int, local: int) -> None:
    epochs = _epoch(LAYOUT, nodes, local, window=10)
    rows = node_rows(LAYOUT, nodes)
    seen = []
    for e, n_rows in zip(epochs, rows):
        seen.append(e.sequence[:n_rows])  # before padding
        assert len(e.sequence) == e.samples * local
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(LAYOUT.total_rows))
    sizes = [len(range(r, n, local)) for n in rows for r in range(local)]
    want = equal_epoch_size(sizes, 64, False)
    for e in epochs:
        for r in range(local):
            assert len(e.rank_rows(r)) == want.samples
        assert (e.samples, e.batches) == (want.samples, want.batches)


def test_drop_last_cuts_and_every_rank_runs_the_same_batches() -> None:
    epochs = _epoch(LAYOUT, 3, 2, window=5, drop_last=True)
    rows = np.concatenate([e.sequence for e in epochs])
    assert len(np.unique(rows)) == len(rows)  # cut, never repeated
    assert {e.batches for e in epochs} == {len(epochs[0].rank_rows(0)) // 64}


def test_deterministic_and_different_per_epoch_and_seed() -> None:
    a, b = _epoch(LAYOUT, 2, 2, 10), _epoch(LAYOUT, 2, 2, 10)
    assert all(np.array_equal(x.sequence, y.sequence) for x, y in zip(a, b))
    assert not np.array_equal(a[0].sequence, _epoch(LAYOUT, 2, 2, 10, epoch=1)[0].sequence)
    assert not np.array_equal(a[0].sequence, _epoch(LAYOUT, 2, 2, 10, seed=2)[0].sequence)


def test_node_rows_do_not_change_with_the_epoch_and_differ_by_at_most_a_block() -> None:
    for nodes in (1, 2, 3, 7):
        rows = node_rows(LAYOUT, nodes)
        assert sum(rows) == LAYOUT.total_rows and max(rows) - min(rows) <= LAYOUT.block_rows
        for epoch in range(3):
            got = [len(node_sequence(LAYOUT, node_blocks(LAYOUT, nodes, n, seed=0, epoch=epoch), 4, seed=0,
                                     epoch=epoch, node=n)) for n in range(nodes)]
            assert got == rows


def test_a_node_reads_only_its_blocks() -> None:
    for epoch in range(2):
        epochs = _epoch(LAYOUT, 3, 2, 6, epoch=epoch)
        owned = [set(node_blocks(LAYOUT, 3, n, seed=1, epoch=epoch).tolist()) for n in range(3)]
        assert set().union(*owned) == set(range(LAYOUT.n_blocks))
        assert sum(len(o) for o in owned) == LAYOUT.n_blocks  # dealt, not shared
        for e, mine in zip(epochs, owned):
            assert set((e.sequence // LAYOUT.block_rows).tolist()) <= mine
            assert set(e.blocks.tolist()) <= mine


@pytest.mark.parametrize("window", [1, 2, 10, 33])
@pytest.mark.parametrize(("batch", "local"), [(64, 2), (500, 4), (3000, 2)])
def test_window_is_never_exceeded(window: int, batch: int, local: int) -> None:
    """At every position at most W blocks are in use (loaded at first use, freed after last);
    at every step (a batch on each local rank) at most what ``window_for`` reserved."""
    capacity = window + -(-2 * batch * local // LAYOUT.block_rows) + 1
    for seed in range(3):
        for e in _epoch(LAYOUT, 2, local, window_for(capacity, 60, LAYOUT.block_rows, batch, local), seed=seed,
                        batch=batch):
            w = window_for(capacity, len(e.blocks), LAYOUT.block_rows, batch, local)
            assert resident_counts(e.first_use, e.last_use, len(e.sequence)).max() <= w
            assert resident_counts(e.first_use, e.last_use, len(e.sequence), batch * local).max() <= capacity
            # first and last use are where the sequence really uses each block
            ids = e.sequence // LAYOUT.block_rows
            for block, first, last in zip(e.blocks[:5], e.first_use[:5], e.last_use[:5]):
                where = np.flatnonzero(ids == block)
                assert (where[0], where[-1]) == (first, last)


def test_the_first_batch_needs_two_blocks_and_the_window_ramps_up() -> None:
    """Ready at once: the epoch's first step (a batch on every local rank) draws from two
    blocks, not from the whole window, so a window loads only those before the first batch;
    the blocks drawn from grow with the position until the window's ``W``, and the epoch's
    middle and last rows are drawn across the whole window, not within one block."""
    for local in (1, 2):
        e = _epoch(LAYOUT, 1, local, 10)[0]
        step = 64 * local
        assert len(np.unique(e.sequence[:step] // LAYOUT.block_rows)) == 2
        assert (e.first_use < step).sum() == 2  # what a window must hold for the first step
        spread = [len(np.unique(e.sequence[i: i + 100] // LAYOUT.block_rows)) for i in range(0, 20_000, 1000)]
        assert spread[0] <= 2 and max(spread) >= 8  # the ramp reaches the window within a fifth of the epoch
        assert spread[:4] == sorted(spread[:4])
        middle = e.sequence[50_000:50_100] // LAYOUT.block_rows
        tail = e.sequence[LAYOUT.total_rows - 100: LAYOUT.total_rows] // LAYOUT.block_rows
        assert len(set(middle.tolist())) >= 8 and len(set(tail.tolist())) >= 8
    # every block of the node in the window: still few blocks before the first batch
    e = _epoch(LAYOUT, 1, 1, LAYOUT.n_blocks)[0]
    assert (e.first_use < 64).sum() <= 8


def test_first_and_last_use_match_the_simple_definition() -> None:
    """``first_use``/``last_use`` (computed in O(rows)) are each block's first and last
    position in the dealt sequence, on random layouts of one or many files, nodes, ranks,
    resumes (``offset``), padding and ``drop_last``."""
    rng = np.random.default_rng(7)
    for trial in range(40):
        block = int(rng.integers(1, 200))
        files = tuple(int(n) for n in rng.integers(0, 3000, size=int(rng.integers(1, 5))))
        if sum(files) < 4 * block:
            files = (*files, 4 * block)
        layout = BlockLayout(sum(files), block, files)
        nodes = int(rng.integers(1, min(4, layout.n_blocks) + 1))
        local, batch = int(rng.integers(1, 4)), int(rng.integers(1, 100))
        window = int(rng.integers(1, 30))
        drop_last = bool(trial % 2)
        offset = int(rng.integers(0, 50)) * local
        try:
            epochs = _epoch(layout, nodes, local, window, seed=trial, batch=batch, drop_last=drop_last,
                            shuffle=bool(trial % 5), offset=offset)
        except ConfigError:
            continue  # drop_last or the resume left a rank without a batch
        for e in epochs:
            ids = layout.block_of(e.sequence)
            blocks, first = np.unique(ids, return_index=True)
            last = len(ids) - 1 - np.unique(ids[::-1], return_index=True)[1]
            assert np.array_equal(e.blocks, blocks)
            assert np.array_equal(e.first_use, first) and np.array_equal(e.last_use, last)
            assert e.blocks.dtype == e.first_use.dtype == e.last_use.dtype == np.int64


def test_no_shuffle_is_file_order_on_one_node() -> None:
    e = _epoch(LAYOUT, 1, 1, 10, shuffle=False)[0]
    assert np.array_equal(e.sequence[: LAYOUT.total_rows], np.arange(LAYOUT.total_rows))


def test_resume_offset_deals_the_rest_to_another_number_of_ranks() -> None:
    whole = _epoch(LAYOUT, 2, 2, 10)
    consumed = 64 * 100  # per rank, with 2 local ranks
    rest = _epoch(LAYOUT, 2, 3, 10, offset=consumed * 2, run=2)  # the sequence drawn for the 2 ranks
    for w, r in zip(whole, rest):
        before = w.sequence[: consumed * 2]
        after = r.sequence[: len(w.sequence[: node_rows(LAYOUT, 2)[0]]) - consumed * 2]
        served = np.concatenate([before, after])
        assert np.array_equal(np.sort(served[: len(np.unique(served))]), np.unique(served))
    first = np.concatenate([w.sequence[: consumed * 2] for w in whole])
    later = np.concatenate([r.sequence[: n - consumed * 2] for r, n in zip(rest, node_rows(LAYOUT, 2))])
    assert np.array_equal(np.sort(np.concatenate([first, later])), np.arange(LAYOUT.total_rows))


def test_blocks_are_whole_chunks() -> None:
    assert block_unit([64, 100]) == 1600
    assert block_unit([1, 64]) == 64
    assert check_block_rows(128, 64) == 128
    with pytest.raises(ConfigError, match=r"block_rows=100 is not a whole number of chunks.*multiples of 64"):
        check_block_rows(100, 64, "x: 64 rows a chunk")
    # about 8 MiB of whole chunks, never more chunks than the file has
    rows = default_block_rows(64, 4096, 10**7)
    assert rows % 64 == 0 and 4 << 20 <= rows * 4096 <= 16 << 20
    assert default_block_rows(64, 4096, 100) == 128
    assert default_block_rows(1, 100, 10**9) * 100 == pytest.approx(8 << 20, rel=1e-3)  # contiguous


def test_window_errors_name_the_numbers() -> None:
    assert window_for(5, 3, 1000, 64, 2) == 3  # the node's blocks fit: all of them
    assert window_for(10, 50, 1000, 64, 2) == 8
    with pytest.raises(ConfigError, match=r"window holds 3 blocks of 1000 rows.*512 x 4 = 2048 rows.*6 blocks"):
        window_for(3, 50, 1000, 512, 4)
    with pytest.raises(ConfigError, match="cannot be dealt to 5 nodes"):
        node_rows(BlockLayout(4000, 1000), 5)


def test_shuffle_quality(capsys: pytest.CaptureFixture[str]) -> None:
    """Streaming's metric (entropy of neighbour-index differences, plus that of the blocks'):
    a 10% window against a full permutation and no shuffle, on 1M rows in 100 blocks."""
    layout = BlockLayout(1_000_000, 10_000)
    ours = _epoch(layout, 1, 1, 10)[0].sequence[: layout.total_rows]
    full = np.random.default_rng(0).permutation(layout.total_rows)
    none = np.arange(layout.total_rows)

    def quality(order: np.ndarray) -> tuple[float, float]:
        return neighbour_entropy(order), neighbour_entropy(order // layout.block_rows)

    q = {name: quality(o) for name, o in (("window 10%", ours), ("full", full), ("none", none))}
    with capsys.disabled():
        print("\nshuffle quality (rows, blocks):", {k: (round(a, 2), round(b, 2)) for k, (a, b) in q.items()})
    assert q["none"][0] == 0 and q["none"][1] < 0.01
    assert q["window 10%"][0] > 0.9 * q["full"][0]  # rows: within 10% of a full shuffle's entropy
    assert q["window 10%"][1] > 2.5  # blocks: about log2(10) bits, drawn from the whole window
