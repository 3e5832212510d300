"""The inspector is no channel into a root daemon (security round three, finding 2).

The attack: a member of a root daemon's ``--group`` points a key at a FIFO so the inspector
(running as the member) blocks, takes the inspector's answer pipe with ``pidfd_getfd``, writes
a pickle that runs ``os.system``, and kills the inspector: the daemon unpickled it as root.
Now the inspector is undumpable (nothing of the member's can trace it or take its
descriptors), keeps no descriptor of the daemon's but its answer pipe, and whatever reaches
the daemon through that pipe is decoded as data with a schema. Real throwaway users, a real
root daemon; root only.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import struct
import threading
import time
from pathlib import Path

import h5py
import pytest

from h5serve.errors import H5ServeError
from h5serve.wire.connection import DaemonClient
from h5serve.wire.protocol import Acquire

from ..helpers import Daemon, wait_for
from ..users import User, as_user, root_only, throwaway_group, throwaway_user

pytestmark = [root_only, pytest.mark.timeout(180)]

_SYS_PIDFD_GETFD = {"x86_64": 438, "aarch64": 438}.get(os.uname().machine)


def _pidfd_getfd(pid: int, fd: int) -> int:
    """A copy of process ``pid``'s descriptor ``fd`` (what a same-uid tracer may take).

    Raised when the kernel refuses: OSError with its errno."""
    if _SYS_PIDFD_GETFD is None:
        pytest.skip(f"pidfd_getfd's syscall number on {os.uname().machine} is not known to this test")
    pidfd = os.pidfd_open(pid)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        got = libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return got
    finally:
        os.close(pidfd)


def _inspectors_of(uid: int) -> list[int]:
    """Pids of inspection processes running as ``uid``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and Path(f"/proc/{entry}/comm").read_text().strip() == "h5serve-inspect":
                status = Path(f"/proc/{entry}/status").read_text()
                uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
                if int(uids[0]) == uid:
                    found.append(int(entry))
        except (OSError, StopIteration, ValueError):
            pass
    return found


def _fds(pid: int) -> dict[int, str]:
    out = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            pass
    return out


def _member_reaches(pid: int, fds: list[int]) -> list[str]:
    """As the member: every way into the inspector that worked (none may)."""
    reached = []
    for fd in fds:
        try:
            got = _pidfd_getfd(pid, fd)
            os.close(got)
            reached.append(f"pidfd_getfd({fd})")
        except OSError:
            pass
    for what in ("fd/0", "environ", "mem"):
        try:
            with open(f"/proc/{pid}/{what}", "rb") as f:
                f.read(1)
            reached.append(f"/proc/{pid}/{what}")
        except OSError:
            pass
    return reached


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"id > {self.marker}",))


def _fifo_file(directory: Path, member: User) -> Path:
    """As the member: a file whose ``x`` is an external link to a FIFO of theirs (an
    inspection of it blocks in HDF5's open)."""
    fifo, path = directory / "fifo.h5", directory / "f.h5"

    def make() -> None:
        os.mkfifo(fifo)
        with h5py.File(path, "w") as f:
            f["x"] = h5py.ExternalLink(str(fifo), "/x")
        path.chmod(0o644)

    assert as_user(member, make)[0] == "ok"
    return path


def test_a_member_can_neither_reach_the_inspector_nor_run_code_through_its_answer(public_dir: Path) -> None:
    marker = public_dir / "ran-as-root"
    with throwaway_group() as group, throwaway_user((group,)) as member:
        mine = public_dir / "mine"
        mine.mkdir(mode=0o755)
        os.chown(mine, member.uid, member.gid)
        path = _fifo_file(mine, member)
        d = Daemon("--group", group.name)
        d.dir.chmod(0o755)
        try:
            d.start()
            outcome: dict[str, object] = {}

            def ask() -> None:
                def acquire() -> str:
                    try:
                        with DaemonClient(d.runtime_dir, timeout=10) as client:
                            client.acquire(Acquire(str(path), "x", 1, 0), deadline=time.monotonic() + 60)
                        return "served"
                    except H5ServeError as exc:
                        return f"{type(exc).__name__}: {exc}"
                outcome["out"] = as_user(member, acquire, timeout=90)

            asker = threading.Thread(target=ask, daemon=True)
            asker.start()
            assert wait_for(lambda: bool(_inspectors_of(member.uid)), 20), "no inspector ran as the member"
            pid = _inspectors_of(member.uid)[0]
            fds = _fds(pid)
            # nothing of the daemon's but the answer pipe: no log, no socket, no resource tracker's pipe
            assert all(fds[n] == "/dev/null" for n in (0, 1, 2)), fds
            others = {n: target for n, target in fds.items() if n > 2}
            assert sum(t.startswith("pipe:") for t in others.values()) == 1, fds
            assert not any(t.startswith("socket:") or t.endswith(".log") for t in others.values()), fds

            status, reached = as_user(member, lambda: _member_reaches(pid, sorted(fds)))
            assert status == "ok" and reached == [], reached

            # what the member can no longer do, done by root: hostile bytes on the answer pipe
            pipe = next(n for n, t in others.items() if t.startswith("pipe:"))
            exploit = pickle.dumps(_Exploit(marker))
            writer = _pidfd_getfd(pid, pipe)
            try:
                os.write(writer, struct.pack("!i", len(exploit)) + exploit)
            finally:
                os.close(writer)
            os.kill(pid, 9)
            asker.join(60)
            assert not asker.is_alive()
            status, out = outcome["out"]  # type: ignore[misc]
            assert status == "ok" and str(out).startswith("SourceChanged") and "not a description" in str(out), out
            assert not marker.exists(), marker.read_text()
            assert d.status()["pid"] == d.pid  # the daemon serves on
        finally:
            d.stop()
