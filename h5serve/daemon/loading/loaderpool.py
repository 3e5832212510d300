"""Where a load's loader process comes from: a loader kept from an earlier stream block, the
spare started ahead of need (spare.py), or a fresh one from the forkserver (loader.start_load).

Stream blocks (``LoadJob.keep``) are small and many: starting a loader for each (the
forkserver forks, the job is pickled over, the child opens the file with HDF5) is about half
of a small block's time from request to ready (docs/benchmarks.md, *Daemon internals*). So a loader that
published a stream block is kept: it waits on its job pipe for the next block, with the source
file still open (streamloader.py), and the next stream load goes to it. At most ``limit``
loaders are kept idle (the daemon's ``--loaders``), each for ``KEPT_IDLE_S`` after its last
load; then its job pipe is closed and it exits. A kept loader is what any loader is: it runs
as the daemon does, opens only the file the daemon resolved and pinned (device and inode,
fstat of HDF5's own descriptor), checks the file's identity after every load, dies with the
daemon, and is stopped like any loader when it stalls. A load that fails ends its loader.

Everything here runs on the control loop's thread (the store's).
"""

from __future__ import annotations

import logging
import math
import os
import time
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext, ForkServerProcess

from .._process import loader_output
from .loader import LoadJob, start_load
from .spare import Spare, start_spare

__all__ = ["LoaderPool", "KEPT_IDLE_S", "SPARE_AFTER_LOAD_S"]

log = logging.getLogger("h5serve.daemon")
SPARE_DELAY_S = 1.0  # after the start, before the first spare loader (the forkserver imports numpy, h5py)
SPARE_RETRY_S = 10.0  # after a spare could not be started
# after the last running load finished, before the next spare: forking one while a load runs
# takes a core from it, and the daemon answers nobody until the forkserver replied:
# the clients of the load just published attach first
SPARE_AFTER_LOAD_S = 0.02
KEPT_IDLE_S = 5.0  # a kept stream loader with no block to load for this long exits


class LoaderPool:
    """The spare loader and the kept stream loaders of one daemon (``ctx``: loader_context())."""

    def __init__(self, ctx: ForkServerContext, limit: int) -> None:
        self._ctx = ctx
        self.limit = max(1, limit)  # kept loaders waiting at most
        self._spare: Spare | None = None  # a loader started ahead of the next load (spare.py)
        self._spare_after = time.monotonic() + SPARE_DELAY_S
        self._busy: dict[int, Spare] = {}  # kept loaders at work, by id() of their process
        self._idle: list[tuple[Spare, float]] = []  # kept loaders waiting, since when
        self.reused = 0  # stream loads that went to a kept loader

    def launch(self, job: LoadJob) -> tuple[ForkServerProcess, Connection]:
        """A loader running ``job``, and the pipe its LoadOk or LoadError comes on."""
        self._spare_after = 0.0  # the forkserver is warm
        if job.keep:
            while self._idle:
                kept = self._idle.pop()[0]  # the most recent: its pages are the warmest
                if kept.take(job):
                    self.reused += 1
                    return self._working(kept)
        spare, self._spare = self._spare, None
        if spare is not None and spare.take(job):
            return self._working(spare) if job.keep else (spare.process, spare.reply)
        if job.keep:  # a loader with a job pipe, so that it can be kept
            fresh = start_spare(self._ctx, os.getpid())
            if fresh.take(job):
                return self._working(fresh)
        return start_load(self._ctx, job)

    def _working(self, kept: Spare) -> tuple[ForkServerProcess, Connection]:
        self._busy[id(kept.process)] = kept
        return kept.process, kept.reply

    def finished(self, process: ForkServerProcess) -> bool:
        """A loader reported its load's success. True when it is kept for the next stream
        load (its pipes stay open, nothing to reap); False: the caller releases it."""
        kept = self._busy.pop(id(process), None)
        if kept is None:
            return False
        if len(self._idle) < self.limit and process.is_alive():
            self._idle.append((kept, time.monotonic()))
            return True
        kept.jobs.close()  # it reads EOF and exits
        return False

    def forget(self, process: ForkServerProcess) -> None:
        """``process`` was killed or died: it is nobody's to keep."""
        kept = self._busy.pop(id(process), None)
        if kept is not None and not kept.jobs.closed:
            kept.jobs.close()

    def loaded(self) -> None:
        """A load finished: no spare is started for SPARE_AFTER_LOAD_S."""
        self._spare_after = max(self._spare_after, time.monotonic() + SPARE_AFTER_LOAD_S)

    def expire(self) -> list[ForkServerProcess]:
        """Let the kept loaders idle for KEPT_IDLE_S go; returns their processes, to reap."""
        now = time.monotonic()
        gone = [kept for kept, since in self._idle if now - since >= KEPT_IDLE_S or not kept.process.is_alive()]
        if not gone:
            return []
        self._idle = [(kept, since) for kept, since in self._idle if kept not in gone]
        for kept in gone:
            _said(kept.process)
            for end in (kept.jobs, kept.reply):
                end.close()
        return [kept.process for kept in gone]

    def spare_due_in(self, loading: bool) -> float:
        """Seconds until ``keep_spare`` would start a spare loader (inf: none is due, or a load
        runs: ``loading``)."""
        if self._spare is not None or loading:
            return math.inf
        return max(0.0, self._spare_after - time.monotonic())

    def keep_spare(self, loading: bool) -> None:
        """Start a spare loader once the forkserver is warm (after the first load, or
        SPARE_DELAY_S after the start: no request waits for the forkserver's imports on its
        account). The next one starts SPARE_AFTER_LOAD_S after the loads running when one was
        used are done, not beside them (a load that finds no spare starts its own loader). The
        server calls it when no request waits (forking one holds the daemon up)."""
        if self.spare_due_in(loading) > 0:
            return
        try:
            self._spare = start_spare(self._ctx, os.getpid())
        except OSError as exc:  # out of processes or files: loads start their own loader
            self._spare_after = time.monotonic() + SPARE_RETRY_S
            log.warning("could not start a spare loader (%s); loads start their own", exc)

    def close(self) -> None:
        """Stop the spare and the idle kept loaders (busy ones are the store's to kill)."""
        if self._spare is not None:
            self._spare.discard()
            self._spare = None
        for kept, _ in self._idle:
            kept.discard()
        self._idle = []
        for kept in self._busy.values():
            if not kept.jobs.closed:
                kept.jobs.close()
        self._busy = {}


def _said(process: ForkServerProcess) -> None:
    """Log what a kept loader wrote to its stderr over its loads (the store logs a one-load
    loader's output after its load)."""
    output = loader_output(process)
    if output:
        log.warning("a kept stream loader (pid %s) wrote to its stderr:%s", process.pid,
                    "".join(f"\n  | {line}" for line in output))
