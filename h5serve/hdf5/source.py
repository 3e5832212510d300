"""HDF5 sources through h5py: identity, validation, dtypes (reading rows is in reads.py).

Shared by the daemon's loader, the lazy client backend and the in-memory compat backend, so
the three read the same rows the same way and cast with the same numpy rule (never HDF5's own
conversion, which can differ from numpy's for out-of-range values).

h5py errors are translated to h5serve errors here, in one place.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import h5py
import numpy as np

from ..errors import ConfigError, KeyNotFound, LengthMismatch, SourceChanged, SourceNotFound, UnsupportedDataset
from .compound import FieldRows, split_field
from .vlen import estimate_mean_length, is_text, vlen_kind

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

__all__ = [
    "FileIdentity",
    "DatasetInfo",
    "file_identity",
    "open_identified",
    "open_h5",
    "open_h5_verified",
    "inspect_dataset",
    "check_lengths",
    "check_row_counts",
    "check_cast",
    "identities_unchanged",
    "resolve_dtype",
    "storage_dtype",
    "HAVE_HDF5PLUGIN",
    "HDF5PLUGIN_FILTERS",
    "KNOWN_FILTERS",
]

SERVABLE_KINDS = "biufc"  # what a requested dtype may be
SOURCE_KINDS = SERVABLE_KINDS + "S"  # what a dataset may hold: also fixed-length byte strings
MAX_LINKS = 40  # soft and external links followed for one key before it is called a cycle


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


@dataclass(frozen=True)
class DatasetInfo:
    key: str
    rows: int
    row_shape: tuple[int, ...]
    dtype: np.dtype  # native byte order
    chunk_rows: int  # rows per chunk along axis 0 (the whole dataset if not chunked)
    linked_file: str = ""  # realpath of the file holding the data when reached by an external link
    chunked: bool = True  # False: contiguous or compact layout (any row range reads directly)
    field: str = ""  # a field of a compound dataset: ``key`` is "<dataset>:<field>" (compound.py)
    virtual_sources: tuple[str, ...] = ()  # realpaths of the other files a virtual dataset maps (vds.py)
    # variable-length rows (h5serve/hdf5/vlen.py): "" fixed rows, "seq" numeric sequences of ``dtype``,
    # else strings in that encoding (``dtype`` uint8: their bytes); row_shape is then ()
    vlen: str = ""
    mean_length: float = 0.0  # vlen: mean length of the first rows (an estimate, for budgets)

    @property
    def is_bytes(self) -> bool:
        """Fixed-length byte strings (served as lists of ``bytes``, not tensors)."""
        return self.dtype.kind == "S" and not self.vlen

    @property
    def is_text(self) -> bool:
        """Variable-length strings (served as lists of ``str``)."""
        return is_text(self.vlen)

# Registered ids of common third-party HDF5 filters, to name them when their plugin is missing.
KNOWN_FILTERS = {32001: "blosc", 32004: "lz4", 32008: "bitshuffle", 32015: "zstd", 32026: "blosc2", 307: "bzip2",
                 32013: "zfp", 32017: "sz", 32024: "sz3", 32018: "fcidecomp", 305: "lzo", 32002: "mafisc"}
# Filters the `filters` extra (hdf5plugin) provides: a missing one names the extra to install.
HDF5PLUGIN_FILTERS = frozenset({32001, 32004, 32008, 32015, 32026, 307, 32013, 32017, 32024, 32018})

from .vds import virtual_sources  # noqa: E402 - vds.py uses the errors above only

try:  # registers blosc, zstd, lz4, bitshuffle, ... with HDF5 for this process
    import hdf5plugin  # noqa: F401

    HAVE_HDF5PLUGIN = True
except ImportError:
    HAVE_HDF5PLUGIN = False


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


def sources_unchanged(source: tuple, linked: tuple = ()) -> bool:
    """True when the file (and the externally linked file, if any) still has the identity
    ``(path, dev, ino, size, mtime_ns)`` recorded when its rows were loaded."""
    try:
        if file_identity(source[0]).as_tuple() != tuple(source):
            return False
        return not linked or file_identity(linked[0]).as_tuple() == tuple(linked)
    except SourceNotFound:
        return False


def open_h5(path: str | os.PathLike[str], **kwargs: object) -> h5py.File:
    """Open read-only. Raised when missing or not HDF5: SourceNotFound."""
    file_identity(path)
    try:
        return h5py.File(path, "r", **kwargs)
    except OSError as exc:
        raise SourceNotFound(f"{os.fspath(path)!r} cannot be opened as an HDF5 file: {exc}") from exc


def _dataset_names(f: h5py.File, limit: int = 30) -> list[str]:
    names: list[str] = []

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5py.Dataset) and len(names) < limit:
            names.append(name)

    f.visititems(visit)
    return names


def resolve_dtype(dtype: DTypeLike | None, what: str) -> np.dtype | None:
    """A requested dtype as a servable numpy dtype (native order), or None.

    Raised when numpy cannot parse it, or it is an array, structured, non-numeric or
    extended-precision dtype: ConfigError.
    """
    if dtype is None:
        return None
    try:
        resolved = np.dtype(dtype)
    except Exception as exc:  # numpy's parser raises TypeError, ValueError, SyntaxError, ...
        raise ConfigError(f"{what}={dtype!r:.80} is not a numpy dtype; use e.g. 'float32' or np.float32") from exc
    if resolved.subdtype is not None or resolved.fields is not None:
        raise ConfigError(f"{what}={dtype!r:.80} is an array or structured dtype; use a scalar numeric dtype "
                          "such as 'float32' (a row's shape comes from the dataset)")
    if resolved.kind not in SERVABLE_KINDS:
        raise ConfigError(f"{what}={resolved} is not a numeric dtype; use a bool, integer or float dtype")
    if resolved.kind in "fc" and resolved.itemsize > (8 if resolved.kind == "f" else 16):
        raise ConfigError(f"{what}={resolved} is extended precision, which torch cannot hold; use float64 or "
                          "complex128 at most")
    return resolved.newbyteorder("=")


def inspect_dataset(f: h5py.File, key: str, vlen: bool = False) -> DatasetInfo:
    """Shape, dtype and chunking of ``f[key]``. Variable-length rows (numeric sequences,
    strings) only with ``vlen`` (readers that know h5serve/hdf5/vlen.py); otherwise refused.

    Raised when the key is missing (the message lists datasets that exist), is not a
    dataset, or a soft or external link on its path is dangling (the message names the
    link and its target): KeyNotFound.
    Raised when it has no rows dimension, a dtype that is not plain numeric, a filter that
    is not available, or data in files whose changes h5serve cannot track (raw external
    storage, external links through more than one other file, virtual sources it cannot
    follow: vds.py): UnsupportedDataset. Also for variable-length rows of a base type that
    cannot be served (compound, references, nested sequences) or in more than one dimension.
    Raised when a virtual dataset's source file is missing: SourceNotFound.
    """
    dataset_key, field = split_field(f, key)
    obj, linked = _follow(f, dataset_key)
    if not isinstance(obj, h5py.Dataset):
        what = "a group" if isinstance(obj, h5py.Group) else f"a {type(obj).__name__}"
        raise KeyNotFound(f"key {key!r} in {f.filename} is {what}, not a dataset; pass a dataset path like '{key}/...'")
    if obj.shape is None or len(obj.shape) == 0:
        raise UnsupportedDataset(f"dataset {key!r} in {f.filename} is scalar: it has no rows dimension to shard")
    dtype, field_shape = _field_dtype(obj, key, dataset_key, field) if field else (obj.dtype, ())
    kind, base, why = vlen_kind(dtype)
    if kind and vlen:
        return _inspect_vlen(f, obj, key, field, kind, base, why, len(obj.shape) + len(field_shape), linked)
    reason = _unservable(dtype)
    if reason:
        fields = _numeric_fields(dtype) if dtype.fields is not None else []
        hint = (f"; select one of its fields as the key, e.g. '{key}:{fields[0]}' (fields: {', '.join(fields)})"
                if fields else "")
        if kind and not why:
            hint = ("; SharedH5Dataset serves variable-length rows, this reader (H5LazyDataset, the compat preload) "
                    "does not")
        raise UnsupportedDataset(
            f"dataset {key!r} in {f.filename} has dtype {dtype} ({reason}): only bool, integer, float, complex "
            f"and fixed-length byte string data is served{hint}"
        )
    _check_filters(obj, key)
    _check_storage(obj, key)
    sources = virtual_sources(obj, key) if obj.is_virtual else ()
    chunks = obj.chunks
    return DatasetInfo(
        key=key,
        rows=int(obj.shape[0]),
        row_shape=tuple(int(n) for n in (*obj.shape[1:], *field_shape)),
        dtype=dtype.newbyteorder("="),  # h5py's string metadata stays: HDF5 needs it to convert UTF-8
        chunk_rows=int(chunks[0]) if chunks else max(int(obj.shape[0]), 1),
        linked_file=linked,
        chunked=bool(chunks),
        field=field,
        virtual_sources=sources,
    )


def _inspect_vlen(f: h5py.File, obj: h5py.Dataset, key: str, field: str, kind: str, base: np.dtype | None,
                  why: str, ndim: int, linked: str) -> DatasetInfo:
    """The DatasetInfo of variable-length rows (``inspect_dataset`` with ``vlen``).

    Raised when their base type cannot be served, or they have more than one dimension:
    UnsupportedDataset.
    """
    if why or base is None:
        raise UnsupportedDataset(
            f"dataset {key!r} in {f.filename} holds {why}: only variable-length sequences of bool, integer, "
            "float and complex values, and variable-length strings, are served"
        )
    if ndim != 1:
        raise UnsupportedDataset(
            f"dataset {key!r} in {f.filename} holds variable-length rows in {ndim} dimensions: only one-dimensional "
            "variable-length datasets (one sequence or string per row) are served"
        )
    _check_filters(obj, key)
    _check_storage(obj, key)
    rows = int(obj.shape[0])
    chunks = obj.chunks
    reader = FieldRows(obj, field) if field else obj
    return DatasetInfo(
        key=key, rows=rows, row_shape=(), dtype=base, chunk_rows=int(chunks[0]) if chunks else max(rows, 1),
        linked_file=linked, chunked=bool(chunks), field=field, vlen=kind,
        mean_length=estimate_mean_length(reader, kind, base, rows),
    )


def _numeric_fields(dtype: np.dtype) -> list[str]:
    """The fields of a compound dtype that can be served, in order."""
    if dtype.fields is None:
        return []
    return [name for name in dtype.names or () if not _unservable(dtype.fields[name][0].base)]


def _field_dtype(obj: h5py.Dataset, key: str, dataset_key: str, field: str) -> tuple[np.dtype, tuple[int, ...]]:
    """The base dtype and shape of ``field`` of the compound dataset ``obj``.

    Raised when ``obj`` is not compound, or has no such field: KeyNotFound.
    """
    names = obj.dtype.names
    if names is None:
        raise KeyNotFound(
            f"key {key!r}: dataset {dataset_key!r} in {obj.file.filename} has dtype {obj.dtype}, not a compound "
            f"type with fields; pass {dataset_key!r} itself (a key is '<dataset>:<field>' only for compound datasets)"
        )
    if field not in names:
        raise KeyNotFound(
            f"key {key!r}: compound dataset {dataset_key!r} in {obj.file.filename} has no field {field!r}; its "
            f"fields: {', '.join(names)}"
        )
    sub = obj.dtype.fields[field][0]
    return sub.base, tuple(int(n) for n in sub.shape)


def _unservable(dtype: np.dtype) -> str:
    """Why rows of ``dtype`` cannot be served (a few words), or "" when they can."""
    string = h5py.check_string_dtype(dtype)
    if string is not None:
        return "variable length strings" if string.length is None else ""
    if h5py.check_vlen_dtype(dtype) is not None:
        return "variable length sequences"
    if h5py.check_ref_dtype(dtype) is not None:
        return "object references"
    if dtype.fields is not None:
        return "a compound type"
    if dtype.subdtype is not None:
        return "an array type"
    if dtype.kind in "fc" and dtype.itemsize > (8 if dtype.kind == "f" else 16):
        return "extended precision, which torch cannot hold"
    if dtype.kind not in SOURCE_KINDS:
        return {"M": "datetimes", "m": "timedeltas", "V": "opaque bytes"}.get(dtype.kind, "not numeric")
    return ""


def _message(exc: BaseException) -> str:
    """An h5py error's text, without the quotes KeyError adds."""
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)


def _split(path: str) -> list[str]:
    return [part for part in path.split("/") if part not in ("", ".")]


def _external_candidates(link_file: str, parent: str) -> set[str]:
    """Realpaths HDF5 may open for an external link to ``link_file`` from the file ``parent``:
    the absolute name, else the name (or, for an absolute one that is missing, its last
    component) under HDF5_EXT_PREFIX, the parent file's directory or the working directory."""
    names = [link_file] if not os.path.isabs(link_file) else [os.path.basename(link_file)]
    parent_dirs = [os.path.dirname(parent), os.path.dirname(os.path.realpath(parent))]
    prefixes = [p for p in os.environ.get("HDF5_EXT_PREFIX", "").split(":") if p]
    dirs = [d for p in prefixes for d in ([p] if p != "${ORIGIN}" else parent_dirs)] + parent_dirs
    try:
        dirs.append(os.getcwd())
    except OSError:  # the working directory was removed: HDF5 cannot have looked there either
        pass
    found = {os.path.realpath(os.path.join(d, name)) for d in dirs for name in names}
    if os.path.isabs(link_file):
        found.add(os.path.realpath(link_file))
    return found


class _FileName:
    """The base name of the file holding ``node``, looked up only when formatted."""

    def __init__(self, node: h5py.HLObject) -> None:
        self.node = node

    def __format__(self, spec: str) -> str:
        return format(os.path.basename(self.node.file.filename), spec)


def _follow(f: h5py.File, key: str) -> tuple[h5py.HLObject, str]:
    """The object at ``key`` and the realpath of the other file holding it ("" if none),
    following soft and external links one path component at a time, so that a link behind
    another link is seen too.

    Raised when the key, or a link's target on its path, does not exist: KeyNotFound.
    Raised when external links pass through more than one other file (h5serve tracks one
    linked file for changes), or through a file h5serve cannot tell: UnsupportedDataset.
    """
    node: h5py.HLObject = f["/"]
    parts = _split(key)
    via: list[str] = []  # the links followed so far, for messages
    files: list[str] = []  # realpaths of the files external links opened, in order

    def broken(what: str, missing: bool = False) -> KeyNotFound:
        if missing and not via:
            names = _dataset_names(f)
            return KeyNotFound(
                f"key {key!r} is not in {f.filename}; datasets there: {', '.join(names) or '(none)'}"
            )
        through = f" (reached through {', then '.join(via)})" if via else ""
        return KeyNotFound(f"key {key!r} cannot be opened in {f.filename}: {what}{through}")

    while parts:
        name = parts.pop(0)
        here = f"{node.name.rstrip('/')}/{name}"
        where = _FileName(node)  # formatted only into messages: node.file costs ~0.1 ms
        if not isinstance(node, h5py.Group):
            raise broken(f"{node.name!r} in {where} is not a group")
        try:
            link = node.get(name, getlink=True)
        except (KeyError, ValueError, TypeError, OSError) as exc:  # user-defined links, bad names
            raise broken(f"{here!r} in {where} cannot be read: {_message(exc)}") from exc
        if link is None:
            raise broken(f"{here!r} does not exist in {where}", missing=True)
        if isinstance(link, (h5py.SoftLink, h5py.ExternalLink)) and len(via) >= MAX_LINKS:
            raise broken(f"more than {MAX_LINKS} links followed (a cycle?)")
        if isinstance(link, h5py.SoftLink):
            via.append(f"soft link {here!r} -> {link.path!r} in {where}")
            node = node.file["/"] if link.path.startswith("/") else node
            parts = _split(link.path) + parts
            continue
        try:
            target = node[name]
        except (KeyError, ValueError, OSError) as exc:
            if isinstance(link, h5py.ExternalLink):
                raise broken(
                    f"{here!r} in {where} is an external link to {link.path!r} in file {link.filename!r}, "
                    f"which cannot be opened ({_message(exc)})"
                ) from exc
            raise broken(f"{here!r} in {where} cannot be opened: {_message(exc)}") from exc
        if isinstance(link, h5py.ExternalLink):
            opened = os.path.realpath(target.file.filename)
            if opened not in _external_candidates(link.filename, node.file.filename):
                raise UnsupportedDataset(
                    f"key {key!r} in {f.filename} goes through external link {here!r} -> {link.filename!r}, "
                    f"which leads on to another file ({opened}); h5serve can track only one linked file for "
                    "changes: link straight to the file that holds the data"
                )
            via.append(f"external link {here!r} -> {link.path!r} in {link.filename!r}")
            files.append(opened)
            node = target.file["/"]
            parts = _split(link.path) + parts
            continue
        node = target
    if not files:  # no external link followed: the object is in f itself
        return node, ""
    outer = os.path.realpath(f.filename)
    others = sorted({path for path in files if path != outer})
    if len(others) > 1:
        raise UnsupportedDataset(
            f"key {key!r} in {f.filename} goes through external links in {len(others)} other files "
            f"({', '.join(others)}); h5serve can track only one linked file for changes: link straight to "
            "the file that holds the data"
        )
    holder = os.path.realpath(node.file.filename)
    if others and holder != others[0]:  # through another file and back: that file is not tracked
        raise UnsupportedDataset(
            f"key {key!r} in {f.filename} goes through an external link in {others[0]} back to {holder}; "
            "h5serve can track only the file that holds the data for changes: link straight to it"
        )
    return node, "" if holder == outer else holder


def _check_storage(obj: h5py.Dataset, key: str) -> None:
    """Raised when rows live in raw files outside HDF5 (external storage), whose changes
    h5serve cannot track: UnsupportedDataset. (Virtual datasets: vds.py.)"""
    external = obj.external
    if external:
        names = ", ".join(str(entry[0]) for entry in external)
        raise UnsupportedDataset(
            f"dataset {key!r} keeps its rows in external raw files ({names}), which h5serve cannot track for "
            "changes; copy the rows into a dataset stored inside the HDF5 file"
        )


def _check_filters(obj: h5py.Dataset, key: str) -> None:
    """Raised when a filter the dataset needs is not available here: UnsupportedDataset."""
    plist = obj.id.get_create_plist()
    for i in range(plist.get_nfilters()):
        filter_id, _flags, _values, raw_name = plist.get_filter(i)
        if not h5py.h5z.filter_avail(filter_id):
            name = KNOWN_FILTERS.get(filter_id) or raw_name.decode(errors="replace") or "unknown"
            if filter_id in HDF5PLUGIN_FILTERS and not HAVE_HDF5PLUGIN:
                fix = "install the filters extra: pip install 'h5serve[filters]' (hdf5plugin)"
            else:
                fix = "install an HDF5 plugin for it (see HDF5_PLUGIN_PATH) or rewrite the dataset with gzip/lzf"
            raise UnsupportedDataset(
                f"dataset {key!r} is compressed with HDF5 filter {name!r} (id {filter_id}), which is not "
                f"available here; {fix}"
            )


def check_lengths(*infos: DatasetInfo | None) -> None:
    """Raised when the datasets (None: left out) have different row counts: LengthMismatch."""
    given = [info for info in infos if info is not None]
    check_row_counts([info.key for info in given], [info.rows for info in given])


def check_row_counts(keys: list[str] | tuple[str, ...], rows: list[int]) -> None:
    """Raised when ``rows`` (of ``keys``, in order) are not all equal: LengthMismatch, naming
    each key's length."""
    if len(set(rows)) > 1:
        each = ", ".join(f"{key!r} has {n} rows" for key, n in zip(keys, rows))
        raise LengthMismatch(f"the keys differ in length: {each}; every key of a dataset must have the same "
                             "number of rows (one row per sample)")


def check_cast(info: DatasetInfo, requested: np.dtype | None) -> np.dtype:
    """The dtype ``info``'s rows are returned in: ``requested``, else the source dtype.

    Raised when a dtype is requested for byte strings (they are served as ``bytes``, or
    ``str`` with ``encoding=``) or variable-length strings (served as ``str``): UnsupportedDataset.
    """
    if info.is_text and requested is not None:
        raise UnsupportedDataset(
            f"dataset {info.key!r} holds variable-length strings ({info.vlen}), which cannot be cast to {requested}; "
            "leave its dtype unset: rows come as str"
        )
    if info.is_bytes and requested is not None:
        raise UnsupportedDataset(
            f"dataset {info.key!r} holds fixed-length byte strings ({info.dtype.str}), which cannot be cast to "
            f"{requested}; leave its dtype unset: rows come as bytes (or str with encoding=)"
        )
    return requested or info.dtype


def storage_dtype(source: np.dtype, requested: np.dtype | None) -> np.dtype:
    """What a segment stores: the narrower of source and requested, so a widening cast
    (uint8 -> float32) never multiplies node memory; the cast then happens per batch."""
    if requested is None or requested == source:
        return source
    return source if source.itemsize < requested.itemsize else requested
