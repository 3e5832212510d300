"""A shared daemon is never a confused deputy (issue 21: the Critical finding, the High "one
request freezes the daemon", and the Lows on oracles and unknown peers).

Every test acts as the hostile user for real: throwaway users and groups (tests/users.py),
a real daemon, real /dev/shm. They need root and skip elsewhere.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.errors import H5ServeError, SourceNotFound
from h5serve.segments.naming import segment_prefix
from h5serve.wire.connection import DaemonClient
from h5serve.wire.protocol import Acquire
from h5serve.wire.runtime import resolve_runtime

from ..helpers import Daemon, kill_daemon_of, make_h5, segments_holding, wait_for
from ..users import (
    PortablePython,
    User,
    as_ids,
    as_user,
    exchange_forever,
    root_only,
    running_as,
    throwaway_group,
    throwaway_user,
)

pytestmark = [root_only, pytest.mark.timeout(240)]

KEYS = 600  # datasets per file: every request of the swap test asks for a fresh one
ROW_BYTES = 64
SWAP_PAUSE = 0.003  # the attacker's swaps: up to this long apart, so a whole load may see either side


def _keyed_file(path: Path, marker: bytes) -> Path:
    """A file of KEYS datasets k0.., each 8 rows of ``marker`` tiled (the same layout in every
    file, so a swapped-in file passes for the checked one)."""
    rows = np.frombuffer(marker * (ROW_BYTES // len(marker)) * 8, dtype=np.uint8).reshape(8, ROW_BYTES)
    with h5py.File(path, "w") as f:
        for k in range(KEYS):
            f.create_dataset(f"k{k}", data=rows)
    return path


def _ask_fresh_keys(runtime_dir: Path, path: Path, seconds: float, daemon_user: str | None = None,
                    start: int = 0) -> dict[str, object]:
    """As the calling user: one request per fresh key of ``path`` (from ``k{start}`` on) for
    ``seconds`` (at least one); the outcomes by kind, and one message of each kind of error
    (under "messages")."""
    outcomes: Counter[str] = Counter()
    messages: dict[str, str] = {}
    with DaemonClient(runtime_dir, timeout=10, daemon_user=daemon_user) as client:
        end = time.monotonic() + seconds
        for k in range(start, KEYS):
            if k > start and time.monotonic() > end:
                break
            try:
                client.acquire(Acquire(str(path), f"k{k}", 1, 0), deadline=time.monotonic() + 20)
                outcomes["served"] += 1
            except H5ServeError as exc:
                outcomes[type(exc).__name__] += 1
                messages.setdefault(type(exc).__name__, str(exc))
    return {**outcomes, "messages": messages}


def _assert_clear_refusals(outcomes: object, also: tuple[str, ...] = ()) -> None:
    """Many requests were made, and each was served or refused as a swap should be."""
    assert isinstance(outcomes, dict)
    messages = outcomes.pop("messages")
    assert set(outcomes) <= {"served", "AccessDenied", "SourceChanged", *also}, (outcomes, messages)
    assert sum(outcomes.values()) >= 20, outcomes


@pytest.fixture
def swap_files(public_dir: Path) -> Iterator[tuple[Path, Path, Path, bytes]]:
    """(allowed root, vault, secret file, the secret's marker bytes): the secret lies outside the
    allowed root, in a directory only root may enter."""
    allowed, vault = public_dir / "allowed", public_dir / "vault"
    allowed.mkdir(mode=0o755)
    vault.mkdir(mode=0o711)
    marker = secrets.token_bytes(16)
    secret = _keyed_file(vault / "secret.h5", marker)
    secret.chmod(0o600)
    yield allowed, vault, secret, marker


def _attacker_dir(allowed: Path, attacker: User, secret: Path) -> tuple[Path, Path]:
    """The attacker's own dir inside the allowed root: a decoy they may read and a symlink to the secret."""
    mine = allowed / "mine"
    mine.mkdir(mode=0o755)
    decoy = _keyed_file(mine / "decoy.h5", secrets.token_bytes(16))
    swap = mine / "swap.h5"
    swap.symlink_to(secret)
    for p in (mine, decoy, swap):
        os.lchown(p, attacker.uid, attacker.gid)
    return decoy, swap


# --------------------------------------------------------------------------- Critical: checked == read


def test_root_daemon_never_loads_a_secret_swapped_in_for_a_checked_decoy(swap_files) -> None:
    """A group member swaps their decoy with a symlink to a root-only file outside --allow-root
    (renameat2 RENAME_EXCHANGE in a loop) while asking for a fresh key every request: no segment
    ever holds the secret's bytes, and every refusal is a clear error."""
    allowed, _, secret, marker = swap_files
    with throwaway_group() as group, throwaway_user((group,)) as attacker:
        decoy, swap = _attacker_dir(allowed, attacker, secret)
        d = Daemon("--group", group.name, "--allow-root", str(allowed))
        d.dir.chmod(0o755)
        try:
            d.start()
            prefix = segment_prefix(resolve_runtime(d.runtime_dir).namespace)
            assert as_user(attacker, lambda: _ask_fresh_keys(d.runtime_dir, decoy, 0, None, KEYS - 1)) == (
                "ok", {"served": 1, "messages": {}})  # unswapped, the decoy is served
            with running_as(attacker, exchange_forever(decoy, swap, SWAP_PAUSE)):
                status, outcomes = as_user(attacker, lambda: _ask_fresh_keys(d.runtime_dir, decoy, 4.0), timeout=120)
            assert status == "ok", outcomes
            assert wait_for(lambda: all(s["state"] != "loading" for s in d.status()["segments"]), 30)
            assert segments_holding(prefix, marker) == []
            _assert_clear_refusals(outcomes)
        finally:
            d.stop()


def test_service_account_daemon_never_loads_a_secret_swapped_in_for_a_checked_decoy(
        swap_files, py: PortablePython) -> None:
    """The same swap against a daemon under a service account (``--user --group --allow-root``):
    the secret belongs to the service account, the member may not read it."""
    allowed, _, secret, marker = swap_files
    with throwaway_group() as group, throwaway_user() as service, throwaway_user((group,)) as attacker:
        subprocess.run(["usermod", "-aG", group.name, service.name], check=True, timeout=60)
        os.chown(secret, service.uid, service.gid)
        decoy, swap = _attacker_dir(allowed, attacker, secret)
        runtime_dir = allowed.parent / "rt"
        try:
            done = py.run("start", "--user", service.name, "--group", group.name, "--allow-root", str(allowed),
                          "--runtime-dir", str(runtime_dir))
            assert done.returncode == 0, done.stderr
            prefix = segment_prefix(resolve_runtime(runtime_dir).namespace)
            assert as_user(attacker, lambda: _ask_fresh_keys(runtime_dir, decoy, 0, service.name, KEYS - 1)) == (
                "ok", {"served": 1, "messages": {}})  # unswapped, the decoy is served
            with running_as(attacker, exchange_forever(decoy, swap, SWAP_PAUSE)):
                status, outcomes = as_user(
                    attacker, lambda: _ask_fresh_keys(runtime_dir, decoy, 4.0, service.name), timeout=120)
            assert status == "ok", outcomes
            _assert_clear_refusals(outcomes)
            with DaemonClient(runtime_dir, timeout=10, daemon_user=service.name) as client:
                assert wait_for(lambda: all(s["state"] != "loading" for s in client.status()["segments"]), 30)
            assert segments_holding(prefix, marker) == []
        finally:
            kill_daemon_of(runtime_dir)


def test_an_external_links_target_swapped_after_the_check_is_never_loaded(swap_files) -> None:
    """The member's file links externally to a target in their own dir, which they swap with a
    symlink to the secret: the target HDF5 opened is checked against the one resolved."""
    allowed, _, secret, marker = swap_files
    with throwaway_group() as group, throwaway_user((group,)) as attacker:
        target, swap = _attacker_dir(allowed, attacker, secret)
        outer = allowed / "mine" / "outer.h5"
        with h5py.File(outer, "w") as f:
            for k in range(KEYS):
                f[f"k{k}"] = h5py.ExternalLink(str(target), f"/k{k}")
        os.chown(outer, attacker.uid, attacker.gid)
        d = Daemon("--group", group.name, "--allow-root", str(allowed))
        d.dir.chmod(0o755)
        try:
            d.start()
            prefix = segment_prefix(resolve_runtime(d.runtime_dir).namespace)
            with running_as(attacker, exchange_forever(target, swap, SWAP_PAUSE)):
                status, outcomes = as_user(attacker, lambda: _ask_fresh_keys(d.runtime_dir, outer, 4.0), timeout=120)
            assert status == "ok", outcomes
            assert wait_for(lambda: all(s["state"] != "loading" for s in d.status()["segments"]), 30)
            assert segments_holding(prefix, marker) == []
            # KeyNotFound: the target, swapped, cannot be opened; UnsupportedDataset: the link leads on
            _assert_clear_refusals(outcomes, also=("KeyNotFound", "UnsupportedDataset"))
        finally:
            d.stop()


def test_virtual_datasets_are_loaded_only_for_the_daemons_user_and_root(public_dir: Path) -> None:
    """A VDS's sources are opened by name at every read (they cannot be pinned): a member is
    refused with what to do, root (the daemon's own user here) is served."""
    source = make_h5(public_dir / "source.h5")
    layout = h5py.VirtualLayout(shape=(1000,), dtype="int64")
    layout[:] = h5py.VirtualSource(str(source), "y", shape=(1000,))
    vds = public_dir / "vds.h5"
    with h5py.File(vds, "w") as f:
        f.create_virtual_dataset("v", layout)
    vds.chmod(0o644)
    with throwaway_group() as group, throwaway_user((group,)) as member:
        d = Daemon("--group", group.name)
        d.dir.chmod(0o755)
        try:
            d.start()

            def ask() -> int:
                with DaemonClient(d.runtime_dir, timeout=10) as client:
                    return client.acquire(Acquire(str(vds), "v", 1, 0), deadline=time.monotonic() + 30).rows_total

            status, out = as_user(member, ask)
            assert status == "error" and out.startswith("AccessDenied") and "virtual dataset" in str(out), out
            assert "fallback='lazy'" in str(out) and "owner" in str(out)
            assert ask() == 1000
        finally:
            d.stop()


# --------------------------------------------------------------------------- High: nothing freezes the daemon


def _fifo_openers(pid: int) -> list[str]:
    """Threads of process ``pid`` and its descendants blocked opening a FIFO (the kernel's
    ``wait_for_partner``): a request stuck in HDF5's open, wherever the daemon runs HDF5."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit():
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    family, grew = {pid}, True
    while grew:
        more = {child for child, parent in parents.items() if parent in family} - family
        family |= more
        grew = bool(more)
    blocked = []
    for member in family:
        try:
            for tid in os.listdir(f"/proc/{member}/task"):
                if Path(f"/proc/{member}/task/{tid}/wchan").read_text() == "wait_for_partner":
                    blocked.append(f"{member}/{tid}")
        except OSError:
            pass
    return blocked


def _inspector_pids() -> list[int]:
    """Pids of h5serve inspection processes (as their name shows)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and Path(f"/proc/{entry}/comm").read_text().strip() == "h5serve-inspect":
                found.append(int(entry))
        except OSError:
            pass
    return found


def _ping_seconds(runtime_dir: Path, count: int = 5) -> float:
    """The slowest of ``count`` pings from a fresh client (each bounded at 5 s)."""
    worst = 0.0
    with DaemonClient(runtime_dir, timeout=5) as client:
        for _ in range(count):
            started = time.monotonic()
            client.ping()
            worst = max(worst, time.monotonic() - started)
    return worst


class _Request(threading.Thread):
    """One acquire in a thread; ``error`` is what it raised."""

    def __init__(self, runtime_dir: Path, path: Path, key: str) -> None:
        super().__init__(daemon=True)
        self.runtime_dir, self.path, self.key = runtime_dir, path, key
        self.error: BaseException | None = None
        self.seconds = 0.0

    def run(self) -> None:
        started = time.monotonic()
        try:
            with DaemonClient(self.runtime_dir, timeout=5) as client:
                client.acquire(Acquire(str(self.path), self.key, 1, 0), deadline=time.monotonic() + 60)
        except BaseException as exc:  # noqa: BLE001 - the test asserts on it
            self.error = exc
        self.seconds = time.monotonic() - started


def test_an_external_link_to_a_fifo_never_freezes_the_daemon(public_dir: Path) -> None:
    """A dataset that is an external link to a FIFO (no race needed): while HDF5 blocks opening
    it, ping answers within 1 s and status answers; the request fails with a clear error after
    the inspection's deadline; `h5serve stop` stops the daemon promptly while another one is stuck."""
    fifo = public_dir / "fifo.h5"
    os.mkfifo(fifo)
    linked = public_dir / "linked.h5"
    with h5py.File(linked, "w") as f:
        f["x"] = h5py.ExternalLink(str(fifo), "/x")
        f["y"] = h5py.ExternalLink(str(fifo), "/y")
    d = Daemon()
    try:
        d.start()
        stuck = _Request(d.runtime_dir, linked, "x")
        stuck.start()
        assert wait_for(lambda: bool(_fifo_openers(d.pid)), 10), "the request never reached HDF5"
        worst = _ping_seconds(d.runtime_dir)
        print(f"slowest ping while a request is stuck in HDF5: {worst * 1000:.1f} ms")
        assert worst < 1.0
        assert d.status()["pid"] == d.pid
        stuck.join(60)
        assert isinstance(stuck.error, SourceNotFound), stuck.error
        assert "did not open within 10s" in str(stuck.error) and str(linked) in str(stuck.error)
        assert wait_for(lambda: not _fifo_openers(d.pid), 10)  # the stuck child was killed

        again = _Request(d.runtime_dir, linked, "y")
        again.start()
        assert wait_for(lambda: bool(_fifo_openers(d.pid)), 10)
        started = time.monotonic()
        done = d.cli("stop", timeout=60)
        assert done.returncode == 0, done.stderr
        assert wait_for(lambda: not d.alive(), 10)
        stop_seconds = time.monotonic() - started
        print(f"h5serve stop with a request stuck in HDF5: {stop_seconds:.2f} s")
        assert stop_seconds < 10
        assert wait_for(lambda: not [p for p in _inspector_pids()], 10)  # no inspection outlives its daemon
    finally:
        d.stop()


def test_a_fifo_raced_in_before_hdf5_opens_never_freezes_the_daemon(public_dir: Path) -> None:
    """A FIFO swapped with the checked file as fast as a process can, requests for fresh keys
    until one gets the FIFO into HDF5's open (past the O_NONBLOCK checks): ping answers within
    1 s while it is stuck, and that request fails with a clear error after the deadline."""
    path = _keyed_file(public_dir / "racy.h5", b"r" * 16)
    fifo = public_dir / "racy.fifo"
    os.mkfifo(fifo)
    # the race can also reach a loader's open, which only the stall check ends (120 s by default,
    # past every request's 60 s deadline, while the loads queued behind it wait their own 60 s)
    d = Daemon("--stall-timeout", "10")
    stop = threading.Event()
    keys = iter(range(KEYS))
    errors: list[BaseException | None] = []

    def ask() -> None:
        while not stop.is_set():
            request = _Request(d.runtime_dir, path, f"k{next(keys, 0)}")
            request.run()
            errors.append(request.error)

    try:
        d.start()
        with running_as(None, exchange_forever(path, fifo)):
            askers = [threading.Thread(target=ask, daemon=True) for _ in range(3)]
            for asker in askers:
                asker.start()
            assert wait_for(lambda: bool(_fifo_openers(d.pid)), 60, interval=0.01), (
                f"no FIFO got into HDF5's open in {len(errors)} requests")
            stop.set()
            worst = _ping_seconds(d.runtime_dir, 10)
            assert d.status()["pid"] == d.pid
        joined_by = time.monotonic() + 70  # a request's own deadline is 60 s
        for asker in askers:
            asker.join(max(0.0, joined_by - time.monotonic()))
        print(f"slowest ping while a raced-in FIFO blocks HDF5's open: {worst * 1000:.1f} ms "
              f"({len(errors)} requests)")
        assert worst < 1.0
        # the stuck one failed after the inspection's deadline ("did not open within 10s"), or in its
        # loader (whose open the same race can reach: a loader process, killed by the stall check)
        assert not any(asker.is_alive() for asker in askers)
        assert all(e is None or isinstance(e, H5ServeError) for e in errors), errors
    finally:
        stop.set()
        d.stop()


# --------------------------------------------------------------------------- Low: no oracle


def test_external_links_into_an_unreadable_file_tell_nothing_of_its_contents(public_dir: Path) -> None:
    """A member links to a dataset that exists and to one that does not, in a root-only file:
    a root daemon follows the links with the member's rights, so both answers are the same."""
    vault = public_dir / "vault"
    vault.mkdir(mode=0o700)
    secret = make_h5(vault / "secret.h5")
    probe = public_dir / "probe.h5"
    with h5py.File(probe, "w") as f:
        f["a"] = h5py.ExternalLink(str(secret), "/x")
        f["b"] = h5py.ExternalLink(str(secret), "/no-such-dataset")
    probe.chmod(0o644)
    with throwaway_group() as group, throwaway_user((group,)) as member:
        d = Daemon("--group", group.name)
        d.dir.chmod(0o755)
        try:
            d.start()

            def ask(key: str) -> str:
                with DaemonClient(d.runtime_dir, timeout=10) as client:
                    try:
                        client.acquire(Acquire(str(probe), key, 1, 0), deadline=time.monotonic() + 30)
                    except H5ServeError as exc:
                        return f"{type(exc).__name__}: {exc}"
                return "served"

            _, exists = as_user(member, lambda: ask("a"))
            _, missing = as_user(member, lambda: ask("b"))
            assert exists != "served"
            assert str(exists).replace("a'", "K'").replace("'/x'", "T") == \
                str(missing).replace("b'", "K'").replace("'/no-such-dataset'", "T"), (exists, missing)
        finally:
            d.stop()


def test_an_unknown_peer_is_never_served_unchecked() -> None:
    """A request whose sender the transport did not report (no SO_PEERCRED) is refused by a
    daemon other users can reach (root, or --group), and is the daemon's own user's only
    where nobody else can connect (a per-user daemon without --group)."""
    from h5serve.daemon.access.peer import Peer, requester
    from h5serve.errors import AccessDenied

    known = Peer(1234, 1234, 1)
    assert requester(known, None) == known and requester(known, 5678) == known
    for group in (None, 5678):  # the suite runs as root: root's daemon refuses with or without a group
        with pytest.raises(AccessDenied, match="cannot tell who sent this request"):
            requester(None, group)

    def as_service_account() -> tuple[int, str]:
        own = requester(None, None).uid
        try:
            requester(None, 5678)
        except AccessDenied as exc:
            return own, str(exc)
        return own, "served"

    status, result = as_ids(65534, 65534, [], as_service_account)
    assert status == "ok", result
    own, grouped = result  # type: ignore[misc]
    assert own == 65534 and "cannot tell who sent this request" in grouped
