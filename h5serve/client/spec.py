"""BackendSpec: what every backend of one rank's shard is built from (picklable), and the
one description of its files (h5serve/hdf5/description.py) the h5py readers are given."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..hdf5.description import DatasetDescription, describe
from ..hdf5.remote import is_url
from ..order.sharding import Selection

__all__ = ["BackendSpec", "describe_spec"]


@dataclass(frozen=True)
class BackendSpec:
    """Everything needed to build any backend for one rank's shard (picklable)."""

    path: str  # absolute (many files: the first)
    # one per field, in order (x_key, y_key: the first two); "<dataset>:<field>" for compound fields
    keys: tuple[str, ...]
    selection: Selection
    dtypes: tuple[np.dtype | None, ...]  # requested output dtype of each key (None: the source dtype)
    runtime_dir: str | None = None
    timeout: float | None = None
    daemon_user: str | int | None = None  # a shared daemon's user to trust (else $H5SERVE_DAEMON_USER)
    h5_options: dict[str, Any] = field(default_factory=dict)
    cache_bytes: int | None = None  # lazy backend's chunk cache budget (None: auto, 0: off)
    files: tuple[str, ...] = ()  # many files as one dataset (h5serve.hdf5.files): all, absolute, in row order
    pattern: str = ""  # the glob pattern they were expanded from ("" for a list or one file)
    # ``path`` is an s3:// object the daemon fetches (client/remote.py): its identity as described, [size, ETag,
    # version id], sent with every acquire, so the daemon serves that version or none
    pin: tuple[int, str, str] | None = None
    pins: tuple[tuple[int, str, str], ...] = ()  # ``files`` are s3:// objects the daemon fetches: theirs, in order

    @property
    def remote(self) -> bool:
        """Whether a file is a URL (hdf5/remote.py)."""
        return any(is_url(p) for p in self.files or (self.path,))


def describe_spec(spec: BackendSpec) -> DatasetDescription:
    """``spec``'s files and keys described, each file opened once (hdf5.description.describe).

    Raised as ``describe`` is: the DataError that says which file or key, LengthMismatch,
    UnsupportedDataset."""
    return describe(spec.files or (spec.path,), spec.keys, spec.dtypes, pattern=spec.pattern)
