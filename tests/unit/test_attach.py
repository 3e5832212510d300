"""client/backends/attach.py: how long a segment evicted before its mapping is asked for again."""

from __future__ import annotations

import time

from h5serve.client.backends.attach import EvictionRetry, asked_again
from h5serve.wire.protocol import AcquireResult


def test_tries_counts_failed_mappings() -> None:
    retry = EvictionRetry(tries=3)
    assert [retry.again(), retry.again(), retry.again()] == [True, True, False]


def test_a_deadline_allows_asking_until_it_passed() -> None:
    assert EvictionRetry(deadline=time.monotonic() + 60).again()
    assert not EvictionRetry(deadline=time.monotonic() - 1).again()


def test_asked_again_is_not_ready_and_keeps_the_name() -> None:
    again = asked_again(AcquireResult("ready", "seg", "/dev/shm"))
    assert (again.state, again.name, again.shm_dir) == ("loading", "seg", "/dev/shm")
