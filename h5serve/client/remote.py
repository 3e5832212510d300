"""Remote files (s3://, gs://, https://: h5serve/hdf5/remote.py) on the client: read in each
process, never sent to the daemon, which does not fetch them yet (docs/architecture.md,
*Remote files*)."""

from __future__ import annotations

import warnings

from ..errors import ConfigError
from .spec import BackendSpec

__all__ = ["REMOTE_WARNING", "refuse_daemon"]

REMOTE_WARNING = ("h5serve: the daemon does not fetch remote files (s3://, gs://, https://) yet: each process reads "
                  "them itself through fsspec (same rows, same order as a local copy; slower, and once per process, "
                  "not once per node)")


def refuse_daemon(spec: BackendSpec, fallback: str, shown: str) -> bool:
    """Whether ``spec`` names a remote file, which is then read here: said once per process (the
    warning's text is constant, so Python's filter shows it once).

    Raised with ``fallback="error"`` (no reading here allowed): ConfigError naming ``shown``."""
    if not spec.remote:
        return False
    if fallback == "error":
        raise ConfigError(f"{shown}: the h5serve daemon does not fetch remote files (s3://, gs://, https://) yet, and "
                          "fallback='error' forbids reading them here; pass fallback='lazy' to read them in each "
                          "process, or copy them to a local file system")
    warnings.warn(REMOTE_WARNING, RuntimeWarning, stacklevel=4)  # the line that built the dataset
    return True
