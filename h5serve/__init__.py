"""h5serve: HDF5 rows in shared memory, once per node, for distributed PyTorch training.

The public surface, and all of it:

- ``h5serve``: ``__version__`` and the exception classes (the tree is drawn in errors.py);
- ``h5serve.client``: the datasets, samplers, ``make_loader`` and ``collate`` training code uses
  (it imports torch, so it is not imported from here);
- the ``h5serve`` command (``h5serve.cli``), with its documented exit codes.

Everything else is internal and may change; a module named ``_name.py`` is private to its package.

Layering (imports only point down; nothing imports a layer above it)::

    h5serve.cli, h5serve.demo        thin: arguments -> library calls -> exit codes
    h5serve.daemon | h5serve.client  server side | training side: never imports h5serve.daemon
    h5serve.connection               the client end of the protocol (torch-free: the CLI uses it)
    h5serve.hdf5                     reading HDF5 through h5py (both sides)
    h5serve.protocol, segments, runtime, sharding, equalise, stream_order, stream_plan, safeio, topology, crc
    h5serve.errors, units, checks, logtext

``import h5serve`` itself imports nothing heavy (no torch, h5py or zmq). docs/architecture.md
has a line on every module.
"""
from __future__ import annotations

from . import errors as _errors
from .errors import *  # noqa: F403 - the exception classes, drawn as a tree in errors.py

__version__ = "0.1.0"  # the one definition: pyproject.toml reads it (dynamic version)

__all__ = ["__version__", *(name for name in _errors.__all__ if name[0].isupper() and name != "ERROR_CODES")]
