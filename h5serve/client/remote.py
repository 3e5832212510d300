"""Remote files (s3://, gs://, https://: h5serve/hdf5/remote.py) on the client: which the node's
daemon fetches, once per node, and which each process reads itself (docs/architecture.md,
*Remote files*).

The daemon fetches ``s3://`` objects of fixed-size rows, one or many (a list or pattern), in
every mode (stream mode: block by block, client/streaming/daemon_blocks.py): the client sends the
URLs and each object's identity as it described it (size, ETag, version id: ``BackendSpec.pin``,
or ``pins`` for many), never a credential; the daemon fetches with its own. Everything else
(gs://, https://, variable-length rows, s3:// mixed with local files) is read here, through
fsspec, with this process's credentials. ``reads_here`` says which, for the dataset; ``pinned``
adds the identities, for the daemon's backends (backends/progressive.py, streaming/backend.py).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

from ..errors import ConfigError
from ..hdf5.description import DatasetDescription
from ..hdf5.remote import is_url, parse_url
from ..order.sharding import STREAM
from .spec import BackendSpec

__all__ = ["REMOTE_WARNING", "pinned", "reads_here"]

REMOTE_WARNING = ("h5serve: the daemon fetches s3:// objects of fixed-size rows (one or many), in any mode; these "
                  "remote files (gs://, https://, variable-length rows, or s3:// mixed with local files) are read by "
                  "each process itself through fsspec (same rows, same order as a local copy; slower, and once per "
                  "process, not once per node)")


def _daemon_fetches(spec: BackendSpec, description: DatasetDescription) -> bool:
    return (all(is_url(p) and parse_url(p)[0] == "s3" for p in spec.files or (spec.path,)) and bool(description.remote)
            and all(description.remote) and not any(key.vlen for key in description.keys))


def pinned(spec: BackendSpec, describe: Callable[[], DatasetDescription]) -> BackendSpec:
    """``spec`` as it is, or for an object the daemon fetches, with its identity (``pin``) as the
    description (``describe()``) holds it."""
    if not spec.remote or spec.pin is not None or spec.pins:
        return spec
    description = describe()
    if not _daemon_fetches(spec, description):
        return spec
    pins = tuple((i.size, i.etag, i.version_id) for i in description.remote if i is not None)
    if spec.files:  # many objects: one identity each, in the files' order
        return dataclasses.replace(spec, pins=pins)
    return dataclasses.replace(spec, pin=pins[0])


def reads_here(spec: BackendSpec, describe: Callable[[], DatasetDescription], mode: str, fallback: str,
               shown: str) -> bool:
    """Whether ``spec`` names a remote file the daemon does not fetch, which the lazy backend then
    reads here: said once per process (the warning's text is constant, so Python's filter shows
    it once). Stream mode: False after the warning (its backend reads remote files here itself).

    Raised for one read here with ``fallback="error"``: ConfigError naming ``shown``."""
    if not spec.remote or _daemon_fetches(spec, describe()):
        return False
    if fallback == "error":
        raise ConfigError(f"{shown}: the h5serve daemon fetches s3:// objects of fixed-size rows (not gs://, "
                          "https://, variable-length rows or s3:// mixed with local files), and fallback='error' "
                          "forbids reading it here; pass fallback='lazy' to read it in each process, or copy it to a "
                          "local file system")
    warnings.warn(REMOTE_WARNING, RuntimeWarning, stacklevel=4)  # the line that built the dataset
    return mode != STREAM
