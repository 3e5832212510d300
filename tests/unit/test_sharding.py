"""Unit tests for h5serve.order.sharding: which global rows belong to which rank."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from h5serve.errors import ConfigError, H5ServeError
from h5serve.order.sharding import (
    MODES,
    Selection,
    balanced_contiguous_shard,
    interleaved_indices,
    resolve_rank_world,
    shard_indices,
    validate_shard,
)

# --------------------------------------------------------------------------- contiguous


@pytest.mark.parametrize(
    "total, world, expected",
    [
        (10, 3, [(0, 4), (4, 7), (7, 10)]),  # 10 % 3 == 1: rank 0 gets the extra row
        (11, 3, [(0, 4), (4, 8), (8, 11)]),  # 11 % 3 == 2: ranks 0 and 1 get one extra
        (12, 3, [(0, 4), (4, 8), (8, 12)]),  # even split
        (7, 1, [(0, 7)]),
        (2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)]),  # more ranks than rows
        (0, 3, [(0, 0), (0, 0), (0, 0)]),  # empty dataset
        (0, 1, [(0, 0)]),
        (1, 2, [(0, 1), (1, 1)]),
    ],
)
def test_balanced_contiguous_shard_known_values(total, world, expected):
    assert [balanced_contiguous_shard(total, world, r) for r in range(world)] == expected


def test_balanced_contiguous_shard_returns_plain_ints():
    start, end = balanced_contiguous_shard(10, 3, 1)
    assert type(start) is int and type(end) is int


def test_first_total_mod_world_ranks_get_one_extra_row():
    total, world = 103, 10  # 3 extra rows
    sizes = [end - start for start, end in (balanced_contiguous_shard(total, world, r) for r in range(world))]
    assert sizes == [11, 11, 11] + [10] * 7


def test_zero_length_shards_are_valid_and_empty():
    start, end = balanced_contiguous_shard(3, 8, 7)
    assert start == end == 3
    idx = shard_indices(3, 8, 7, "contiguous")
    assert idx.dtype == np.int64 and idx.shape == (0,)
    idx = shard_indices(3, 8, 7, "interleave")
    assert idx.dtype == np.int64 and idx.shape == (0,)


@given(total=st.integers(0, 2000), world=st.integers(1, 70))
def test_contiguous_shards_partition_rows_in_rank_order(total, world):
    bounds = [balanced_contiguous_shard(total, world, r) for r in range(world)]
    # contiguous, adjacent, in rank order, covering [0, total)
    assert bounds[0][0] == 0
    assert bounds[-1][1] == total
    for (_s0, e0), (s1, _e1) in zip(bounds, bounds[1:]):
        assert e0 == s1
    sizes = [e - s for s, e in bounds]
    assert min(sizes) >= 0
    assert max(sizes) - min(sizes) <= 1
    extra = total % world
    assert sizes == [total // world + 1] * extra + [total // world] * (world - extra)
    joined = np.concatenate([shard_indices(total, world, r, "contiguous") for r in range(world)])
    np.testing.assert_array_equal(joined, np.arange(total))


@given(total=st.integers(0, 2000), world=st.integers(1, 70))
def test_interleaved_shards_partition_rows(total, world):
    shards = [shard_indices(total, world, r, "interleave") for r in range(world)]
    for r, idx in enumerate(shards):
        assert idx.dtype == np.int64
        assert np.all(idx % world == r)
        assert np.all(np.diff(idx) == world)  # strictly increasing, step world_size
        assert len(idx) == len(range(r, total, world))
        assert Selection("interleave", world, r).count(total) == len(idx)
    joined = np.sort(np.concatenate(shards))
    np.testing.assert_array_equal(joined, np.arange(total))  # disjoint and complete
    sizes = [len(idx) for idx in shards]
    assert max(sizes) - min(sizes) <= 1


@given(total=st.integers(0, 500), world=st.integers(1, 40), data=st.data())
def test_selection_matches_free_functions(total, world, data):
    rank = data.draw(st.integers(0, world - 1))
    mode = data.draw(st.sampled_from(MODES))
    sel = Selection(mode, world, rank)
    idx = sel.indices(total)
    np.testing.assert_array_equal(idx, shard_indices(total, world, rank, mode))
    assert sel.count(total) == len(idx)


# --------------------------------------------------------------------------- interleaved


def test_interleaved_indices_known_values():
    np.testing.assert_array_equal(interleaved_indices(10, 3, 0), [0, 3, 6, 9])
    np.testing.assert_array_equal(interleaved_indices(10, 3, 1), [1, 4, 7])
    np.testing.assert_array_equal(interleaved_indices(10, 3, 2), [2, 5, 8])
    assert interleaved_indices(0, 3, 0).shape == (0,)
    assert interleaved_indices(2, 4, 3).shape == (0,)
    assert interleaved_indices(10, 3, 0).dtype == np.int64


def test_shard_indices_default_mode_is_contiguous():
    np.testing.assert_array_equal(shard_indices(10, 3, 1), [4, 5, 6])
    np.testing.assert_array_equal(shard_indices(10, 3, 1, "interleave"), [1, 4, 7])


def test_shard_indices_are_int64_in_both_modes():
    for mode in MODES:
        assert shard_indices(5, 2, 0, mode).dtype == np.int64


# --------------------------------------------------------------------------- validation


BAD_RANK_WORLD = [
    pytest.param(0, 0, id="world_size=0"),
    pytest.param(-1, 0, id="world_size<0"),
    pytest.param(3, 3, id="rank==world_size"),
    pytest.param(3, 7, id="rank>world_size"),
    pytest.param(3, -1, id="rank<0"),
    pytest.param(2.0, 0, id="world_size float"),
    pytest.param("2", 0, id="world_size str"),
    pytest.param(None, 0, id="world_size None"),
    pytest.param(True, 0, id="world_size bool"),
    pytest.param(2, 1.0, id="rank float"),
    pytest.param(2, "1", id="rank str"),
    pytest.param(2, None, id="rank None"),
    pytest.param(2, False, id="rank bool"),
]


@pytest.mark.parametrize("world, rank", BAD_RANK_WORLD)
def test_balanced_contiguous_shard_rejects_bad_rank_world(world, rank):
    with pytest.raises(ConfigError):
        balanced_contiguous_shard(10, world, rank)


@pytest.mark.parametrize("world, rank", BAD_RANK_WORLD)
def test_interleaved_indices_rejects_bad_rank_world(world, rank):
    with pytest.raises(ConfigError):
        interleaved_indices(10, world, rank)


@pytest.mark.parametrize("world, rank", BAD_RANK_WORLD)
@pytest.mark.parametrize("mode", MODES)
def test_shard_indices_and_selection_reject_bad_rank_world(world, rank, mode):
    with pytest.raises(ConfigError):
        shard_indices(10, world, rank, mode)
    with pytest.raises(ConfigError):
        Selection(mode, world, rank)


@pytest.mark.parametrize("mode", ["blocks", "", "Contiguous", None, 0, "interleaved"])
def test_bad_mode_is_config_error(mode):
    with pytest.raises(ConfigError, match="mode"):
        shard_indices(10, 2, 0, mode)
    with pytest.raises(ConfigError, match="mode"):
        Selection(mode, 2, 0)
    with pytest.raises(ConfigError, match="mode"):
        validate_shard(mode, 2, 0)


def test_config_error_is_an_h5serve_error_and_value_error():
    with pytest.raises(H5ServeError):
        balanced_contiguous_shard(10, 0, 0)
    with pytest.raises(ValueError):
        balanced_contiguous_shard(10, 0, 0)


@pytest.mark.parametrize("fn", [balanced_contiguous_shard, interleaved_indices, shard_indices])
def test_negative_total_is_config_error(fn):
    with pytest.raises(ConfigError, match="total"):
        fn(-1, 2, 0)


@pytest.mark.parametrize("fn", [balanced_contiguous_shard, interleaved_indices])
@pytest.mark.parametrize("total", [2.5, "10", None, True, 10.0])
def test_non_integer_total_is_config_error(fn, total):
    # regression: total=2.5 used to give float bounds (1.5, 2.5) and total="10" a bare TypeError
    with pytest.raises(ConfigError):
        fn(total, 2, 0)


def test_numpy_integers_are_accepted():
    assert balanced_contiguous_shard(np.int64(10), np.int64(3), np.int32(1)) == (4, 7)
    np.testing.assert_array_equal(interleaved_indices(np.int64(10), 3, 1), [1, 4, 7])
    np.testing.assert_array_equal(interleaved_indices(10, np.int64(3), np.int64(1)), [1, 4, 7])
    sel = Selection("contiguous", np.int64(2), np.int64(1))
    np.testing.assert_array_equal(sel.indices(5), [3, 4])


def test_selection_is_frozen_and_hashable():
    sel = Selection("interleave", 4, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sel.rank = 2  # type: ignore[misc]
    assert sel == Selection("interleave", 4, 1)
    assert hash(sel) == hash(Selection("interleave", 4, 1))
    assert sel != Selection("contiguous", 4, 1)


def test_selection_count_contiguous():
    assert [Selection("contiguous", 3, r).count(10) for r in range(3)] == [4, 3, 3]
    assert [Selection("contiguous", 4, r).count(2) for r in range(4)] == [1, 1, 0, 0]
    assert Selection("contiguous", 3, 2).count(0) == 0


# --------------------------------------------------------------------------- resolve_rank_world


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return monkeypatch


def test_resolve_defaults_to_single_process(clean_env):
    assert resolve_rank_world() == (0, 1)


def test_resolve_reads_env(clean_env):
    clean_env.setenv("RANK", "2")
    clean_env.setenv("WORLD_SIZE", "4")
    rank, world = resolve_rank_world()
    assert (rank, world) == (2, 4)
    assert type(rank) is int and type(world) is int


def test_resolve_explicit_args_win_over_env(clean_env):
    clean_env.setenv("RANK", "2")
    clean_env.setenv("WORLD_SIZE", "4")
    assert resolve_rank_world(1, 3) == (1, 3)
    assert resolve_rank_world(rank=0, world_size=1) == (0, 1)


def test_resolve_explicit_args_do_not_read_bad_env(clean_env):
    clean_env.setenv("RANK", "not-a-number")
    clean_env.setenv("WORLD_SIZE", "also-bad")
    assert resolve_rank_world(0, 2) == (0, 2)


def test_resolve_mixes_explicit_and_env(clean_env):
    clean_env.setenv("RANK", "5")
    clean_env.setenv("WORLD_SIZE", "8")
    assert resolve_rank_world(rank=3) == (3, 8)
    assert resolve_rank_world(world_size=16) == (5, 16)


def test_resolve_only_world_size_in_env(clean_env):
    clean_env.setenv("WORLD_SIZE", "4")
    assert resolve_rank_world() == (0, 4)


def test_resolve_empty_env_is_unset(clean_env):
    clean_env.setenv("RANK", "")
    clean_env.setenv("WORLD_SIZE", "")
    assert resolve_rank_world() == (0, 1)


@pytest.mark.parametrize("name", ["RANK", "WORLD_SIZE"])
@pytest.mark.parametrize("value", ["abc", "1.5", "0x2", "two"])
def test_resolve_bad_env_value_is_config_error(clean_env, name, value):
    clean_env.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        resolve_rank_world()


def test_resolve_env_rank_out_of_range_is_config_error(clean_env):
    clean_env.setenv("RANK", "3")  # WORLD_SIZE unset: defaults to 1
    with pytest.raises(ConfigError, match="rank"):
        resolve_rank_world()
    clean_env.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="rank"):
        resolve_rank_world()


@pytest.mark.parametrize("world", [0, -3])
def test_world_size_below_one_message(world):
    with pytest.raises(ConfigError, match=f"world_size must be >= 1, got {world}"):
        balanced_contiguous_shard(10, world, 0)


def test_resolve_env_world_size_zero_is_config_error(clean_env):
    clean_env.setenv("WORLD_SIZE", "0")
    with pytest.raises(ConfigError, match="world_size must be >= 1"):
        resolve_rank_world()


@pytest.mark.parametrize(
    "rank, world",
    [(-1, 2), (2, 2), (0, 0), ("0", 2), (0, "2"), (True, 2), (0, 1.0)],
)
def test_resolve_bad_explicit_args_are_config_error(clean_env, rank, world):
    with pytest.raises(ConfigError):
        resolve_rank_world(rank, world)


def test_resolve_returns_python_ints_for_numpy_args(clean_env):
    rank, world = resolve_rank_world(np.int64(1), np.int32(2))
    assert (rank, world) == (1, 2)
    assert type(rank) is int and type(world) is int
