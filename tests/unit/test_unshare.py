"""``unshare_inherited_pages`` (daemon/_process.py) in a real forked child: the pages it shares
copy-on-write with its parent become its own, and ``stop`` ends it between two steps.

Each test forks a child that does the work and reports over a pipe; the child leaves with
``os._exit`` and is reaped (killed first if it overran) in ``finally``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable

import pytest

from h5serve.daemon import _process
from h5serve.daemon._process import unshare_inherited_pages

from ..helpers import writable_shared_dirty_kib

pytestmark = pytest.mark.timeout(60)

_BLOCK = 16 * 1024 * 1024


def _in_child(work: Callable[[], dict[str, int]]) -> dict[str, int]:
    """Run ``work`` in a forked child of this process; its result, as JSON over a pipe."""
    block = bytearray(os.urandom(_BLOCK))  # dirty, private to this process until the fork
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.write(w, json.dumps(work()).encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        deadline, data = time.monotonic() + 30, b""
        while chunk := os.read(r, 1 << 16):
            data += chunk
            assert time.monotonic() < deadline
        assert len(block) == _BLOCK  # kept alive (and shared) until the child is done
        return dict(json.loads(data))
    finally:
        os.close(r)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)


def _measured(stop: Callable[[], bool]) -> dict[str, int]:
    before = writable_shared_dirty_kib()
    copied = unshare_inherited_pages(stop)
    return {"before": before, "after": writable_shared_dirty_kib(), "copied": copied}


def test_the_pages_shared_with_the_parent_become_the_childs_own() -> None:
    got = _in_child(lambda: _measured(lambda: False))
    assert got["before"] >= _BLOCK // 1024  # the parent's block, at least, is shared
    assert got["copied"] >= _BLOCK
    assert got["after"] < got["before"] // 10, got


def test_stop_ends_it_between_two_steps() -> None:
    """A job that arrives meanwhile starts at once: at most one step is copied after it came."""
    looks = []

    def stop_at_the_second_look() -> bool:
        looks.append(1)
        return len(looks) > 1

    got = _in_child(lambda: _measured(stop_at_the_second_look))
    assert 0 < got["copied"] <= _process._UNSHARE_STEP_BYTES, got
    assert got["after"] > got["before"] // 2, got  # the rest is still shared
    assert _in_child(lambda: _measured(lambda: True))["copied"] == 0
