"""Published segments cannot be changed, and a damaged one is never served (issue 9, section 6).

Real daemons, real /dev/shm, real users: a segment is read-only for its own user once
published; one damaged anyway (by root, who bypasses modes) is never handed out again: the
next request loads it again when its size, mode or header changed, and `h5serve status
--verify` names it when only its rows changed. Processes that mapped the old file keep
reading it. Every test has a deadline and stops what it started in ``finally``.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import struct
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.client import SharedH5Dataset
from h5serve.errors import SegmentError
from h5serve.segments import HEADER_SIZE, attach_segment, is_published_as
from h5serve.wire.connection import DaemonClient
from h5serve.wire.protocol import Acquire, AcquireResult

from ..helpers import Daemon, expected_checksum, h5serve_cli, kill_daemon_of, wait_for
from ..users import as_user, portable_python, root_only, run_as, throwaway_user

pytestmark = pytest.mark.timeout(180)


def acquire(client: DaemonClient, path: Path, key: str = "x") -> tuple[AcquireResult, Path]:
    result = client.acquire(Acquire(str(path), key, 1, 0))
    return result, Path(result.shm_dir) / result.name


def rows_of(path: Path, key: str = "x") -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f[key][...]


def patch(path: Path, offset: int, data: bytes) -> None:
    """Write into a file as root does: modes do not stop root."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def flip_byte(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- read-only on disk


@root_only
def test_a_published_segment_cannot_be_opened_for_writing_by_its_own_user(public_dir: Path) -> None:
    """A buggy job of the daemon's own user can no longer pwrite into (or truncate) the
    segments every other job reads: they are 0400 from the moment their name exists."""
    with throwaway_user() as user, portable_python() as py:
        runtime_dir = public_dir / "rt"
        try:
            started = py.run("start", "--user", user.name, "--runtime-dir", str(runtime_dir))
            assert started.returncode == 0, started.stderr

            def write_into_segment() -> dict[str, object]:
                ds = SharedH5Dataset(public_dir / "data.h5", "x", runtime_dir=runtime_dir, fallback="error")
                path = ds._backend.segments[0].path
                st = os.stat(path)
                out: dict[str, object] = {"backend": ds.backend, "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid}
                def open_for_update() -> None:
                    with open(path, "r+b"):
                        pass

                for what, attempt in (("open_rdwr", lambda: os.open(path, os.O_RDWR)),
                                      ("open_wronly", lambda: os.open(path, os.O_WRONLY)),
                                      ("open_r+", open_for_update),
                                      ("truncate", lambda: os.truncate(path, 0))):
                    try:
                        attempt()
                        out[what] = "allowed"
                    except PermissionError:
                        out[what] = "PermissionError"
                out["rows"] = ds.__getitems__(list(range(len(ds)))).x.numpy().tobytes()
                ds.close()
                return out

            status, out = as_user(user, write_into_segment)
            assert status == "ok", out
            assert out["backend"] == "shm" and out["uid"] == user.uid and out["mode"] == 0o400, out
            for what in ("open_rdwr", "open_wronly", "open_r+", "truncate"):
                assert out[what] == "PermissionError", (what, out)
            assert out["rows"] == rows_of(public_dir / "data.h5").tobytes()
            stopped = py.run("stop", "--runtime-dir", str(runtime_dir), user=user)
            assert stopped.returncode == 0, stopped.stderr
        finally:
            kill_daemon_of(runtime_dir)


# --------------------------------------------------------------------------- damaged: reloaded


def _damage(path: Path, how: str) -> None:
    if how == "truncated":
        os.truncate(path, HEADER_SIZE)
    elif how == "header rewritten":
        flip_byte(path, 64 + 5)  # inside the metadata: still parses? the daemon compares bytes
    elif how == "rows_total rewritten":
        patch(path, 24, struct.pack("<Q", 1))
    elif how == "made writable":
        os.chmod(path, 0o600)  # what a same-user process must do before it can write
    elif how == "removed":
        os.unlink(path)
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["truncated", "header rewritten", "rows_total rewritten", "made writable", "removed"])
def test_a_damaged_segment_is_loaded_again_before_it_is_served(daemon: Daemon, public_dir: Path, how: str) -> None:
    expected = rows_of(public_dir / "data.h5")
    with DaemonClient(daemon.runtime_dir, timeout=10) as client:
        first, path = acquire(client, public_dir / "data.h5")
        old_ino = os.stat(path).st_ino
        reader = attach_segment(Path(first.shm_dir), first.name)  # a job that mapped it before the damage
        try:
            _damage(path, how)
            second, path2 = acquire(client, public_dir / "data.h5")
            st = os.stat(path2, follow_symlinks=False)
            assert second.name == first.name and stat.S_ISREG(st.st_mode) and st.st_ino != old_ino, how
            assert stat.S_IMODE(st.st_mode) == 0o400
            fresh = attach_segment(Path(second.shm_dir), second.name)
            try:
                np.testing.assert_array_equal(fresh.data, expected)
            finally:
                fresh.close()
            if how != "truncated":  # a truncated file is gone for its readers too (SIGBUS past its end)
                np.testing.assert_array_equal(reader.data, expected)  # the reload did not touch their mapping
            status = client.status()
            assert status["counters"]["damaged"] == 1 and status["counters"]["loads"] == 2, status["counters"]
            acquire(client, public_dir / "data.h5")  # now intact: a plain hit
            assert client.status()["counters"]["loads"] == 2
        finally:
            reader.close()
    log = (daemon.runtime_dir / "h5serve.log").read_text()
    assert f"loading {os.path.realpath(public_dir / 'data.h5')}[x] all ranks (global) again" in log


def test_a_fifo_at_a_ready_name_is_never_served_and_never_blocks(daemon: Daemon, public_dir: Path) -> None:
    """A segment replaced by something that is not a regular file of the daemon's: the daemon
    does not hand it out, does not touch it (it is not its own file), and loads the segment
    again under a fresh name (issue 21: the load used to fail for good, the client read lazily)."""
    with DaemonClient(daemon.runtime_dir, timeout=10) as client:
        _, path = acquire(client, public_dir / "data.h5")
        os.unlink(path)
        os.mkfifo(path, 0o600)
        try:
            started = time.monotonic()
            result, fresh = acquire(client, public_dir / "data.h5")
            assert time.monotonic() - started < 10 and stat.S_ISFIFO(os.lstat(path).st_mode)
            assert is_published_as(result.name, path.name) and fresh != path
            assert client.status()["counters"]["damaged"] == 1
            ds = SharedH5Dataset(public_dir / "data.h5", "x", runtime_dir=daemon.runtime_dir, timeout=10,
                                 fallback="error")
            assert ds.backend == "shm" and ds.__getitems__([0]).x.numpy().tobytes() == rows_of(
                public_dir / "data.h5")[:1].tobytes()
            ds.close()
        finally:
            path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- changed by its owner


def _tamper_as(user: object, path: Path, how: str) -> None:
    """As the daemon's own user: put 64 bytes of 0xAB over row 0 of ``path`` and leave it as it
    was to see (mode 0400, same size, same header)."""
    poison = f"head -c 64 /dev/zero | tr '\\0' '\\253' | dd of=%s bs=64 seek={HEADER_SIZE} oflag=seek_bytes " \
             "conv=notrunc status=none"
    if how == "made writable and back":
        script = f"chmod u+w {path} && {poison % path} && chmod u-w {path}"
    else:  # unlinked, re-created with the same header, renamed into place
        tmp = f"{path}.new"
        script = f"cp {path} {tmp} && chmod 600 {tmp} && {poison % tmp} && chmod 400 {tmp} && mv -f {tmp} {path}"
    done = run_as(user, ["sh", "-c", script])  # type: ignore[arg-type]
    assert done.returncode == 0, done.stderr
    assert os.stat(path).st_mode & 0o777 == 0o400
    assert open(path, "rb").read()[HEADER_SIZE:HEADER_SIZE + 64] == b"\xab" * 64


@root_only
@pytest.mark.parametrize("how", ["made writable and back", "replaced"])
def test_a_segment_its_owner_changed_is_never_served(public_dir: Path, how: str) -> None:
    """A ``--user U`` daemon started as root; U (any job of the daemon's user) changes a
    published segment and leaves it looking as published. ``status`` does not call it ready,
    and a new client gets the true rows (the daemon loads it again: ``damaged``)."""
    data = public_dir / "data.h5"
    expected = rows_of(data)
    with throwaway_user() as user, portable_python() as py:
        runtime_dir = public_dir / "rt"
        try:
            started = py.run("start", "--user", user.name, "--runtime-dir", str(runtime_dir))
            assert started.returncode == 0, started.stderr
            with DaemonClient(runtime_dir, timeout=10, daemon_user=user.name) as client:
                first, path = acquire(client, data)
                published = os.stat(path).st_ctime_ns
                assert wait_for(lambda: time.time_ns() > published + 50_000_000, 5)  # past the clock's tick
                _tamper_as(user, path, how)
                (seg,) = client.status()["segments"]
                assert seg["name"] == first.name and seg["state"] != "ready", seg
            ds = SharedH5Dataset(data, "x", runtime_dir=runtime_dir, daemon_user=user.name, fallback="error")
            assert ds.backend == "shm"
            np.testing.assert_array_equal(ds.__getitems__(list(range(len(ds)))).x.numpy(), expected)
            ds.close()
            with DaemonClient(runtime_dir, timeout=10, daemon_user=user.name) as client:
                status = client.status()
            assert status["counters"]["damaged"] == 1 and status["counters"]["loads"] == 2, status["counters"]
            assert [s["state"] for s in status["segments"]] == ["ready"]
        finally:
            kill_daemon_of(runtime_dir)


def test_attach_refuses_a_file_changed_since_the_daemon_published_it(daemon: Daemon, public_dir: Path) -> None:
    """The client's own check, for a change between the daemon's check and the attach: the
    inode and ctime in the reply must be those of the file it opens."""
    from h5serve.segments import PublishStamp

    with DaemonClient(daemon.runtime_dir, timeout=10) as client:
        result, path = acquire(client, public_dir / "data.h5")
    stamp = PublishStamp(result.ino, result.ctime_ns)
    assert stamp == PublishStamp.of(os.stat(path))
    attach_segment(Path(result.shm_dir), result.name, stamp=stamp).close()
    assert wait_for(lambda: time.time_ns() > result.ctime_ns + 50_000_000, 5)
    os.chmod(path, 0o600)
    os.chmod(path, 0o400)
    with pytest.raises(SegmentError, match="changed since the daemon published it"):
        attach_segment(Path(result.shm_dir), result.name, stamp=stamp)


# --------------------------------------------------------------------------- content: status --verify


def test_status_verify_names_a_segment_whose_rows_changed(daemon: Daemon, public_dir: Path) -> None:
    with DaemonClient(daemon.runtime_dir, timeout=10) as client:
        result, path = acquire(client, public_dir / "data.h5")
        acquire(client, public_dir / "data.h5", "y")
        (seg,) = [s for s in client.status()["segments"] if s["key"] == "x"]
    # the checksum is the crc32c (or crc32) of the rows as loaded: anyone can recompute it
    assert seg["checksum"] == expected_checksum(rows_of(public_dir / "data.h5").tobytes())

    clean = h5serve_cli("status", "--verify", env=daemon.env)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "verified 2 segments" in clean.stdout and "every one matches" in clean.stdout

    flip_byte(path, HEADER_SIZE + 1234)  # root flips one byte of the rows: mode and header are intact
    damaged = h5serve_cli("status", "--verify", env=daemon.env)
    assert damaged.returncode == 1, damaged.stdout + damaged.stderr
    assert "1 DAMAGED" in damaged.stdout and result.name in damaged.stdout
    assert f"{os.path.realpath(public_dir / 'data.h5')}[x] rank 0/1" in damaged.stdout
    assert f"rm {path}" in damaged.stdout and "loads them again" in damaged.stdout
    report = json.loads(h5serve_cli("status", "--verify", "--json", env=daemon.env).stdout)["verify"]
    assert [d["name"] for d in report["damaged"]] == [result.name] and report["checked"] == 2
    assert f"not the {seg['checksum'].split(':')[0]}:" in report["damaged"][0]["problem"]

    os.unlink(path)  # what the message says to do: the next request loads it again
    with DaemonClient(daemon.runtime_dir, timeout=10) as client:
        _, path = acquire(client, public_dir / "data.h5")
        np.testing.assert_array_equal(np.fromfile(path, dtype=np.uint8, offset=HEADER_SIZE),
                                      rows_of(public_dir / "data.h5").ravel())
    again = h5serve_cli("status", "--verify", env=daemon.env)
    assert again.returncode == 0, again.stdout


def test_without_checksums_verify_says_so(public_dir: Path) -> None:
    d = Daemon("--no-checksum")
    try:
        d.start()
        with DaemonClient(d.runtime_dir, timeout=10) as client:
            acquire(client, public_dir / "data.h5")
            assert [s["checksum"] for s in client.status()["segments"]] == [""]
        done = h5serve_cli("status", "--verify", env=d.env)
        assert done.returncode == 0 and "1 loaded without a checksum" in done.stdout, done.stdout
    finally:
        d.stop()


# --------------------------------------------------------------------------- restarts and old formats


def test_restart_adopts_checksummed_segments_and_drops_old_formats(public_dir: Path) -> None:
    d = Daemon()
    try:
        d.start()
        with DaemonClient(d.runtime_dir, timeout=10) as client:
            _, x_path = acquire(client, public_dir / "data.h5")
            _, y_path = acquire(client, public_dir / "data.h5", "y")
            before = {s["key"]: s["checksum"] for s in client.status()["segments"]}
        os.kill(d.pid, signal.SIGKILL)
        assert wait_for(lambda: not d.alive(), 10)
        patch(y_path, 8, struct.pack("<I", 1))  # as if an older h5serve had written y's segment
        d.start()
        with DaemonClient(d.runtime_dir, timeout=10) as client:
            status = client.status()
            assert status["counters"]["adopted"] == 1 and not y_path.exists()
            _, path = acquire(client, public_dir / "data.h5")  # a hit on the adopted segment
            assert path == x_path and client.status()["counters"]["loads"] == 0
            acquire(client, public_dir / "data.h5", "y")  # loaded again, in the current format
            after = {s["key"]: s["checksum"] for s in client.status()["segments"]}
        assert after == before
        assert h5serve_cli("status", "--verify", env=d.env).returncode == 0
        log = (d.runtime_dir / "h5serve.log").read_text()
        assert "has segment format 1, this h5serve reads 2" in log
    finally:
        d.stop()
