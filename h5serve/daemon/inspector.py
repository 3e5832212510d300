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
"""

from __future__ import annotations

import ctypes
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection

import h5py

from ..errors import AccessDenied, SourceChanged, SourceNotFound, error_from_code
from ..hdf5.compound import FieldRows, rows_dataset
from ..hdf5.identity import FileIdentity, holder_identity, open_h5_verified, pinned_rows
from ..hdf5.source import DatasetInfo, inspect_dataset
from ._process import set_process_name
from .loader import die_with_daemon, loader_context
from .parts import error_of

__all__ = ["Credentials", "Inspection", "inspect_file", "virtual_refused", "INSPECT_TIMEOUT_S", "INSPECTOR_NAME"]

INSPECT_TIMEOUT_S = 10.0  # an inspection not answered by then is killed and its request fails
INSPECTOR_NAME = "h5serve-inspect"
_PR_SET_DUMPABLE = 4
_REAP_S = 1.0


@dataclass(frozen=True)
class Credentials:
    """Whom an inspection runs as (a root daemon: the requesting user)."""

    uid: int
    gid: int
    groups: tuple[int, ...]


@dataclass(frozen=True)
class Inspection:
    """What the child found: the dataset's description, the identity of the file an
    external link led HDF5 to (None: the rows are in the file itself), and whether it is a
    virtual dataset (its sources are opened by name when read: they cannot be pinned)."""

    info: DatasetInfo
    linked: FileIdentity | None
    virtual: bool


@dataclass(frozen=True)
class _Failure:
    code: str
    message: str


@dataclass(frozen=True)
class _Virtual:
    """The key names a virtual dataset, and the requester may not have one loaded."""


def virtual_refused(path: str, key: str, daemon_uid: int) -> AccessDenied:
    """The refusal of a virtual dataset to a requester other than the daemon's user and root."""
    return AccessDenied(
        f"{path}[{key}] is a virtual dataset: HDF5 opens its source files by name whenever rows are read, "
        "so the daemon cannot make sure the files read are the ones checked, and loads virtual datasets "
        f"only for its own user (uid {daemon_uid}) and root. Ask the daemon's owner to load it, or read it "
        "lazily (fallback='lazy' reads it with your own rights)")


def _become(creds: Credentials) -> None:
    os.setgroups(list(creds.groups))
    os.setresgid(creds.gid, creds.gid, creds.gid)
    os.setresuid(creds.uid, creds.uid, creds.uid)
    # a uid change clears "dumpable", and /proc/self/fd (the real path of HDF5's descriptor)
    # turns unreadable to the process itself: set it again (the user owns this process now anyway)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)


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


def _child(sender: Connection, ident: FileIdentity, key: str, creds: Credentials | None, daemon_pid: int,
           virtual_ok: bool) -> None:
    """The inspection, in the child: reports one Inspection, _Virtual or _Failure on ``sender``."""
    die_with_daemon(daemon_pid)
    set_process_name(INSPECTOR_NAME)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if creds is not None:
            _become(creds)
        with open_h5_verified(ident) as f:
            if not virtual_ok and _is_virtual(f, key):  # refused before HDF5 looks for its sources
                raise _VirtualFound()
            info = inspect_dataset(f, key, vlen=True)
            dset = pinned_rows(f, key, [(ident.path, ident.dev, ident.ino)], f"{ident.path}[{key}]") \
                if not info.linked_file else _rows(f, key, ident)
            linked = holder_identity(dset) if info.linked_file else None
            outcome: Inspection | _Virtual | _Failure = Inspection(info, linked, bool(dset.is_virtual))
    except _VirtualFound:
        outcome = _Virtual()
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, the daemon raises it
        outcome = _Failure(*error_of(exc))
    try:
        sender.send(outcome)
    finally:
        sender.close()


def inspect_file(ident: FileIdentity, key: str, creds: Credentials | None, virtual_ok: bool = True,
                 timeout: float = INSPECT_TIMEOUT_S) -> Inspection:
    """Inspect ``key`` in the file ``ident`` describes (opened and checked by the resolver) in a
    child process, as ``creds`` (None: as the daemon). ``virtual_ok`` False: a virtual dataset
    is refused (``virtual_refused``) before HDF5 looks for its sources. Blocks the calling thread (a resolver
    thread), never holding the GIL while it waits.

    Raised when the child does not answer within ``timeout`` (it is killed): SourceNotFound.
    Raised when the inspection fails: its error (KeyNotFound, UnsupportedDataset, SourceChanged, ...).
    """
    ctx = loader_context()
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child, args=(sender, ident, key, creds, os.getpid(), virtual_ok), name=INSPECTOR_NAME,
                          daemon=True)
    try:
        process.start()
    except OSError as exc:
        receiver.close()
        sender.close()
        raise SourceNotFound(f"could not start a process to open {ident.path} ({exc.strerror}); ask again") from exc
    sender.close()
    try:
        answered = receiver.poll(timeout)
        outcome = receiver.recv() if answered else None
    except (EOFError, OSError) as exc:
        raise SourceNotFound(f"the process opening {ident.path}[{key}] died; see the daemon log") from exc
    finally:
        receiver.close()
        _finish(process)
    if not answered:
        raise SourceNotFound(
            f"{ident.path}[{key}] did not open within {timeout:g}s (HDF5 blocked opening it or a file an "
            "external link leads to: a FIFO, a device or a hung file system); check the file and its links")
    if isinstance(outcome, _Failure):
        raise error_from_code(outcome.code, outcome.message)
    if isinstance(outcome, _Virtual):
        raise virtual_refused(ident.path, key, os.geteuid())
    assert isinstance(outcome, Inspection)
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
