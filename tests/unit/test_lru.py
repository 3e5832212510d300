"""util/lru.py: the bounded cache behind the daemon's memos."""

from __future__ import annotations

import pytest

from h5serve.util.lru import LRU


def test_forgets_the_least_recently_used_one_at_a_time() -> None:
    cache: LRU[str, int] = LRU(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # a used last: b goes first
    cache.put("c", 3)
    assert ("a" in cache, "b" in cache, "c" in cache) == (True, False, True)
    assert len(cache) == 2


def test_put_again_replaces_and_counts_as_a_use() -> None:
    cache: LRU[str, int] = LRU(2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.put("a", 10)
    cache.put("c", 3)
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (10, None, 3)


def test_pop_and_clear() -> None:
    cache: LRU[str, int] = LRU(3)
    cache.put("a", 1)
    assert cache.pop("a") == 1 and cache.pop("a") is None
    cache.put("b", 2)
    cache.clear()
    assert len(cache) == 0


def test_a_capacity_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        LRU(0)
