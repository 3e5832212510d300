"""h5serve: HDF5 shards in shared memory for distributed PyTorch training.

Layering (imports only point down; nothing imports a layer above it)::

    h5serve.cli                      thin: arguments -> library calls -> exit codes
    h5serve.daemon  | h5serve.client server side | training side: never imports h5serve.daemon
    h5serve.protocol, segments, source, runtime, sharding
    h5serve.errors

Client code (``from h5serve.client import SharedH5Dataset``) never imports the daemon
package, and ``import h5serve`` itself imports nothing heavy (no torch, h5py or zmq).
"""

from __future__ import annotations

from . import errors as _errors
from .errors import *  # noqa: F403 - the exception classes, drawn as a tree in errors.py

__version__ = "0.1.0"  # the one definition: pyproject.toml reads it (dynamic version)

__all__ = ["__version__", *(name for name in _errors.__all__ if name[0].isupper() and name != "ERROR_CODES")]
