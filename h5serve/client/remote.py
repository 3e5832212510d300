"""Remote files (s3://, gs://, https://: h5serve/hdf5/remote.py) on the client: which the node's
daemon fetches, once per node, and which each process reads itself (docs/architecture.md,
*Remote files*).

The daemon fetches one ``s3://`` object of fixed-size rows in every mode (stream mode: block by
block, client/streaming/daemon_blocks.py): the client sends the URL and the object's identity as it described it (size,
ETag, version id: ``BackendSpec.pin``), never a credential; the daemon fetches with its own.
Everything else (gs://, https://, many remote files, variable-length rows) is
read here, through fsspec, with this process's credentials. ``reads_here`` says which, for the
dataset; ``pinned`` adds the identity, for the daemon's backends (backends/progressive.py).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

from ..errors import ConfigError
from ..hdf5.description import DatasetDescription
from ..hdf5.remote import parse_url
from ..order.sharding import STREAM
from .spec import BackendSpec

__all__ = ["REMOTE_WARNING", "pinned", "reads_here"]

REMOTE_WARNING = ("h5serve: the daemon fetches one s3:// object of fixed-size rows, in any mode; these remote files "
                  "(gs://, https://, many files or variable-length rows) are read by each process itself through "
                  "fsspec (same rows, same order as a local copy; slower, and once per process, not once per node)")


def _daemon_fetches(spec: BackendSpec, description: DatasetDescription) -> bool:
    return (not spec.files and parse_url(spec.path)[0] == "s3" and bool(description.remote)
            and not any(key.vlen for key in description.keys))


def pinned(spec: BackendSpec, describe: Callable[[], DatasetDescription]) -> BackendSpec:
    """``spec`` as it is, or for an object the daemon fetches, with its identity (``pin``) as the
    description (``describe()``) holds it."""
    if not spec.remote or spec.pin is not None:
        return spec
    description = describe()
    if not _daemon_fetches(spec, description):
        return spec
    identity = description.remote[0]
    assert identity is not None
    return dataclasses.replace(spec, pin=(identity.size, identity.etag, identity.version_id))


def reads_here(spec: BackendSpec, describe: Callable[[], DatasetDescription], mode: str, fallback: str,
               shown: str) -> bool:
    """Whether ``spec`` names a remote file the daemon does not fetch, which the lazy backend then
    reads here: said once per process (the warning's text is constant, so Python's filter shows
    it once). Stream mode: False after the warning (its backend reads remote files here itself).

    Raised for one read here with ``fallback="error"``: ConfigError naming ``shown``."""
    if not spec.remote or _daemon_fetches(spec, describe()):
        return False
    if fallback == "error":
        raise ConfigError(f"{shown}: the h5serve daemon fetches one s3:// object of fixed-size rows (not gs://, "
                          "https://, many files or variable-length rows), and fallback='error' forbids reading it "
                          "here; pass fallback='lazy' to read it in each process, or copy it to a local file system")
    warnings.warn(REMOTE_WARNING, RuntimeWarning, stacklevel=4)  # the line that built the dataset
    return mode != STREAM
