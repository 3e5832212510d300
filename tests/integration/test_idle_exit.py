"""``h5serve start --idle-exit SECONDS`` against real daemons: an unused daemon exits as
``h5serve stop`` does (segments unlinked, socket and pidfile removed); a mapped segment (its
lease) and a running load keep it; pings count, ``status`` probes do not.

The daemon looks at loads and leases once a second (IDLE_CHECK_INTERVAL_S), so it exits between
SECONDS and SECONDS + 1 s after the last activity; the deadlines below add slack for a busy
2-core machine on top, never less. A SIGSTOPped spare loader is a load that runs as long as the
test wants (its job goes to the spare, which cannot start it)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from h5serve.client import SharedH5Dataset
from h5serve.daemon.config import IDLE_CHECK_INTERVAL_S
from h5serve.errors import DaemonUnavailable
from h5serve.wire.connection import DaemonClient
from h5serve.wire.protocol import Acquire

from ..helpers import Daemon, descendant_pids, h5serve_cli, wait_for

IDLE_S = 2.0  # the tests' --idle-exit
SLACK_S = 15.0  # on top of IDLE_S + IDLE_CHECK_INTERVAL_S: a loaded machine, never a shorter bound
EXIT_DEADLINE_S = IDLE_S + IDLE_CHECK_INTERVAL_S + SLACK_S
HELD_S = IDLE_S + IDLE_CHECK_INTERVAL_S + 3.0  # past any deadline the daemon could have had


def idle_daemon(*extra: str) -> Daemon:
    return Daemon("--idle-exit", f"{IDLE_S:g}", *extra)


def exits(d: Daemon, timeout: float) -> bool:
    return wait_for(lambda: not d.alive(), timeout)


def keep_asking(ask: Callable[[], object], seconds: float, every: float = 0.2) -> None:
    """Send a request every ``every`` seconds for ``seconds`` (a pace, not a wait for anything)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ask()
        time.sleep(every)


def spare_of(d: Daemon) -> int | None:
    """The daemon's spare loader (h5serve-spare: a forkserver child waiting for its job), if any."""
    for pid in descendant_pids(d.pid):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "h5serve-spare":
                return pid
        except OSError:
            continue
    return None


def assert_stopped_cleanly(d: Daemon) -> None:
    """What `h5serve stop` leaves: no segment, no socket, no pidfile; the log says why."""
    assert d.segment_files() == []
    assert not (d.runtime_dir / "h5serve.sock").exists() and not (d.runtime_dir / "h5serve.pid").exists()
    log = (d.runtime_dir / "h5serve.log").read_text()
    assert f"(--idle-exit {IDLE_S:g}): exiting" in log and "stopping (idle for" in log and "stopped" in log, log


def test_an_unused_daemon_exits_and_unlinks_its_segments(h5file: Path) -> None:
    d = idle_daemon()
    try:
        d.start()
        ds = SharedH5Dataset(h5file, "x", rank=0, world_size=1, runtime_dir=d.runtime_dir, fallback="error")
        assert ds.backend == "shm"
        ds.close()
        released = time.monotonic()
        assert len(d.segment_files()) == 1
        assert exits(d, EXIT_DEADLINE_S), "the unused daemon did not exit"
        waited = time.monotonic() - released
        print(f"\n[h5serve idle] --idle-exit {IDLE_S:g}: exited {waited:.2f}s after the last release")
        assert waited >= IDLE_S - 0.05, waited
        assert_stopped_cleanly(d)
        assert h5serve_cli("status", env=d.env).returncode == 3
    finally:
        d.stop()


def test_a_mapped_segment_keeps_it_until_released_then_it_exits(h5file: Path) -> None:
    d = idle_daemon()
    try:
        d.start()
        ds = SharedH5Dataset(h5file, "x", rank=0, world_size=1, runtime_dir=d.runtime_dir, fallback="error")
        try:
            assert ds.backend == "shm"
            assert not exits(d, HELD_S), "the daemon exited while a process held one of its segments"
            with DaemonClient(d.runtime_dir) as client:
                assert [s["holders"] for s in client.status()["segments"]] == [1]
            rows = ds.__getitems__([0, 5]).x.numpy()  # the mapping still reads
            assert rows.shape == (2, 3, 4, 4)
        finally:
            ds.close()
        released = time.monotonic()
        assert exits(d, EXIT_DEADLINE_S), "the daemon did not exit after the lease was released"
        waited = time.monotonic() - released
        print(f"\n[h5serve idle] held {HELD_S:g}s: exited {waited:.2f}s after the release")
        assert waited >= IDLE_S - 0.05, waited
        assert_stopped_cleanly(d)
    finally:
        d.stop()


def test_a_running_load_keeps_it(h5file: Path) -> None:
    d = idle_daemon("--loaders", "1")
    stopped: list[int] = []
    try:
        d.start()
        with DaemonClient(d.runtime_dir, timeout=5) as client:
            # pings count: the daemon stays while its spare loader starts (a second after its start)
            assert wait_for(lambda: bool(client.ping()) and spare_of(d) is not None, 30, interval=0.2), \
                "no spare loader started"
            spare = spare_of(d)
            assert spare is not None
            os.kill(spare, signal.SIGSTOP)
            stopped.append(spare)
            client.request(Acquire(str(h5file), "x", 1, 0))  # the load goes to the stopped spare
        assert not exits(d, HELD_S), "the daemon exited while a load ran"
        with DaemonClient(d.runtime_dir) as client:
            assert [s["state"] for s in client.status()["segments"]] == ["loading"]
        os.kill(spare, signal.SIGCONT)
        stopped.clear()
        assert exits(d, EXIT_DEADLINE_S + 10), "the daemon did not exit once its load was done"
        assert_stopped_cleanly(d)
        assert "loaded" in (d.runtime_dir / "h5serve.log").read_text()  # the load ran to its end first
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # gone with its daemon
                pass
        d.stop()


def test_pings_keep_it_and_status_probes_do_not() -> None:
    d = idle_daemon()
    try:
        d.start()
        with DaemonClient(d.runtime_dir, timeout=5) as client:
            keep_asking(client.ping, HELD_S)  # a client (stream mode sizing its window, `h5serve start`)
            assert d.alive(), "the daemon exited while a client pinged it"
            probing = time.monotonic()

            def probe_finds_it_gone() -> bool:  # an admin's `h5serve status`, every 0.2 s
                try:
                    client.status()
                except DaemonUnavailable:
                    return True
                return False

            assert wait_for(probe_finds_it_gone, EXIT_DEADLINE_S, interval=0.2), "status probes kept the daemon"
            waited = time.monotonic() - probing
            print(f"\n[h5serve idle] status every 0.2 s: exited {waited:.2f}s after the last ping")
            assert waited >= IDLE_S - 0.25, waited  # the last ping was at most one pace before
        assert exits(d, 10)
        assert_stopped_cleanly(d)
    finally:
        d.stop()


def test_idle_exit_zero_is_never() -> None:
    """0 is the default's meaning, given explicitly (a config file that always passes it)."""
    d = Daemon("--idle-exit", "0")
    try:
        d.start()
        assert not exits(d, HELD_S)
        with DaemonClient(d.runtime_dir) as client:
            assert client.status()["idle_exit"] is None
    finally:
        d.stop()


def test_a_hold_keeps_it_until_removed(tmp_path: Path) -> None:
    """--hold-dir (a SLURM prolog's holds for the user's running jobs): an entry keeps the daemon
    however long nobody asks it anything; status counts the holds; once the last goes, it exits."""
    holds = tmp_path / "holds"
    holds.mkdir()
    (holds / "4242").touch()
    d = idle_daemon("--hold-dir", str(holds))
    try:
        d.start()
        assert not exits(d, HELD_S), "the daemon exited while a hold was in --hold-dir"
        with DaemonClient(d.runtime_dir, timeout=5) as client:
            assert client.status()["idle_exit"]["holds"] == 1
        (holds / "4242").unlink()
        released = time.monotonic()
        assert exits(d, EXIT_DEADLINE_S), "the daemon did not exit once its last hold was gone"
        assert time.monotonic() - released >= IDLE_S - 0.05
        assert_stopped_cleanly(d)
    finally:
        d.stop()
