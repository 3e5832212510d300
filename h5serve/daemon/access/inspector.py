"""Reading a request's HDF5 metadata in a child process with a deadline, never in the daemon.

h5py holds the GIL while HDF5's ``open()`` blocks (a FIFO at an external link's target, or
raced in at the path; a hung file system), which would stop the daemon's control loop and
answer nobody. So the daemon's process never runs HDF5: each inspection runs in a process
started from the loaders' forkserver (loader.loader_context: h5py already imported, ~2-5 ms
to start), and the resolver thread that asked waits on a pipe (which releases the GIL). A
child that does not answer within ``INSPECT_TIMEOUT_S`` is killed and the request fails with
a SourceNotFound saying so.

The child opens the file through ``open_h5_verified`` (the very file the resolver checked:
device and inode, an ``O_NONBLOCK`` pre-open first), inspects the key, and reports the
identity of the file an external link led HDF5 to, from ``fstat`` of HDF5's own descriptor
(so the resolver checks, and the loader pins, the file HDF5 really opened).

In a root daemon the child first takes the requesting user's uid, gid and supplementary
groups: HDF5 then follows external links (and looks for virtual sources) with the user's
own rights, so a file the user cannot read is never opened for them, and its contents
(which datasets exist) never shape the answer. A daemon of another user (a service account)
cannot switch; its child runs as the daemon's user (what remains is in docs/security.md).

The child is no channel into the daemon (a process of the user's own uid is the user's):
before it switches it keeps one descriptor, its answer pipe (standard streams on /dev/null:
never the daemon's log; not the resource tracker's pipe nor the forkserver's), and it stays
undumpable, so no process of the user can trace it or take its descriptors. What it writes
is decoded as untrusted data with a schema (inspection.py), never unpickled, read with a
size bound and a deadline.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import h5py

from ...errors import AccessDenied, SourceChanged, SourceNotFound, error_from_code
from ...hdf5.compound import FieldRows, rows_dataset
from ...hdf5.identity import FileIdentity, holder_identity, open_h5_verified, open_remote_h5, pinned_rows
from ...hdf5.remote import METADATA_BLOCK_BYTES, METADATA_CACHE_BLOCKS, RemoteIdentity, shown_url
from ...hdf5.source import inspect_dataset
from .._process import drop_forkserver_alive_fd, set_pdeathsig, set_process_name
from ..loading.loader import loader_context
from ..loading.parts import error_of
from .inspection import (
    MAX_ANSWER_BYTES,
    Answer,
    Inspection,
    InspectionFailed,
    VirtualFound,
    decode_answer,
    encode_answer,
)

__all__ = ["Credentials", "inspect_file", "virtual_refused", "INSPECT_TIMEOUT_S", "INSPECTOR_NAME"]

INSPECT_TIMEOUT_S = 10.0  # an inspection not answered by then is killed and its request fails
INSPECTOR_NAME = "h5serve-inspect"
_PR_GET_DUMPABLE = 3
_REAP_S = 1.0
_ANSWER_FD = 3  # the one descriptor an inspector keeps besides /dev/null on 0-2


@dataclass(frozen=True)
class Credentials:
    """Whom an inspection runs as (a root daemon: the requesting user)."""

    uid: int
    gid: int
    groups: tuple[int, ...]


def virtual_refused(path: str, key: str, daemon_uid: int) -> AccessDenied:
    """The refusal of a virtual dataset to a requester other than the daemon's user and root."""
    return AccessDenied(
        f"{path}[{key}] is a virtual dataset: HDF5 opens its source files by name whenever rows are read, "
        "so the daemon cannot make sure the files read are the ones checked, and loads virtual datasets "
        f"only for its own user (uid {daemon_uid}) and root. Ask the daemon's owner to load it, or read it "
        "lazily (fallback='lazy' reads it with your own rights)")


def _keep_only_answer(answer_fd: int) -> int:
    """Leave this process holding nothing of the daemon's but ``answer_fd`` (moved to
    _ANSWER_FD, returned): /dev/null on 0-2 (the forkserver's are the daemon's log), every
    other descriptor closed (the forkserver's alive pipe, the resource tracker's pipe: a
    writer to it could have root unlink shm names), their Python holders forgotten."""
    from multiprocessing import resource_tracker

    drop_forkserver_alive_fd()
    tracker = getattr(resource_tracker, "_resource_tracker", None)
    if tracker is not None:
        tracker._fd = None  # closed below with everything else; never written to again
    os.dup2(answer_fd, _ANSWER_FD, inheritable=False)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(_ANSWER_FD + 1, os.sysconf("SC_OPEN_MAX"))
    return _ANSWER_FD


def _become(creds: Credentials) -> None:
    """Take the requester's groups, gid and uid for good. The kernel makes the process
    undumpable on this change (fs.suid_dumpable 0, the default); it must stay so: a dumpable
    process of the user's uid is the user's to ptrace, and this one is read by root.

    Raised when it would be dumpable after all (fs.suid_dumpable 1): AccessDenied.
    """
    os.setgroups(list(creds.groups))
    os.setresgid(creds.gid, creds.gid, creds.gid)
    os.setresuid(creds.uid, creds.uid, creds.uid)
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise AccessDenied("the inspector would be traceable by the requesting user (fs.suid_dumpable is not 0); "
                           "set sysctl fs.suid_dumpable=0 on this node")


def _rows(f: h5py.File, key: str, ident: FileIdentity) -> h5py.Dataset | FieldRows:
    """The dataset of ``key``, reached through an external link (its holder is reported)."""
    try:
        return rows_dataset(f, key)
    except (KeyError, ValueError, OSError) as exc:
        raise SourceChanged(f"{ident.path}[{key}]: a file on the key's way changed while it was inspected; "
                            "request it again") from exc


class _VirtualFound(Exception):
    pass


def _is_virtual(f: h5py.File, key: str) -> bool:
    try:
        return bool(rows_dataset(f, key).is_virtual)
    except Exception:  # noqa: BLE001 - not found, not a dataset: inspect_dataset says what is wrong
        return False


def _inspect_remote(remote: RemoteIdentity, key: str) -> Inspection:
    """An s3:// object's dataset, read through a small block cache (HDF5's metadata only), the
    object pinned to ``remote``; the rows must be in the object itself (no external link,
    virtual dataset or external storage: HDF5 would open local files they name)."""
    f, _ = open_remote_h5(remote.url, remote, block_bytes=METADATA_BLOCK_BYTES, cache_blocks=METADATA_CACHE_BLOCKS)
    with f:
        dset = rows_dataset(f, key)
        base = dset.dset if isinstance(dset, FieldRows) else dset
        if base.file.id.fileno != f.id.fileno or base.is_virtual or base.id.get_create_plist().get_external_count():
            raise AccessDenied(f"{shown_url(remote.url)}[{key}] is an external link, a virtual dataset or external "
                               "storage: the daemon fetches only rows stored in the object itself; read it lazily")
        return Inspection(inspect_dataset(f, key, vlen=True), None, False)


def _inspect(ident: FileIdentity, key: str, virtual_ok: bool, remote: RemoteIdentity | None = None) -> Answer:
    """The inspection itself (as whoever this process now is)."""
    if remote is not None:
        try:
            return _inspect_remote(remote, key)
        except BaseException as exc:  # noqa: BLE001 - every failure is reported, the daemon raises it
            return InspectionFailed(*error_of(exc))
    try:
        with open_h5_verified(ident) as f:
            if not virtual_ok and _is_virtual(f, key):  # refused before HDF5 looks for its sources
                raise _VirtualFound()
            info = inspect_dataset(f, key, vlen=True)
            dset = pinned_rows(f, key, [(ident.path, ident.dev, ident.ino)], f"{ident.path}[{key}]",
                               virtual_ok=virtual_ok) if not info.linked_file else _rows(f, key, ident)
            linked = holder_identity(dset) if info.linked_file else None
            return Inspection(info, linked, bool(dset.is_virtual))
    except _VirtualFound:
        return VirtualFound()
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, the daemon raises it
        return InspectionFailed(*error_of(exc))


def _child(sender: Connection, ident: FileIdentity, key: str, creds: Credentials | None, virtual_ok: bool,
           remote: RemoteIdentity | None = None) -> None:
    """The inspection, in the child: one answer (inspection.py) written to ``sender``'s
    descriptor, then ``os._exit`` (no cleanup of what the forkserver handed down)."""
    set_pdeathsig()
    set_process_name(INSPECTOR_NAME)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = _keep_only_answer(sender.fileno())
    try:
        if creds is not None:
            _become(creds)
        blob = encode_answer(_inspect(ident, key, virtual_ok, remote))
    except BaseException as exc:  # noqa: BLE001 - _become failed: reported like any failure
        blob = encode_answer(InspectionFailed(*error_of(exc)))
    try:
        view = memoryview(blob)
        while view:
            view = view[os.write(out, view):]
    finally:
        os._exit(0)


def _read_answer(fd: int, deadline: float) -> bytes | None:
    """Everything the child writes until it closes its end, at most MAX_ANSWER_BYTES and until
    ``deadline`` (None: not answered in time). Raised when it writes more: SourceChanged."""
    chunks: list[bytes] = []
    size = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise SourceChanged(f"the process that read a file's metadata wrote more than {MAX_ANSWER_BYTES} bytes; "
                                "the request is refused")
        chunks.append(chunk)


def inspect_file(ident: FileIdentity, key: str, creds: Credentials | None, virtual_ok: bool = True,
                 timeout: float = INSPECT_TIMEOUT_S, remote: RemoteIdentity | None = None) -> Inspection:
    """Inspect ``key`` in the file ``ident`` describes (opened and checked by the resolver) in a
    child process, as ``creds`` (None: as the daemon). ``virtual_ok`` False: a virtual dataset
    is refused (``virtual_refused``) before HDF5 looks for its sources. Blocks the calling
    thread (a resolver thread), never holding the GIL while it waits.

    Raised when the child does not answer within ``timeout`` (it is killed): SourceNotFound.
    Raised when its answer is not one of the schema: SourceChanged.
    Raised when the inspection fails: its error (KeyNotFound, UnsupportedDataset, SourceChanged, ...).
    ``remote``: ``ident`` is an s3:// object (its URL), read as the daemon's user with its credentials
    (``creds`` None), pinned to this identity.
    """
    ctx = loader_context()
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child, args=(sender, ident, key, creds, virtual_ok, remote), name=INSPECTOR_NAME,
                          daemon=True)
    try:
        process.start()
    except OSError as exc:
        receiver.close()
        sender.close()
        raise SourceNotFound(f"could not start a process to open {ident.path} ({exc.strerror}); ask again") from exc
    sender.close()
    try:
        blob = _read_answer(receiver.fileno(), time.monotonic() + timeout)
    except OSError as exc:
        raise SourceNotFound(f"the process opening {ident.path}[{key}] died; see the daemon log") from exc
    finally:
        receiver.close()
        _finish(process)
    if blob is None:
        raise SourceNotFound(
            f"{ident.path}[{key}] did not open within {timeout:g}s (HDF5 blocked opening it or a file an "
            "external link leads to: a FIFO, a device or a hung file system); check the file and its links")
    if not blob:
        raise SourceNotFound(f"the process opening {ident.path}[{key}] died without an answer; see the daemon log")
    outcome = decode_answer(blob, key)
    if isinstance(outcome, InspectionFailed):
        raise error_from_code(outcome.code, outcome.message)
    if isinstance(outcome, VirtualFound):
        raise virtual_refused(ident.path, key, os.geteuid())
    return outcome


def _finish(process: object) -> None:
    """Kill the child if it still runs and reap it (bounded: a child stuck in an uninterruptible
    open is left to the forkserver's reaping)."""
    from multiprocessing.process import BaseProcess

    assert isinstance(process, BaseProcess)
    if process.is_alive():
        process.kill()
    process.join(_REAP_S)
    if process.exitcode is not None:
        process.close()
