"""Prometheus metrics: an HTTP endpoint (``--metrics-port``) and/or a node_exporter textfile
(``--metrics-textfile DIR``), both from one registry.

The control loop owns the store; the HTTP server runs in a thread of its own
(metrics_http.py: bounded connections). So the loop hands the collector an immutable snapshot
(``refresh``) instead of letting the thread walk live state.

Who sees what: any local user can connect to the endpoint (and anyone on the network with
``--metrics-addr 0.0.0.0``), so by default no metric names a file or a dataset key: a segment
is labelled by an opaque id (a keyed hash of its name, the key drawn at random when the daemon
starts). ``--metrics-paths`` adds the ``file`` and ``key`` labels, for whoever can reach the
endpoint or read the textfile; the textfile is then written 0640 to the daemon's group
(``--group``, else its user's primary group), else 0644.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import platform
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import ConfigError, host_error
from .metrics_http import MetricsHTTPServer

__all__ = ["Metrics", "LOAD_SECONDS_BUCKETS", "TEXTFILE_NAME"]

log = logging.getLogger("h5serve.daemon")
LOAD_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800)
TEXTFILE_INTERVAL_S = 10.0
SNAPSHOT_INTERVAL_S = 1.0
TEXTFILE_NAME = "h5serve.prom"
_SEGMENT_ID_CHARS = 16  # hex characters of the keyed hash that labels a segment




class Metrics:
    def __init__(self, port: int | None, textfile_dir: Path | None, addr: str = "127.0.0.1", paths: bool = False,
                 group: int | None = None) -> None:
        try:
            from prometheus_client import CollectorRegistry, Histogram
        except ImportError as exc:
            raise ConfigError(
                "--metrics-port/--metrics-textfile need prometheus_client: pip install 'h5serve[metrics]'"
            ) from exc
        self.registry = CollectorRegistry()
        self.paths = paths
        self._id_key = secrets.token_bytes(16)  # segment ids mean nothing outside this daemon's life
        self._snapshot: dict[str, Any] = {"segments": [], "counters": {}, "memory": {}}
        self._last_refresh = 0.0
        self._last_textfile = 0.0
        self.textfile = textfile_dir / TEXTFILE_NAME if textfile_dir is not None else None
        self.textfile_group = group if group is not None else os.getegid()
        if textfile_dir is not None and not textfile_dir.is_dir():
            raise ConfigError(f"--metrics-textfile {textfile_dir} is not a directory")
        self.load_seconds = Histogram(
            "h5serve_load_seconds", "Time to load one segment from HDF5 into shared memory",
            buckets=LOAD_SECONDS_BUCKETS, registry=self.registry,
        )
        self.registry.register(_SnapshotCollector(self))
        self.server: MetricsHTTPServer | None = None
        if port is not None:
            try:
                self.server = MetricsHTTPServer(addr, port, self.render)
            except OSError as exc:
                raise host_error(exc, f"serving metrics on {addr}:{port}",
                                 fix="choose another --metrics-port (0: any free port)") from exc
            log.info("metrics on http://%s:%d/metrics (%s)", addr, self.server.server_port,
                     "with file paths and keys: --metrics-paths" if paths else "no file paths or keys")

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def segment_id(self, name: str) -> str:
        """The opaque label of segment ``name``: stable while this daemon runs, unrelated to its
        name in /dev/shm, the file or the key."""
        return hmac.new(self._id_key, name.encode(), hashlib.sha256).hexdigest()[:_SEGMENT_ID_CHARS]

    @property
    def port(self) -> int | None:
        return None if self.server is None else self.server.server_port

    def observe_load(self, seconds: float) -> None:
        self.load_seconds.observe(seconds)

    def refresh(self, status: Callable[[], dict[str, Any]], force: bool = False) -> None:
        """Called from every tick of the control loop with ``store.status`` (not its result:
        building a status reads /proc/locks and statvfs, so it is built only when due)."""
        now = time.monotonic()
        if not force and now - self._last_refresh < SNAPSHOT_INTERVAL_S:
            return
        self._last_refresh = now
        self._snapshot = status()
        if self.textfile is not None and (force or now - self._last_textfile >= TEXTFILE_INTERVAL_S):
            self._last_textfile = now
            try:
                self._write_textfile(self.textfile)
            except OSError as exc:
                log.warning("cannot write metrics to %s: %s", self.textfile, exc)

    def _write_textfile(self, path: Path) -> None:
        """A temporary of a random name (O_EXCL, never through a symlink), its mode and group
        set on the descriptor before a byte is written, then renamed over ``path``."""
        from prometheus_client import generate_latest

        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with open(fd, "wb", closefd=False) as f:
                if self.paths:  # only the daemon's user and group read names of files
                    if self.textfile_group != os.getegid():
                        os.fchown(fd, -1, self.textfile_group)
                    os.fchmod(fd, 0o640)
                else:
                    os.fchmod(fd, 0o644)
                f.write(generate_latest(self.registry))
            os.rename(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


class _SnapshotCollector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        snap = self.metrics._snapshot
        counters = snap.get("counters", {})
        paths = self.metrics.paths
        labels = ["segment", "rank", "world_size", "mode", "dtype", "state", *(["file", "key"] if paths else [])]
        size = GaugeMetricFamily("h5serve_segment_bytes", "Bytes of one shared-memory segment", labels=labels)
        by_state: dict[str, int] = {"ready": 0, "loading": 0, "stale": 0}
        for s in snap.get("segments", []):
            size.add_metric([self.metrics.segment_id(s["name"]), str(s["rank"]), str(s["world_size"]), s["mode"],
                             s["dtype"], s["state"], *([s["file"], s["key"]] if paths else [])], s["bytes"])
            by_state[s["state"]] = by_state.get(s["state"], 0) + 1
        yield size
        segments = GaugeMetricFamily("h5serve_segments", "Segments held by the daemon", labels=["state"])
        for state, n in by_state.items():
            segments.add_metric([state], n)
        yield segments
        memory = snap.get("memory", {})
        yield GaugeMetricFamily("h5serve_memory_used_bytes", "Bytes the budget counts: the segments' pages in shared "
                                "memory, a variable-length load's room while it runs", value=memory.get("used", 0))
        yield GaugeMetricFamily("h5serve_memory_budget_bytes", "The daemon's memory budget",
                                value=memory.get("budget", 0))
        for name, key, doc in (
            ("h5serve_loads", "loads", "Segments loaded from HDF5"),
            ("h5serve_hits", "hits", "Requests answered by an already loaded segment"),
            ("h5serve_evictions", "evictions", "Segments evicted (memory budget or changed source)"),
            ("h5serve_refusals", "refusals",
             "Requests refused (budget, --allow-root, requester may not read the file)"),
            ("h5serve_load_errors", "load_errors", "Loads that failed"),
            ("h5serve_damaged", "damaged", "Published segments found damaged before a hit, and loaded again"),
            ("h5serve_stalled", "stalled", "Loads killed by the stall watchdog"),
            ("h5serve_remote_fetched_bytes", "remote_bytes", "Bytes fetched from object stores (s3://) by loads"),
        ):
            yield CounterMetricFamily(name, doc, value=counters.get(key, 0))
        arenas = snap.get("arenas", {})  # stream blocks of fixed-size rows in slots (store/arena.py)
        yield GaugeMetricFamily("h5serve_stream_arenas", "Stream arenas open", value=arenas.get("arenas", 0))
        yield GaugeMetricFamily("h5serve_stream_arena_bytes", "Bytes the budget counts of the stream arenas "
                                "(headers, tables and slots with pages)", value=arenas.get("bytes", 0))
        for name, key, doc in (
            ("h5serve_stream_slot_loads", "loads", "Stream blocks loaded into arena slots"),
            ("h5serve_stream_slot_reuses", "reclaims", "Arena slots reused in place for another block"),
            ("h5serve_stream_slot_punches", "punches", "Arena slots whose pages were given back"),
        ):
            yield CounterMetricFamily(name, doc, value=arenas.get(key, 0))
        yield InfoMetricFamily("h5serve_build", "h5serve build information",
                               value={"version": __version__, "python": platform.python_version()})
