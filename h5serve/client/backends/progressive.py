"""Ready at once: a shard the daemon is still loading is served through h5py meanwhile.

Without this, ``SharedH5Dataset`` waits in ``ShmBackend.connect`` until the whole shard is in
shared memory, so the first batch of a cold 8 GB file waits for 8 GB of reads. ``connect``
here sends the shard's acquires (the daemon starts the loads, or refuses for room at once:
BudgetExceeded still reaches automatic stream mode) and, when the segments are not ready yet,
returns a ``ProgressiveBackend``:

- until the daemon answers ``ready`` for every key, batches are gathered by a lazy h5py
  backend (the same rows, order and bytes as the segments: client/backends/sources.py); its chunk
  cache is capped at LOADING_CACHE_BYTES so the load is not duplicated in process memory;
- between batches (never during one), the backend asks the daemon again without waiting
  for the load: when a segment's name appears in the shm dir (an ``lstat``), or every
  PROGRESS_POLL_S otherwise; each ask waits at most POLL_TIMEOUT_S for the answer;
- once all are ready it maps them exactly as the blocking path does (``open_acquired``: the
  reply's publish stamp, the descriptor hand-out for ``--group`` members), closes the lazy
  backend and serves from shared memory (``name`` turns from ``"lazy (loading)"`` to ``"shm"``);
- a failed or refused load, or a daemon that is gone (or silent longer than its timeout),
  leaves h5py serving for good, with the dataset's fallback warning (``name == "lazy"``);
- either way the dataset is handed the backend that serves from then on (``on_settled``), so
  nothing stands between it and its gathers once the load is over.

Every process decides for itself: a forked DataLoader worker inherits the state and polls with
its own connection (DaemonClient is fork-safe); a spawned or forkserver worker unpickles a
backend still loading and does the same (one switched already re-attaches as ShmBackend does).

Small shards (under WAIT_BYTES) are waited for as before: their load takes about as long as a
lazy first batch, and the dataset is then on shared memory from its first batch. So is a shard
/dev/shm has no room for: the daemon's ShmFull must reach automatic stream mode at construction.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import DaemonUnavailable, H5ServeError, SegmentError
from ...hdf5.description import DatasetDescription
from ...util.units import format_bytes, row_nbytes
from ...wire.connection import DaemonClient
from ...wire.protocol import Acquire, AcquireResult
from ..ragged import RaggedColumn
from ..remote import pinned
from ..spec import BackendSpec
from ..streaming.batch import StreamBatch
from .attach import ATTACH_TRIES, EvictionRetry, asked_again
from .chunkcache import auto_cache_bytes
from .protocol import Backend
from .sources import Acquires, ShmBackend, lazy_backend

__all__ = ["ProgressiveBackend", "connect", "LOADING", "WAIT_BYTES", "LOADING_CACHE_BYTES"]

log = logging.getLogger("h5serve.client")

LOADING = "lazy (loading)"  # ProgressiveBackend.name until it switches
WAIT_BYTES = 64 << 20  # shards smaller than this are waited for (a cold 64 MiB loads in ~0.2 s)
LOADING_CACHE_BYTES = 64 << 20  # the lazy backend's chunk cache while the daemon loads
PROGRESS_POLL_S = 0.5  # ask the daemon at least this often while it loads (a failed load, a dead daemon)
PUBLISHED_POLL_S = 0.002  # once the names are published, ask after this, then twice as long, ... until ready
POLL_TIMEOUT_S = 0.05  # how long one ask waits for the daemon's answer (a training step waits for it)


def connect(spec: BackendSpec, rank_for_logs: int, on_fallback: Callable[[H5ServeError], None],
            describe: Callable[[], DatasetDescription], wait: bool | None = None,
            on_settled: Callable[[Backend], None] | None = None) -> Backend | ProgressiveBackend:
    """The shard from the node's daemon: its segments when they are ready (or, when the shard is
    small, ``wait`` is True or /dev/shm has no room for it, once loaded: ``ShmBackend.connect``);
    else a ProgressiveBackend serving through h5py until they are. ``wait=False``: never wait.
    ``on_fallback`` is called when the load fails after this returned (then h5py serves on);
    ``on_settled`` with the backend that serves from then on, once switched or fallen back (the
    dataset holds that one instead, so nothing stands between it and its gathers). ``describe``:
    the dataset's description of its files (hdf5/description.py), built once, on first call.

    Raised as ``ShmBackend.connect`` is for what the daemon answers at once (no daemon,
    BudgetExceeded, a bad key). An s3:// object the daemon fetches (``spec.pin``) is always waited
    for: a read here meanwhile would fetch it once more per rank."""
    spec = pinned(spec, describe)  # an s3:// object the daemon fetches: with its identity (client/remote.py)
    if wait or spec.pin or spec.pins:
        return ShmBackend.connect(spec, rank_for_logs)
    deadline = None if spec.timeout is None else time.monotonic() + spec.timeout
    client = DaemonClient(spec.runtime_dir, spec.timeout, spec.daemon_user)
    handed = False
    try:
        started = ShmBackend.start(spec, client, deadline, resolved=True)
        if started.ready:
            try:
                return ShmBackend.attach_ready(started)
            except SegmentError:  # evicted since the answer: ask again, waiting
                return ShmBackend.connect(spec, rank_for_logs)
        try:
            need = _shard_bytes(describe(), started.results)
            small = wait is None and (need < WAIT_BYTES or not _room(started.results[0].shm_dir, need))
            lazy = None if small else lazy_backend(dataclasses.replace(spec, cache_bytes=_loading_cache(spec)),
                                                   describe())
        except H5ServeError:  # h5py here cannot read what the daemon's loaders can: wait for them
            lazy = None
        if lazy is None:
            return ShmBackend.connect(spec, rank_for_logs)
        log.info("h5serve: rank %d reads %s through h5py while the daemon loads it into shared memory (%s); "
                 "it switches to shared memory once loaded", rank_for_logs, spec.path, format_bytes(need))
        handed = True
        return ProgressiveBackend(started, lazy, on_fallback, deadline, on_settled)
    finally:
        if not handed:
            client.close()


def _loading_cache(spec: BackendSpec) -> int:
    asked = auto_cache_bytes() if spec.cache_bytes is None else spec.cache_bytes
    return min(asked, LOADING_CACHE_BYTES)


def _shard_bytes(description: DatasetDescription, results: list[AcquireResult]) -> int:
    """The shard's rows in bytes, from the daemon's row counts and the first file's datasets
    (many files agree on row shape and dtype; variable-length rows: the first file's mean
    length)."""
    total = 0
    for info, result in zip(description.infos, results):
        if info.vlen:
            per_row = round(info.mean_length * np.dtype(info.dtype).itemsize) + 8  # values and an offset
        else:
            per_row = row_nbytes(info.row_shape, info.dtype)
        total += result.rows_total * per_row
    return total


def _room(shm_dir: str, need: int) -> bool:
    """Whether the shm filesystem has ``need`` bytes free (the shard's own reservation may have
    begun already: then this says no, and the caller waits, as it did before)."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return True
    return st.f_bavail * st.f_frsize >= need


class ProgressiveBackend:
    """A shard served by ``lazy`` while the daemon loads ``started``'s segments, then from them."""

    def __init__(self, started: Acquires, lazy: Backend, on_fallback: Callable[[H5ServeError], None] | None,
                 deadline: float | None, on_settled: Callable[[Backend], None] | None = None) -> None:
        self._started: Acquires | None = started
        self._current: Backend = lazy
        self._on_fallback = on_fallback
        self._on_settled = on_settled
        self._deadline = deadline  # spec.timeout's end: a load not ready by then is given up, as connect does
        self._since = time.monotonic()
        self._answered = self._since  # the daemon's last answer
        self._last_poll = self._since
        self._next_poll = self._since + PROGRESS_POLL_S
        self._evicted = EvictionRetry(tries=ATTACH_TRIES)  # across polls: segments evicted before mapped
        self._published: set[str] = set()
        self._published_pause = PUBLISHED_POLL_S
        self.spec = started.spec

    # ----- what the dataset reads of a backend: the current one's --------------------------------
    @property
    def name(self) -> str:
        return LOADING if self._started is not None else self._current.name

    @property
    def loading(self) -> bool:
        """Whether the daemon is still loading the shard (batches come from h5py meanwhile)."""
        return self._started is not None

    @property
    def current(self) -> Backend:
        return self._current

    @property
    def out_dtypes(self) -> list[np.dtype]:
        return self._current.out_dtypes

    @property
    def total_rows(self) -> int:
        return self._current.total_rows

    @property
    def vlen_kinds(self) -> list[str]:
        return self._current.vlen_kinds

    @property
    def arrays(self) -> list[np.ndarray] | None:  # a worker ring gathers straight from a mapping's arrays
        return getattr(self._current, "arrays", None)

    @property
    def handle(self) -> Any:  # h5_worker_init_fn drops an inherited h5py handle
        return getattr(self._current, "handle", None)

    def gather(self, positions: torch.Tensor) -> list[torch.Tensor | np.ndarray | RaggedColumn]:
        if self._started is not None:
            self.check()
        return self._current.gather(positions)

    def retain(self, batch: StreamBatch) -> None:
        self._current.retain(batch)

    def finish(self, batch: StreamBatch) -> None:
        self._current.finish(batch)

    # ----- the switch ----------------------------------------------------------------------------
    def check(self) -> None:
        """Switch to the segments if the daemon has them ready, without waiting for the load:
        ask it when every name was published (PUBLISHED_POLL_S after the last ask, then twice
        that, ...: a name someone planted never makes every batch ask), else every PROGRESS_POLL_S."""
        started = self._started
        if started is None:
            return
        now = time.monotonic()
        if now < self._next_poll and not (now - self._last_poll >= self._published_pause
                                          and self._names_published(started)):
            return
        if now < self._next_poll:  # asked for a published name: the daemon is told within moments,
            self._published_pause = min(2 * self._published_pause, PROGRESS_POLL_S)  # else ask less often
        self._last_poll = now
        self._next_poll = now + PROGRESS_POLL_S
        try:
            if started.poll(POLL_TIMEOUT_S):
                self._switch(started)
                return
            self._answered = time.monotonic()
        except DaemonUnavailable as exc:
            if not self._gone(started):
                return  # slow, not gone (a busy daemon loop): ask again later
            self._give_up(exc)
            return
        except H5ServeError as exc:
            self._give_up(exc)
            return
        if self._deadline is not None and self._answered > self._deadline:
            self._give_up(DaemonUnavailable(
                f"the daemon's load of {self.spec.path} did not finish within timeout={self.spec.timeout:g}s; "
                "pass a larger timeout=, or timeout=None to switch whenever the load is done"))

    def wait(self, timeout: float | None = None) -> str:
        """Block until the switch (or the fallback), at most ``timeout`` seconds; the name then."""
        end = None if timeout is None else time.monotonic() + timeout
        while self._started is not None and (end is None or time.monotonic() < end):
            self._next_poll = 0.0
            self.check()
            if self._started is not None:
                time.sleep(PUBLISHED_POLL_S * 10)
        return self.name

    def _gone(self, started: Acquires) -> bool:
        """Whether a daemon that did not answer in POLL_TIMEOUT_S is given up: it is gone, or
        silent longer than a request may take (its timeout)."""
        if time.monotonic() - self._answered > started.client.timeout:
            return True
        try:
            return not started.client.available()
        except H5ServeError:
            return True

    def _names_published(self, started: Acquires) -> bool:
        for result in started.results:
            if result.name in self._published or result.state == "ready":
                continue
            if not os.path.lexists(Path(result.shm_dir) / result.name):
                return False
            self._published.add(result.name)
        return True

    def _switch(self, started: Acquires) -> None:
        try:
            shm = ShmBackend.attach_ready(started)
        except SegmentError:  # evicted or replaced between the answer and the mapping: ask again
            if not self._evicted.again():
                raise
            started.results = [asked_again(r) for r in started.results]
            return
        if (shm.total_rows, [np.dtype(d) for d in shm.out_dtypes]) != (self.total_rows, list(self.out_dtypes)):
            shm.close()  # never: the two backends agree; h5py keeps serving what it served
            raise SegmentError(f"the daemon's segments of {self.spec.path} hold {shm.total_rows} rows of "
                               f"{shm.out_dtypes}, h5py reads {self.total_rows} of {self.out_dtypes}")
        lazy, self._current, self._started = self._current, shm, None
        lazy.close()
        started.client.close()
        log.info("h5serve: pid %d switched %s to shared memory after %.2f s", os.getpid(), self.spec.path,
                 time.monotonic() - self._since)
        if self._on_settled is not None:
            self._on_settled(shm)

    def _give_up(self, exc: H5ServeError) -> None:
        """h5py serves on for good: with the cache the user asked for, and the fallback warning."""
        started, self._started = self._started, None
        if started is not None:
            started.client.close()
        if self._on_fallback is not None:
            self._on_fallback(exc)
        else:
            log.warning("h5serve: %s; reading %s through h5py instead", exc, self.spec.path)
        self._current.close()
        self._current = lazy_backend(self.spec)
        if self._on_settled is not None:
            self._on_settled(self._current)

    # ----- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        self._current.close()
        if self._started is not None:
            self._started.client.close()
            self._started = None

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self._started is None:  # switched (ShmBackend: re-attached in the worker) or fallen back
            return self._current.__reduce_ex__(protocol)
        s = self._started
        return (_resume, (s.spec, s.requests, s.results, self._current, self._on_fallback, self._deadline,
                          self._on_settled))


def _resume(spec: BackendSpec, requests: list[Acquire], results: list[AcquireResult], lazy: Backend,
            on_fallback: Callable[[H5ServeError], None] | None, deadline: float | None,
            on_settled: Callable[[Backend], None] | None) -> ProgressiveBackend:
    """Unpickling in a spawned worker: the same loads, asked about over this process's own connection."""
    client = DaemonClient(spec.runtime_dir, spec.timeout, spec.daemon_user)
    return ProgressiveBackend(Acquires(spec, client, requests, results), lazy, on_fallback, deadline, on_settled)
