"""Which file a path names, and opening that very file: ``FileIdentity`` (realpath, device,
inode, size, mtime), taken by ``stat`` or from the descriptor opened, and h5py opens checked
against it, so a file replaced at its path is seen rather than read.

Raised errors are h5serve's (SourceNotFound, SourceChanged), never h5py's or the OS's.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass

import h5py

from ..errors import SourceChanged, SourceNotFound

__all__ = [
    "FileIdentity",
    "file_identity",
    "open_identified",
    "open_h5",
    "open_h5_verified",
    "identities_unchanged",
]


@dataclass(frozen=True)
class FileIdentity:
    """(realpath, st_dev, st_ino, st_size, st_mtime_ns): changes whenever the file does."""

    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int

    def as_tuple(self) -> tuple[str, int, int, int, int]:
        return (self.path, self.dev, self.ino, self.size, self.mtime_ns)


def file_identity(path: str | os.PathLike[str]) -> FileIdentity:
    """Raised when the file does not exist or is not a regular file: SourceNotFound."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError as exc:
        raise SourceNotFound(
            f"HDF5 file {os.fspath(path)!r} cannot be read: {exc.strerror}; check the path "
            f"(relative paths are resolved from {os.getcwd()})"
        ) from exc
    if not os.path.isfile(real):
        raise SourceNotFound(f"{os.fspath(path)!r} is not a regular file; pass the path of an HDF5 file")
    return FileIdentity(real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def open_identified(path: str | os.PathLike[str]) -> tuple[int, FileIdentity]:
    """Open ``path`` once (read-only, ``O_NONBLOCK``: a FIFO or device never blocks) and
    describe what was opened, not what the path names a moment later: its real path (from
    ``/proc/self/fd``), device, inode, size and mtime. The caller closes the descriptor.

    Raised when it cannot be opened or is not a regular file: SourceNotFound.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise SourceNotFound(
            f"HDF5 file {os.fspath(path)!r} cannot be read: {exc.strerror}; check the path and its permissions"
        ) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SourceNotFound(f"{os.fspath(path)!r} is not a regular file; pass the path of an HDF5 file")
        real = os.readlink(f"/proc/self/fd/{fd}")
    except BaseException:
        os.close(fd)
        raise
    return fd, FileIdentity(real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def open_h5_verified(ident: FileIdentity, **kwargs: object) -> h5py.File:
    """Open the file ``ident`` describes with h5py, and check that HDF5 opened that very file
    (same device and inode), not whatever was swapped in at its path since it was identified.

    Raised when it cannot be opened: SourceNotFound. Raised when HDF5 opened another file:
    SourceChanged.
    """
    try:  # (not open_h5: the identity was just taken, no need to stat the path again)
        f = h5py.File(ident.path, "r", **kwargs)
    except OSError as exc:
        raise SourceNotFound(f"{ident.path!r} cannot be opened as an HDF5 file: {exc}") from exc
    try:
        if f.driver == "sec2":
            st = os.fstat(f.id.get_vfd_handle())
            if (st.st_dev, st.st_ino) != (ident.dev, ident.ino):
                raise SourceChanged(f"{ident.path} was replaced while it was being opened; request it again")
    except BaseException:
        f.close()
        raise
    return f


def identities_unchanged(identities: Iterable[tuple]) -> bool:
    """True when every file still has the identity ``(path, dev, ino, size, mtime_ns)`` recorded."""
    try:
        return all(file_identity(ident[0]).as_tuple() == tuple(ident[:5]) for ident in identities)
    except SourceNotFound:
        return False


def open_h5(path: str | os.PathLike[str], **kwargs: object) -> h5py.File:
    """Open read-only. Raised when missing or not HDF5: SourceNotFound."""
    file_identity(path)
    try:
        return h5py.File(path, "r", **kwargs)
    except OSError as exc:
        raise SourceNotFound(f"{os.fspath(path)!r} cannot be opened as an HDF5 file: {exc}") from exc
