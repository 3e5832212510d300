"""Which file a path names, and opening that very file: ``FileIdentity`` (realpath, device,
inode, size, mtime, ctime), taken by ``stat`` or from the descriptor opened, and h5py opens
checked against it, so a file replaced at its path is seen rather than read.

HDF5 opens by path and follows external links by path, so "the file that was checked" is
pinned by device and inode: ``open_h5_verified`` opens the path once ``O_NONBLOCK`` first (a
FIFO or device swapped in is refused without blocking, in the common case), then checks
``fstat`` of HDF5's own descriptor (its vfd handle); ``check_holder`` does the same for the
file an external link led HDF5 to (the file holding a dataset).

Raised errors are h5serve's (SourceNotFound, SourceChanged; DataError for a file HDF5 finds
truncated or damaged: ``unreadable``), never h5py's or the OS's.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass

import h5py

from ..errors import AccessDenied, DataError, H5ServeError, SourceChanged, SourceNotFound
from .compound import FieldRows, rows_dataset
from .filters import check_storage
from .remote import RemoteIdentity, is_url, open_remote, shown_url

__all__ = [
    "FileIdentity",
    "file_identity",
    "open_identified",
    "open_h5",
    "open_remote_h5",
    "open_h5_verified",
    "identities_unchanged",
    "holder_identity",
    "check_holder",
    "pinned_rows",
    "unreadable",
]

# what HDF5 says of a file whose metadata it found damaged (not missing, not another format)
_DAMAGED = ("bad superblock", "bad object header", "wrong b-tree signature", "bad b-tree", "checksum", "corrupt",
            "bad local heap", "bad global heap", "bad heap", "incorrect metadata")
_TRUNCATED_SIZES = re.compile(r"eof = (\d+).*stored_eof = (\d+)")


def unreadable(path: str, exc: OSError) -> DataError | SourceNotFound:
    """What h5py's failure ``exc`` to open ``path`` means for the user: a file cut short
    (HDF5's "truncated file": a copy or write that stopped early) or damaged metadata is a
    DataError saying so and what to do (no reader can serve it: no lazy fallback); anything
    else (missing, unreadable, not HDF5) a SourceNotFound."""
    text = str(exc)
    if "truncated file" in text:
        sizes = _TRUNCATED_SIZES.search(text)
        held = (f": it holds {int(sizes[1]):,} bytes of the {int(sizes[2]):,} its superblock records" if sizes
                else "")
        return DataError(f"HDF5 file {path!r} is truncated{held}, so it was copied or written incompletely (a transfer "
                         f"cut short, a full disk, a writer that died); copy or write it again ({text})")
    if any(mark in text.lower() for mark in _DAMAGED):
        return DataError(f"HDF5 file {path!r} is damaged: HDF5 cannot read its metadata ({text}); restore it from a "
                         "good copy or write it again (h5dump shows how far it can be read)")
    return SourceNotFound(f"{path!r} cannot be opened as an HDF5 file: {text}")


@dataclass(frozen=True)
class FileIdentity:
    """(realpath, st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns): changes whenever the file does.

    ``ctime_ns`` is part of equality (every cache keyed by an identity misses once the file
    changed): its owner can set mtime back with ``utime`` after rewriting the file in place,
    but not ctime. ``as_tuple`` (what a segment's metadata records) leaves it out.
    """

    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    def as_tuple(self) -> tuple[str, int, int, int, int]:
        return (self.path, self.dev, self.ino, self.size, self.mtime_ns)

    @classmethod
    def of(cls, path: str, st: os.stat_result) -> FileIdentity:
        """The identity of the file ``st`` describes, found at ``path``."""
        return cls(path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def file_identity(path: str | os.PathLike[str]) -> FileIdentity:
    """Raised when the file does not exist or is not a regular file: SourceNotFound."""
    try:
        # realpath too can fail (EINVAL) when a symlink on the way is swapped for a file meanwhile
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError as exc:
        raise SourceNotFound(
            f"HDF5 file {os.fspath(path)!r} cannot be read: {exc.strerror}; check the path "
            f"(relative paths are resolved from {os.getcwd()})"
        ) from exc
    if not os.path.isfile(real):
        raise SourceNotFound(f"{os.fspath(path)!r} is not a regular file; pass the path of an HDF5 file")
    return FileIdentity.of(real, st)


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
    return fd, FileIdentity.of(real, st)


def _replaced(path: str) -> SourceChanged:
    return SourceChanged(f"{path} was replaced while it was being opened; request it again")


_SWAPPED_ERRNOS = (errno.EACCES, errno.EPERM, errno.ENOENT, errno.ELOOP, errno.ENXIO, errno.ENOTDIR)


def _still(path: str, dev: int, ino: int) -> bool:
    """Whether ``path`` names (without following a final symlink) the file ``dev``/``ino``."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def _without_file_locking() -> dict[str, object]:
    """h5py's option for an open without HDF5's file lock: ``locking=False`` on HDF5 >= 1.12.1
    or 1.10.7, {} on older ones, which have no such option (there HDF5_USE_FILE_LOCKING=FALSE,
    which the daemon sets for its loaders, daemon/_process.py, is the only switch).

    Why: HDF5 takes a shared ``flock`` on every file it opens and fails at once ("unable to
    lock file, errno = 11") while another process holds an exclusive one, which anyone who can
    open the file for reading can take: one member would fail every load of another's file.
    The daemon only reads, and checks each file's identity after every load."""
    version = h5py.version.hdf5_version_tuple
    return {"locking": False} if version >= (1, 12, 1) or (1, 10, 7) <= version < (1, 11) else {}


def open_h5_verified(ident: FileIdentity | tuple, **kwargs: object) -> h5py.File:
    """Open the file ``ident`` describes (a FileIdentity or its ``as_tuple()``) with h5py, and
    check that HDF5 opened that very file (same device and inode), not whatever was swapped
    in at its path since it was identified. The path is first opened ``O_NONBLOCK`` and
    checked (a regular file, same device and inode) before HDF5 opens it, so a FIFO or device
    swapped in is refused without blocking unless it is swapped in again in the moment
    between the two opens (then HDF5's open blocks: run this where a deadline applies).

    Raised when it cannot be opened: SourceNotFound (truncated or damaged: DataError). Raised
    when it is no longer that file, or HDF5 opened another file: SourceChanged.
    """
    path, dev, ino = (ident.path, ident.dev, ident.ino) if isinstance(ident, FileIdentity) else tuple(ident[:3])
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink now stands where the checked file was
            raise _replaced(path) from exc
        raise SourceNotFound(f"HDF5 file {path!r} cannot be read: {exc.strerror}; check the path") from exc
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (dev, ino):
        raise _replaced(path)
    try:
        f = h5py.File(path, "r", **{**_without_file_locking(), **kwargs})
    except OSError as exc:
        # it was readable a moment ago: HDF5 refused, found no file or another one (HDF5's own
        # "st_ino or st_dev fields changed"), so it was swapped between the two opens
        if exc.errno in _SWAPPED_ERRNOS or "fields changed" in str(exc) or not _still(path, dev, ino):
            raise _replaced(path) from exc
        raise unreadable(path, exc) from exc
    try:
        if f.driver != "sec2":  # only sec2 has a descriptor to check: never open another driver here
            raise SourceNotFound(f"{path!r}: HDF5 driver {f.driver!r} cannot be checked; open it with the default one")
        st = os.fstat(f.id.get_vfd_handle())
        if (st.st_dev, st.st_ino) != (dev, ino):
            raise _replaced(path)
    except BaseException:
        f.close()
        raise
    return f


def holder_identity(obj: h5py.HLObject) -> FileIdentity:
    """The identity of the file HDF5 opened that holds ``obj`` (an external link's target for a
    dataset reached through one), from ``fstat`` of HDF5's own descriptor; its real path from
    ``/proc/self/fd``, or, in a process that may not read that (one that changed its uid and
    stays undumpable), the real path of the name HDF5 opened, which must lead to that very file.

    Raised when that name now leads elsewhere (swapped since HDF5 opened it): SourceChanged.
    """
    fd = obj.file.id.get_vfd_handle()
    st = os.fstat(fd)
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        real = _named_path(obj.file.filename, st)
    return FileIdentity.of(real, st)


def _named_path(name: str, st: os.stat_result) -> str:
    """The real path of ``name``, checked to lead to the file ``st`` describes.

    Raised when it leads elsewhere or nowhere (swapped since it was opened): SourceChanged.
    """
    real = os.path.realpath(name)
    try:
        now = os.stat(real)
    except OSError as exc:
        raise _replaced(name) from exc
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        raise _replaced(name)
    return real


def check_holder(obj: h5py.HLObject, expected: Iterable[tuple], what: str) -> None:
    """Check that the file holding ``obj`` (the file HDF5 opened, through its descriptor) is one
    of ``expected`` (identities as ``as_tuple()``: path, dev, ino, ...), i.e. a file that was
    checked, not one swapped in at an external link's target path since.

    Raised otherwise: SourceChanged naming ``what``.
    """
    if obj.file.driver != "sec2":
        raise SourceChanged(f"{what}: the file holding its rows cannot be checked; request it again")
    st = os.fstat(obj.file.id.get_vfd_handle())
    if (st.st_dev, st.st_ino) not in {(int(e[1]), int(e[2])) for e in expected}:
        raise SourceChanged(f"{what}: the file holding its rows ({obj.file.filename}) is not the one that was "
                            "checked (replaced since); request it again")


def pinned_rows(f: h5py.File, key: str, expected: Iterable[tuple], what: str, *,
                virtual_ok: bool) -> h5py.Dataset | FieldRows:
    """The dataset (or compound field) whose rows ``key`` names in ``f``, checked to be held by
    one of the files ``expected`` (``check_holder``) and laid out so that reading it reads
    that file alone: no raw external storage, and no virtual dataset unless ``virtual_ok``
    (both make HDF5 open other files by name when rows are read). The layout is checked on
    the dataset as opened here, never taken from an earlier inspection: the file's owner may
    have rewritten it in place since. The key was inspected when it was checked, so a failure
    to open it now means a file on its way changed since.

    Raised when it is now a virtual dataset and not ``virtual_ok``: AccessDenied.
    Raised when its rows are in raw external files: UnsupportedDataset.
    Raised otherwise: SourceChanged.
    """
    try:
        dset = rows_dataset(f, key)
    except (KeyError, ValueError, OSError) as exc:
        if isinstance(exc, (SourceChanged, SourceNotFound)):
            raise
        raise SourceChanged(f"{what} cannot be opened any more ({exc}): a file on its way changed since it was "
                            "checked; request it again") from exc
    check_holder(dset, expected, what)
    if dset.is_virtual and not virtual_ok:
        raise AccessDenied(
            f"{what} is now a virtual dataset (it was not when it was checked): HDF5 would open its source files "
            "by name, which the daemon loads only for its own user and root; read it lazily (fallback='lazy')")
    check_storage(dset, key)
    return dset


def identities_unchanged(identities: Iterable[tuple]) -> bool:
    """True when every file still has the identity ``(path, dev, ino, size, mtime_ns)`` recorded.
    An object of a store (a URL) is not asked here: its segment's name holds its ETag, every
    request looks it up again, and every range its load fetched was pinned to that ETag."""
    try:
        return all(is_url(ident[0]) or file_identity(ident[0]).as_tuple() == tuple(ident[:5])
                   for ident in identities)
    except SourceNotFound:
        return False


def open_remote_h5(url: str, pin: RemoteIdentity | None = None, *, block_bytes: int | None = None,
                   cache_blocks: int | None = None, **kwargs: object) -> tuple[h5py.File, RemoteIdentity]:
    """The remote file ``url`` (hdf5/remote.py) opened read-only by h5py through a file object,
    and its identity; ``pin``: the identity it must still have; ``block_bytes``, ``cache_blocks``:
    its block cache (None: hdf5/remote.py's defaults).

    Raised when it is no longer ``pin``: SourceChanged. Raised when missing: ObjectNotFound;
    refused: ObjectAccessDenied; the store fails: ObjectStoreError; not HDF5: SourceNotFound;
    truncated or damaged: DataError (``unreadable``)."""
    fileobj = open_remote(url, pin, block_bytes=block_bytes, cache_blocks=cache_blocks)
    try:
        f = h5py.File(fileobj, "r", **kwargs)
    except H5ServeError:  # h5py passes on what the file object raised
        fileobj.close()
        raise
    except OSError as exc:
        fileobj.close()
        raise unreadable(shown_url(url), exc) from exc
    return f, fileobj.identity


def open_h5(path: str | os.PathLike[str], **kwargs: object) -> h5py.File:
    """Open read-only (a URL: ``open_remote_h5``, unpinned). Raised when missing or not HDF5:
    SourceNotFound; truncated or damaged: DataError (``unreadable``)."""
    if is_url(path):
        return open_remote_h5(str(path), None, **kwargs)[0]  # type: ignore[arg-type]  # h5py's options only
    file_identity(path)
    try:
        return h5py.File(path, "r", **kwargs)
    except OSError as exc:
        raise unreadable(os.fspath(path), exc) from exc
