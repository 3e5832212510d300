"""A member's file rewritten in place never gets another user's rows loaded (security round
three, finding 1).

The attack: a member of a root daemon's ``--group`` has a plain dataset loaded, then rewrites
the same inode in place with a virtual dataset over a root-only file, padded to the same size,
with its old mtime restored, and asks again. The daemon must decide from the file it opens,
never from what the path was: the resolution misses (ctime is part of a file's identity, and
no verdict is shared between users) and the loader checks the layout on the descriptor it
reads from. Real throwaway users, a real root daemon, real /dev/shm; root only.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5serve.daemon.loading.loader import LoadError, LoadJob, LoadOk, run_load
from h5serve.errors import AccessDenied, H5ServeError, UnsupportedDataset
from h5serve.hdf5.identity import pinned_rows
from h5serve.segments import SegmentMeta
from h5serve.segments.naming import segment_prefix, temporary_name
from h5serve.wire.connection import DaemonClient
from h5serve.wire.protocol import Acquire
from h5serve.wire.runtime import resolve_runtime

from ..helpers import Daemon, segments_holding, wait_for
from ..users import User, as_user, root_only, throwaway_group, throwaway_user

pytestmark = [pytest.mark.timeout(240)]

ROWS = 4096


def _secret(vault: Path) -> tuple[Path, bytes]:
    """A root-only file (0600 in a 0700 dir) whose ``y`` rows are one random int64 repeated;
    its marker (four rows' bytes) to look for in segments."""
    value = np.frombuffer(secrets.token_bytes(8), dtype=np.int64)[0]
    secret = vault / "secret.h5"
    with h5py.File(secret, "w") as f:
        f.create_dataset("y", data=np.full(ROWS, value, dtype=np.int64))
    secret.chmod(0o600)
    return secret, np.full(4, value, dtype=np.int64).tobytes()


def _plain(path: Path) -> None:
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(ROWS, dtype=np.int64))


def _rewrite_as_virtual(path: Path, secret: Path) -> None:
    """Rewrite ``path``'s inode in place with a virtual dataset ``x`` over ``secret``'s ``y``,
    padded to the same size, its mtime set back: only its ctime tells."""
    st = os.stat(path)
    layout = h5py.VirtualLayout(shape=(ROWS,), dtype="int64")
    layout[:] = h5py.VirtualSource(str(secret), "y", shape=(ROWS,))
    scratch = path.with_name("scratch.h5")
    with h5py.File(scratch, "w") as f:
        f.create_virtual_dataset("x", layout)
    blob = scratch.read_bytes()
    scratch.unlink()
    assert len(blob) <= st.st_size
    with open(path, "r+b") as out:
        out.write(blob + bytes(st.st_size - len(blob)))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    now = os.stat(path)
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)


def _acquire(runtime_dir: Path, path: Path, world: int) -> str:
    """As the calling user: "served", or the error's class and message."""
    try:
        with DaemonClient(runtime_dir, timeout=10) as client:
            client.acquire(Acquire(str(path), "x", world, 0), deadline=time.monotonic() + 60)
        return "served"
    except H5ServeError as exc:
        return f"{type(exc).__name__}: {exc}"


def _setup(public_dir: Path, member: User) -> tuple[Path, Path, bytes]:
    allowed, vault, mine = public_dir / "allowed", public_dir / "vault", public_dir / "allowed" / "mine"
    allowed.mkdir(mode=0o755)
    vault.mkdir(mode=0o700)
    mine.mkdir(mode=0o755)
    os.chown(mine, member.uid, member.gid)
    secret, marker = _secret(vault)
    return allowed, secret, marker


@root_only
def test_a_file_rewritten_in_place_as_a_virtual_dataset_is_inspected_again(public_dir: Path) -> None:
    """The rewrite between two requests: the second resolution misses every cache (new ctime)
    and the member's own inspection finds the virtual dataset: refused, no segment holds
    root's rows."""
    with throwaway_group() as group, throwaway_user((group,)) as member:
        allowed, secret, marker = _setup(public_dir, member)
        mine = allowed / "mine"
        d = Daemon("--group", group.name, "--allow-root", str(allowed))
        d.dir.chmod(0o755)
        try:
            d.start()
            prefix = segment_prefix(resolve_runtime(d.runtime_dir).namespace)

            def attack() -> tuple[str, str]:
                f = mine / "f.h5"
                _plain(f)
                first = _acquire(d.runtime_dir, f, 1)
                _rewrite_as_virtual(f, secret)
                return first, _acquire(d.runtime_dir, f, 2)

            status, out = as_user(member, attack, timeout=120)
            assert status == "ok", out
            first, second = out
            assert first == "served"
            assert second.startswith("AccessDenied") and "virtual dataset" in second, second
            assert wait_for(lambda: all(s["state"] != "loading" for s in d.status()["segments"]), 30)
            assert segments_holding(prefix, marker) == []
        finally:
            d.stop()


def _job(path: Path, shm_dir: Path, virtual_ok: bool) -> LoadJob:
    """The daemon's job for the whole of ``path``'s ``x`` as resolved now (its identity)."""
    st = os.stat(path)
    meta = SegmentMeta(str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, "x", "contiguous", 1, 0,
                       ROWS, ROWS, (), "<i8", "<i8")
    return LoadJob(shm_dir, temporary_name("h5s-test"), f"h5s-test-{secrets.token_hex(8)}", meta,
                   virtual_ok=virtual_ok)


def _run_loader(job: LoadJob) -> object:
    """Run the daemon's loader (``run_load``) in a forked process, as the daemon starts one; its reply."""
    ctx = multiprocessing.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=run_load, args=(job, sender), daemon=True)
    process.start()
    sender.close()
    try:
        assert receiver.poll(60), "the loader never answered"
        return receiver.recv()
    finally:
        process.kill()
        process.join(10)


def test_a_file_rewritten_after_its_check_is_refused_by_the_loader(tmp_path: Path) -> None:
    """The rewrite after the check, before the load (same inode, size and mtime: the identity
    the daemon resolved still matches): a load for anyone but the daemon's user and root
    (``virtual_ok`` False) finds the virtual dataset in the file it opened and refuses it,
    leaving nothing in shm; the daemon's own load of the same file reads it."""
    vault = tmp_path / "vault"
    vault.mkdir(mode=0o700)
    secret, marker = _secret(vault)
    shm = Path(tempfile.mkdtemp(prefix="h5s-load-", dir="/dev/shm"))
    try:
        f = tmp_path / "f.h5"
        _plain(f)
        member_job, own_job = _job(f, shm, virtual_ok=False), _job(f, shm, virtual_ok=True)
        _rewrite_as_virtual(f, secret)
        refused = _run_loader(member_job)
        assert isinstance(refused, LoadError) and refused.code == "access_denied", refused
        assert "virtual dataset" in refused.message
        assert [p for p in shm.iterdir() if marker in p.read_bytes()] == []
        served = _run_loader(own_job)
        assert isinstance(served, LoadOk), served
        assert marker in (shm / served.name).read_bytes()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_the_loaders_layout_check_refuses_virtual_and_external_storage(tmp_path: Path) -> None:
    """``pinned_rows`` (every load path's way to its rows) checks the layout of the dataset it
    opened: a virtual dataset only with ``virtual_ok``, raw external storage never."""
    source = tmp_path / "source.h5"
    with h5py.File(source, "w") as f:
        f.create_dataset("y", data=np.arange(10, dtype=np.int64))
    path = tmp_path / "kinds.h5"
    layout = h5py.VirtualLayout(shape=(10,), dtype="int64")
    layout[:] = h5py.VirtualSource(str(source), "y", shape=(10,))
    raw = tmp_path / "raw.bin"
    raw.write_bytes(bytes(80))
    with h5py.File(path, "w") as f:
        f.create_virtual_dataset("v", layout)
        f.create_dataset("e", shape=(10,), dtype="int64", external=[(str(raw), 0, 80)])
        f.create_dataset("x", data=np.arange(10, dtype=np.int64))
    st = os.stat(path)
    expected = [(str(path), st.st_dev, st.st_ino)]
    with h5py.File(path, "r") as f:
        assert pinned_rows(f, "x", expected, "x", virtual_ok=False).shape == (10,)
        assert pinned_rows(f, "v", expected, "v", virtual_ok=True).is_virtual
        with pytest.raises(AccessDenied, match="virtual dataset"):
            pinned_rows(f, "v", expected, "v", virtual_ok=False)
        with pytest.raises(UnsupportedDataset, match="external raw files"):
            pinned_rows(f, "e", expected, "e", virtual_ok=True)
