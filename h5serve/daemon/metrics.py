"""Prometheus metrics: an HTTP endpoint (``--metrics-port``) and/or a node_exporter textfile
(``--metrics-textfile DIR``), both from one registry.

The control loop owns the store; the HTTP server runs in prometheus_client's thread. So the
loop hands the collector an immutable snapshot (``refresh``) instead of letting the thread
walk live state.
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import ConfigError, host_error

__all__ = ["Metrics", "LOAD_SECONDS_BUCKETS"]

log = logging.getLogger("h5serve.daemon")
LOAD_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800)
TEXTFILE_INTERVAL_S = 10.0
SNAPSHOT_INTERVAL_S = 1.0


class Metrics:
    def __init__(self, port: int | None, textfile_dir: Path | None, addr: str = "127.0.0.1") -> None:
        try:
            from prometheus_client import CollectorRegistry, Histogram, start_http_server
        except ImportError as exc:
            raise ConfigError(
                "--metrics-port/--metrics-textfile need prometheus_client: pip install 'h5serve[metrics]'"
            ) from exc
        self.registry = CollectorRegistry()
        self._snapshot: dict[str, Any] = {"segments": [], "counters": {}, "memory": {}}
        self._last_refresh = 0.0
        self._last_textfile = 0.0
        self.textfile = textfile_dir / "h5serve.prom" if textfile_dir is not None else None
        if textfile_dir is not None and not textfile_dir.is_dir():
            raise ConfigError(f"--metrics-textfile {textfile_dir} is not a directory")
        self.load_seconds = Histogram(
            "h5serve_load_seconds", "Time to load one segment from HDF5 into shared memory",
            buckets=LOAD_SECONDS_BUCKETS, registry=self.registry,
        )
        self.registry.register(_SnapshotCollector(self))
        self.server = None
        if port is not None:
            try:
                self.server, _thread = start_http_server(port, addr=addr, registry=self.registry)
            except OSError as exc:
                raise host_error(exc, f"serving metrics on {addr}:{port}",
                                 fix="choose another --metrics-port (0: any free port)") from exc
            log.info("metrics on http://%s:%d/metrics", addr, self.server.server_port)

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
            from prometheus_client import write_to_textfile

            try:
                write_to_textfile(str(self.textfile), self.registry)  # writes a temp file, then renames
            except OSError as exc:
                log.warning("cannot write metrics to %s: %s", self.textfile, exc)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


class _SnapshotCollector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        snap = self.metrics._snapshot
        counters = snap.get("counters", {})
        labels = ["file", "key", "rank", "world_size", "mode", "dtype", "state"]
        size = GaugeMetricFamily("h5serve_segment_bytes", "Bytes of one shared-memory segment", labels=labels)
        by_state: dict[str, int] = {"ready": 0, "loading": 0, "stale": 0}
        for s in snap.get("segments", []):
            size.add_metric([s["file"], s["key"], str(s["rank"]), str(s["world_size"]), s["mode"], s["dtype"],
                             s["state"]], s["bytes"])
            by_state[s["state"]] = by_state.get(s["state"], 0) + 1
        yield size
        segments = GaugeMetricFamily("h5serve_segments", "Segments held by the daemon", labels=["state"])
        for state, n in by_state.items():
            segments.add_metric([state], n)
        yield segments
        memory = snap.get("memory", {})
        yield GaugeMetricFamily("h5serve_memory_used_bytes", "Bytes of all segments", value=memory.get("used", 0))
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
        ):
            yield CounterMetricFamily(name, doc, value=counters.get(key, 0))
        yield InfoMetricFamily("h5serve_build", "h5serve build information",
                               value={"version": __version__, "python": platform.python_version()})
