"""Stream mode's order over many files (h5serve/order/stream_order.py, ``BlockLayout(file_rows=)``):
each file cut into blocks on its own (a block never spans two files), every row once per epoch
on any number of nodes and ranks, node row counts within a block of each other, a pure
function of (seed, epoch, layout, nodes), file order without shuffle, the window's bound."""

from __future__ import annotations

import numpy as np
import pytest

from h5serve.errors import ConfigError
from h5serve.order.stream_order import BlockLayout, max_node_blocks, node_blocks, node_epoch, node_rows, resident_counts

FILES = (300, 77, 800, 41, 200, 64, 0, 5)
LAYOUT = BlockLayout(sum(FILES), 64, FILES)


def test_each_file_is_cut_into_blocks_of_its_own() -> None:
    starts = np.cumsum([0, *FILES])
    assert LAYOUT.n_blocks == sum(-(-n // 64) for n in FILES) == 27
    sizes = LAYOUT.sizes(np.arange(LAYOUT.n_blocks))
    assert sizes.sum() == LAYOUT.total_rows and sizes.max() == 64
    assert sorted(sizes[sizes < 64].tolist()) == [5, 8, 13, 32, 41, 44]  # each file's short last block
    for block in range(LAYOUT.n_blocks):
        a, b = LAYOUT.span(block)
        i, la, lb = LAYOUT.locate(block)
        assert starts[i] <= a < b <= starts[i + 1] and (la, lb) == (a - starts[i], b - starts[i])
    rows = np.arange(LAYOUT.total_rows)
    assert np.array_equal(LAYOUT.block_of(rows), np.repeat(np.arange(LAYOUT.n_blocks), sizes))


def test_one_file_is_the_single_file_layout() -> None:
    assert BlockLayout(1000, 64, (1000,)) == BlockLayout(1000, 64)
    with pytest.raises(ConfigError, match="add up to total_rows=10"):
        BlockLayout(10, 4, (3, 4))


@pytest.mark.parametrize(("nodes", "local"), [(1, 1), (1, 3), (2, 2), (3, 1), (4, 2)])
@pytest.mark.parametrize("epoch", [0, 1, 7])
def test_every_row_once_per_epoch_on_any_nodes(nodes: int, local: int, epoch: int) -> None:
    rows = node_rows(LAYOUT, nodes, seed=3, epoch=epoch)
    assert sum(rows) == LAYOUT.total_rows and max(rows) - min(rows) <= 64  # within a block of each other
    seen = []
    for node in range(nodes):
        e = node_epoch(LAYOUT, seed=3, epoch=epoch, num_nodes=nodes, node=node, window=4, local_world_size=local,
                       batch_size=16)
        seen.append(e.sequence[:rows[node]])
        blocks = node_blocks(LAYOUT, nodes, node, seed=3, epoch=epoch)
        assert len(blocks) <= max_node_blocks(LAYOUT, nodes, node)
        assert set(LAYOUT.block_of(e.sequence).tolist()) <= set(blocks.tolist())  # only its own blocks
        assert resident_counts(e.first_use, e.last_use, len(e.sequence)).max() <= 4
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(LAYOUT.total_rows))


def test_a_pure_function_of_seed_epoch_layout_and_nodes() -> None:
    def order(seed: int, epoch: int, layout: BlockLayout = LAYOUT) -> list[np.ndarray]:
        return [node_epoch(layout, seed=seed, epoch=epoch, num_nodes=2, node=n, window=5, local_world_size=2,
                           batch_size=16).sequence for n in range(2)]

    same = [np.array_equal(a, b) for a, b in zip(order(1, 2), order(1, 2))]
    assert all(same)
    assert not np.array_equal(order(1, 2)[0], order(1, 3)[0]) and not np.array_equal(order(1, 2)[0], order(2, 2)[0])
    other = BlockLayout(LAYOUT.total_rows, 64, (301, 76, 800, 41, 200, 64, 0, 5))  # same rows, other files
    assert not np.array_equal(order(1, 2)[0], order(1, 2, other)[0])
    # the short blocks go to other nodes in other epochs
    deals = {tuple(sorted(set(node_blocks(LAYOUT, 2, 0, seed=1, epoch=e).tolist()) & set(LAYOUT.short_ids.tolist())))
             for e in range(8)}
    assert len(deals) > 1


def test_without_shuffle_each_node_reads_its_blocks_in_file_order() -> None:
    e = node_epoch(LAYOUT, seed=0, epoch=0, num_nodes=1, node=0, window=4, local_world_size=1, batch_size=16,
                   shuffle=False)
    assert np.array_equal(e.sequence[:LAYOUT.total_rows], np.arange(LAYOUT.total_rows))


def test_fewer_blocks_than_nodes_is_refused() -> None:
    with pytest.raises(ConfigError, match="2 blocks of 64 rows cannot be dealt to 3 nodes"):
        node_rows(BlockLayout(70, 64, (60, 10)), 3)


def test_a_mid_epoch_resume_needs_the_same_files() -> None:
    from h5serve.client.samplers.node import NodePlace
    from h5serve.client.streaming.sampler import StreamSampler

    place = NodePlace(0, 1, 0, 1)
    sampler = StreamSampler(LAYOUT, 16, place, 8, seed=2)
    sampler.set_epoch(1)
    it = iter(sampler)
    want = [next(it).rows for _ in range(30)]
    state = sampler.state_dict(consumed=10 * 16)
    again = StreamSampler(LAYOUT, 16, place, 8, seed=0)
    again.load_state_dict(state)
    assert all(np.array_equal(a.rows, b) for a, b in zip(again, want[10:]))
    other = BlockLayout(LAYOUT.total_rows, 64, (301, 76, *FILES[2:]))  # the same rows split otherwise
    with pytest.raises(ConfigError, match=r"file_rows=8 files of 300, 77, 800, 41, ... rows \(this job: 8 files of "
                                          r"301, 76, 800, 41, ... rows\)"):
        StreamSampler(other, 16, place, 8).load_state_dict(state)
    StreamSampler(other, 16, place, 8).load_state_dict(state, next_epoch=True)
