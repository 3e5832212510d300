"""The control loop waits for a file's resolution RESOLVE_WAIT_S in all, however many acquires
for it arrive meanwhile (daemon/access/resolver.py): a stream job's first prefetch sends one acquire per
block and key, and each used to hold the loop for RESOLVE_WAIT_S (16 of them: 0.8 s)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from h5serve.daemon.access.peer import Peer
from h5serve.daemon.access.resolver import RESOLVE_WAIT_S, Resolver

pytestmark = pytest.mark.timeout(60)


def test_acquires_during_one_resolution_wait_for_it_once_in_all() -> None:
    release = threading.Event()
    resolver = Resolver()

    def slow_resolve(path: str, key: str, peer: Peer) -> None:  # a file that takes long to inspect
        release.wait(30)

    resolver.resolve = slow_resolve  # type: ignore[method-assign,assignment]
    peer = Peer(os.getuid(), os.getgid(), os.getpid())
    try:
        start = time.monotonic()
        assert resolver.poll("/data/f.h5", "x", peer) is None
        first = time.monotonic() - start
        assert first >= RESOLVE_WAIT_S * 0.9  # the first acquire waits for it briefly
        start = time.monotonic()
        for _ in range(16):  # the rest of the burst: answered "loading" at once
            assert resolver.poll("/data/f.h5", "x", peer) is None
        assert time.monotonic() - start < RESOLVE_WAIT_S
    finally:
        release.set()
        resolver.close()
