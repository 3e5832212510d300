"""HDF5 virtual datasets (VDS): which other files their rows come from.

h5serve serves a virtual dataset through h5py's reads (HDF5 assembles the rows from the
mapped source datasets), so a segment holds exactly the bytes ``dset[...]`` returns. Every
source file is found here the way HDF5 looks for it, and its identity becomes part of the
segment key (daemon/access/resolver.py), so a source file changed, replaced or removed maps to a new
segment, never to stale rows; the daemon checks each source file like the file itself
(``--allow-root``, readable by the requesting user).

A missing source file or dataset is refused (SourceNotFound naming it), where HDF5 would
silently read the dataset's fill value for those rows: a missing source is far more often a
moved or misnamed file than an intended hole. printf-style source names (``%b``, unlimited
mappings) are refused: their files cannot be listed in advance.
"""

from __future__ import annotations

import os

import h5py

from ..errors import SourceNotFound, UnsupportedDataset

__all__ = ["virtual_sources", "VDS_PREFIX_ENV"]

VDS_PREFIX_ENV = "HDF5_VDS_PREFIX"


def _candidates(name: str, parent: str) -> list[str]:
    """Where HDF5 looks for a source file ``name`` of a VDS in file ``parent``, in its order
    (H5F_prefix_open_file): an absolute name as is; then the name (an absolute one's last
    component) under each $HDF5_VDS_PREFIX entry (``${ORIGIN}``: the VDS file's directory),
    under the VDS file's directory, and relative to the working directory."""
    found: list[str] = []
    base = name
    if os.path.isabs(name):
        found.append(name)
        base = os.path.basename(name)
    origin = os.path.dirname(os.path.abspath(parent))
    for prefix in os.environ.get(VDS_PREFIX_ENV, "").split(":"):
        if prefix:
            found.append(os.path.join(prefix.replace("${ORIGIN}", origin), base))
    found.append(os.path.join(origin, base))
    found.append(os.path.abspath(base))
    return found


def _locate(name: str, parent: str, key: str) -> str:
    """The realpath of the source file HDF5 opens for ``name``. Raised when none of the
    places HDF5 looks holds a file: SourceNotFound."""
    for candidate in _candidates(name, parent):
        if os.path.isfile(candidate):
            return os.path.realpath(candidate)
    raise SourceNotFound(
        f"dataset {key!r} in {parent} is a virtual dataset whose source file {name!r} does not exist (looked in "
        f"{', '.join(dict.fromkeys(_candidates(name, parent)))}); HDF5 would read the fill value for its rows, "
        "h5serve refuses: restore or move the file there, or set HDF5_VDS_PREFIX"
    )


def _check_source_dataset(path: str, name: str, key: str, parent: str) -> None:
    """Raised when the source file has no dataset ``name`` (HDF5 would read fill values):
    SourceNotFound; when that dataset's rows lie in yet other files (nested virtual datasets,
    external links, raw external storage), which h5serve does not follow: UnsupportedDataset."""
    try:
        with h5py.File(path, "r") as f:
            obj = f.get(name)
            where = os.path.realpath(obj.file.filename) if obj is not None else path
            nested = isinstance(obj, h5py.Dataset) and (obj.is_virtual or bool(obj.external))
    except OSError as exc:
        raise SourceNotFound(f"the source file {path} of virtual dataset {key!r} in {parent} cannot be opened as "
                             f"HDF5: {exc}") from exc
    if not isinstance(obj, h5py.Dataset):
        raise SourceNotFound(
            f"dataset {key!r} in {parent} is a virtual dataset whose source {path} has no dataset {name!r}; HDF5 "
            "would read the fill value for its rows, h5serve refuses: fix the source file or the mapping"
        )
    if where != path or nested:
        raise UnsupportedDataset(
            f"dataset {key!r} in {parent} is a virtual dataset whose source {name!r} in {path} keeps its rows in "
            "yet other files (an external link, a nested virtual dataset or raw external storage), which h5serve "
            "does not track: map the source files that hold the rows directly"
        )


def virtual_sources(obj: h5py.Dataset, key: str) -> tuple[str, ...]:
    """The realpaths of the files (other than its own) a virtual dataset's rows come from, in
    first-mapped order, each checked to hold its source dataset.

    Raised when a source file or dataset is missing: SourceNotFound. Raised for printf-style
    source names, or sources whose rows lie in yet other files: UnsupportedDataset.
    """
    parent = obj.file.filename
    own = os.path.realpath(parent)
    files: dict[str, None] = {}
    checked: set[tuple[str, str]] = set()
    for mapping in obj.virtual_sources():
        name, dset_name = mapping.file_name, mapping.dset_name
        if "%" in name or "%" in dset_name:
            raise UnsupportedDataset(
                f"dataset {key!r} in {parent} is a virtual dataset with printf-style source names ({name!r}, "
                f"{dset_name!r}), whose files h5serve cannot list in advance to track them for changes"
            )
        path = own if name == "." else _locate(name, parent, key)
        if (path, dset_name) not in checked:
            checked.add((path, dset_name))
            if path != own:
                _check_source_dataset(path, dset_name, key, parent)
            elif not isinstance(obj.file.get(dset_name), h5py.Dataset):
                raise SourceNotFound(
                    f"dataset {key!r} in {parent} is a virtual dataset whose source dataset {dset_name!r} is not in "
                    "that file; HDF5 would read the fill value for its rows, h5serve refuses: fix the mapping"
                )
        if path != own:
            files[path] = None
    return tuple(files)
