"""The control loop's half of a running load: reaping finished loaders (``LoadReaper.poll``),
publishing what they loaded, remembering what failed for pollers, and stopping loads that make
no progress. The store (store.py) holds one, and shares its records with it (loadindex.py).

Everything here runs on the control loop's thread and never blocks: pipes are polled, the
temporaries are read with non-blocking opens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.context import ForkServerProcess
from pathlib import Path

from ...errors import SegmentError
from ...segments import check_published, header_checksum, read_activity
from ...util.logtext import printable
from ...util.safeio import remove_if
from ...util.units import format_bytes
from .._process import loader_output
from ..config import STALL_CHECK_INTERVAL_S
from ..loading.killload import kill_load
from ..loading.loaderpool import LoaderPool
from ..loading.loadresult import LoadError, LoadOk, LoadStats
from .entries import Entry, LoadFailure, load_log_level, not_ours
from .loadindex import Records
from .refusals import stalled_load

__all__ = ["LoadReaper"]

log = logging.getLogger("h5serve.daemon")


class LoadReaper:
    """Reaps, publishes and fails the running loads of ``records`` (the store's), whose loaders
    came from ``pool``; ``on_loaded``: called with each published load's seconds (metrics)."""

    def __init__(self, records: Records, pool: LoaderPool, shm_dir: Path, stall_timeout: float) -> None:
        self.records = records
        self.entries, self.failures = records.entries, records.failures
        self.counters, self.errors = records.counters, records.errors
        self.pool = pool
        self.shm_dir = shm_dir
        self.stall_timeout = stall_timeout  # a load without progress for this long is stopped
        self.on_loaded: Callable[[float], None] | None = None
        self._last_stall_check = time.monotonic()
        self._reaping: list[ForkServerProcess] = []  # loaders that finished or were killed, not yet reaped

    def reap_later(self, processes: list[ForkServerProcess]) -> None:
        """Loaders that ended (kept ones let go): reaped on a later poll, never waited for."""
        self._reaping += processes

    def poll(self) -> None:
        """Reap finished loaders: publish successes, remember failures for pollers; stop loads
        that made no progress for ``stall_timeout``. Never blocks: pipes are polled, the
        temporaries are read with non-blocking opens."""
        now = time.monotonic()
        check_stalls = now - self._last_stall_check >= STALL_CHECK_INTERVAL_S
        if check_stalls:
            self._last_stall_check = now
        for entry in self.records.loads.running():
            if entry.process is None or entry.reply is None:
                continue
            result: object = None
            # alive first, then the pipe: a loader that reports and exits between the two looks
            # is seen dead with its report waiting, never dead with nothing said
            alive = entry.process.is_alive()
            if entry.reply.poll():
                try:
                    result = entry.reply.recv()
                except (EOFError, OSError):
                    result = None
            elif alive:
                if check_stalls and self._stalled(entry, now):
                    self._stop_stalled(entry, now)
                continue
            if isinstance(result, LoadOk) and self.pool.finished(entry.process):  # kept for the next stream block
                entry.process, entry.reply = None, None
                self.pool.loaded()
                self._loaded(entry, result.stats, result.name)
                continue
            if result is None:  # died without a word: its exit code is known within moments
                entry.process.join(timeout=1)
            exitcode, pid, output = entry.process.exitcode, entry.process.pid, loader_output(entry.process)
            self._release_loader(entry)
            if isinstance(result, LoadOk):
                self._loaded(entry, result.stats, result.name)
            elif isinstance(result, LoadError):
                self._fail(entry, result.code, result.message)
            else:
                log.error("the loader of %s (pid %s) died (exit code %s); its stderr ended:%s", entry.name, pid,
                          exitcode, "".join(f"\n  | {line}" for line in output) or " (nothing)")
                self._fail(entry, SegmentError.code, f"the loader process died (exit code {exitcode})"
                           + (f": {output[-1]}" if output else "") + "; see the daemon log")
            if output and isinstance(result, (LoadOk, LoadError)):
                log.warning("the loader of %s wrote to its stderr:%s", entry.name,
                            "".join(f"\n  | {x}" for x in output))
        self._reaping = [p for p in self._reaping if not self._reaped(p)]

    def _release_loader(self, entry: Entry) -> None:
        """Forget a finished (or killed) loader; it is reaped later, without waiting for it."""
        assert entry.process is not None and entry.reply is not None
        self.pool.forget(entry.process)
        entry.reply.close()
        self.pool.loaded()
        self._reaping.append(entry.process)
        entry.process, entry.reply = None, None

    @staticmethod
    def _reaped(process: ForkServerProcess) -> bool:
        if process.is_alive():
            return False
        process.close()
        return True

    def _loaded(self, entry: Entry, stats: LoadStats, name: str) -> None:
        entry.file = name or entry.file  # a fresh name if the one planned was taken meanwhile
        if entry.meta.vlen:  # the values the loader wrote, in place of the estimate: counted from now on, not the room
            entry.meta = replace(entry.meta, values=stats.values)
        entry.room = 0
        try:  # the header, inode and ctime as published: every later hit compares the file with them
            entry.header, entry.stamp = check_published(self.shm_dir / entry.file, entry.meta)
        except SegmentError as exc:
            remove_if(self.shm_dir / entry.file, keep=not_ours)
            self._fail(entry, SegmentError.code, f"{exc} right after it was loaded; ask again to load it again")
            return
        entry.checksum = header_checksum(entry.header)
        entry.state = "ready"
        entry.load_seconds = time.monotonic() - entry.load_started
        entry.load_parts = stats.parts
        entry.load_copied_bytes = stats.copied_bytes
        self.counters["loads"] += 1
        log.log(load_log_level(entry.meta), "loaded %s in %.2fs", entry.file, entry.load_seconds)
        if entry.meta.remote:
            self.counters["remote_loads"] += 1
            self.counters["remote_bytes"] += stats.fetched_bytes
            self.counters["remote_fetch_ms"] += round(stats.fetch_s * 1000)
            log.info("fetched %s of %s in %.2fs (%.1f MB/s)", format_bytes(stats.fetched_bytes),
                     printable(entry.meta.source_path), stats.fetch_s,
                     stats.fetched_bytes / max(stats.fetch_s, 1e-9) / 1e6)
        read_s = max(stats.read_s, 1e-9)
        entry.load_read_seconds = read_s
        log.debug("load of %s: %d rows, %s, in %d part(s), segment created in %.2fs, rows read in %.2fs "
                  "(parts done after %s s): %.0f rows/s, %.1f MB/s; checksum %s in %.2fs; page cache dropped over "
                  "%s of the source",
                  entry.file, entry.meta.rows, format_bytes(entry.meta.nbytes), entry.load_parts,
                  stats.create_s, read_s,
                  "/".join(f"{t:.2f}" for t in stats.part_s) or "?",
                  entry.meta.rows / read_s, entry.meta.nbytes / read_s / 1e6,
                  entry.checksum or "not computed", stats.checksum_s,
                  format_bytes(stats.page_cache_drop_bytes))
        if self.on_loaded is not None:
            self.on_loaded(entry.load_seconds)

    def _fail(self, entry: Entry, code: str, message: str) -> None:
        """A load failed: drop its temporary and entry; pollers get the error for FAILURE_MEMORY_S."""
        remove_if(self.shm_dir / entry.tmp_name, keep=not_ours)
        del self.entries[entry.name]
        self.failures[entry.name] = LoadFailure(time.monotonic(), code, message)
        self.counters["load_errors"] += 1
        self.errors[code] += 1
        log.warning("load of %s failed: %s", entry.file, printable(message))

    def _stalled(self, entry: Entry, now: float) -> bool:
        """Whether a running load made no progress (rows written, checksum blocks) for
        ``stall_timeout`` seconds: a stopped loader, or one blocked in a read (a hung file system)."""
        activity = read_activity(self.shm_dir / entry.tmp_name)
        if activity != entry.activity:
            entry.activity, entry.active_at = activity, now
            return False
        return now - entry.active_at >= self.stall_timeout

    def _stop_stalled(self, entry: Entry, now: float) -> None:
        """Kill a stalled loader and its part processes, fail its load, free its slot."""
        assert entry.process is not None and entry.process.pid is not None
        m = entry.meta
        killed = kill_load(entry.process.pid)
        self._release_loader(entry)
        self.counters["stalled"] += 1
        log.warning("load of %s[%s] %s made no progress for %.0fs: killed its %d process(es)",
                    printable(m.source_path), printable(m.key), m.shard_label(), now - entry.active_at, killed)
        self._fail(entry, SegmentError.code, stalled_load(m, entry.activity[0], self.stall_timeout))
