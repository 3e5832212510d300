"""An event loop run by the thread that needs a request's answer, never by a service thread.

fsspec runs every request of its filesystems on one service thread ("fsspecIO") and the caller
waits for it. h5py calls a file object while it holds its global lock (``phil``), and frees an
h5py object only under that lock. So a read through an fsspec file deadlocks as soon as the
service thread's cyclic garbage collection reaches an h5py object: the collector waits for the
lock the reading thread holds, while the reading thread waits for the collector's thread (h5py
issue 2019, dask issue 7547; seen here as a CI read that never ended).

Here the reading thread runs its requests itself, on an event loop of its own (one per thread
and process, made on first use). A collection in it frees h5py objects under a lock it already
holds (``phil`` is reentrant); a collection in any other thread waits for the lock until the
read ends, and nothing waits for that thread.

- ``filesystem_here(scheme, options)``: fsspec's asynchronous filesystem for ``scheme`` bound to
  this thread's loop (one per scheme and options).
- ``run_here(coroutine)``: its result, the loop run in this thread until it is done.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import selectors
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["filesystem_here", "run_here"]

T = TypeVar("T")


class _ThreadLoop:
    """One thread's loop and the filesystems bound to it, in the process that made them; their
    connections are closed at the process's exit (``_close_all``)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        # poll, not epoll: an epoll set is one kernel object shared with every forked child, and a
        # child dropping the loop it inherited (closing it) would unregister the parent's sockets and
        # wake-up pipe from it: the parent's next read would wait forever. poll keeps its set in this
        # process; a read has a few sockets at most (FETCH_AT_ONCE).
        self.loop: asyncio.AbstractEventLoop = asyncio.SelectorEventLoop(selectors.PollSelector())
        self.filesystems: dict[tuple[str, str], Any] = {}

    async def close(self) -> None:
        for fs in self.filesystems.values():
            for name in ("_s3", "_session"):  # s3fs's client, the http and gcs sessions
                held = getattr(fs, name, None)
                if held is not None and hasattr(held, "close"):
                    try:
                        await held.close()
                    except Exception:  # noqa: BLE001 - leaving anyway: a connection already gone
                        pass
        self.filesystems.clear()


_local = threading.local()
# every thread's loop, closed at exit by the process that made it; a forked child keeps the ones it
# inherited referenced and never closes them (their sockets are the parent's)
_made: list[_ThreadLoop] = []
_made_lock = threading.Lock()


def _here() -> _ThreadLoop:
    here: _ThreadLoop | None = getattr(_local, "here", None)
    if here is None or here.pid != os.getpid():  # a forked child's copy stays in _made, never closed here
        here = _local.here = _ThreadLoop()
        with _made_lock:
            _made.append(here)
    return here


@atexit.register
def _close_all() -> None:
    """Close this process's connections (aiohttp reports a session left open at exit)."""
    with _made_lock:
        mine = [here for here in _made if here.pid == os.getpid()]
        for here in _made:
            if here.pid != os.getpid():  # inherited: the parent's to close; no "Unclosed client session" here
                here.loop.set_exception_handler(lambda loop, context: None)
        _made[:] = [here for here in _made if here.pid != os.getpid()]
    for here in mine:
        if not here.loop.is_running() and not here.loop.is_closed():
            try:
                _run_on(here, here.close())
                here.loop.close()
            except Exception:  # noqa: BLE001 - at exit: nothing left to tell
                pass


def filesystem_here(scheme: str, options: dict[str, Any]) -> Any:
    """fsspec's asynchronous filesystem for ``scheme`` with ``options``, bound to this thread's
    loop (its requests are coroutines: run them with ``run_here``).

    Raised when fsspec or the scheme's backend is not installed: ImportError (the caller names the extra)."""
    import fsspec

    here = _here()
    key = (scheme, repr(sorted(options.items())))
    fs = here.filesystems.get(key)
    if fs is None:
        fs = here.filesystems[key] = fsspec.filesystem(scheme, asynchronous=True, loop=here.loop,
                                                       skip_instance_cache=True, **options)
    return fs


def run_here(coroutine: Coroutine[Any, Any, T]) -> T:
    """``coroutine``'s result, run to its end on this thread's loop.

    A loop already running in this thread (a notebook's) is set aside for the call: ours runs
    inside that loop's current step, which waits for it as it waits for any blocking call."""
    return _run_on(_here(), coroutine)


def _run_on(here: _ThreadLoop, coroutine: Coroutine[Any, Any, T]) -> T:
    outer = asyncio._get_running_loop()
    if outer is not None:
        asyncio._set_running_loop(None)
    try:
        return here.loop.run_until_complete(coroutine)
    finally:
        if outer is not None:
            asyncio._set_running_loop(outer)
