"""h5serve: HDF5 rows in shared memory, once per node, for distributed PyTorch training.

The public surface, and all of it:

- ``h5serve``: ``__version__`` and the exception classes (the tree is drawn in errors.py);
- ``h5serve.client``: the datasets, samplers, ``make_loader`` and ``collate`` training code uses
  (it imports torch, so it is not imported from here);
- the ``h5serve`` command (``h5serve.cli``), with its documented exit codes.

Everything else is internal and may change; a module named ``_name.py`` is private to its package.
The modules that were at the package root until this release keep their old paths for one
release, with a DeprecationWarning (``_moved.py``).

Layering: a line per layer, packages side by side separated by ``|``; a package imports only
packages on lines below its own, and says at the top of its ``__init__`` which ones (``May
import:``). ``__main__`` modules are entry points above every layer. tests/unit/test_layering.py
reads this drawing and those lines, and checks every import against them, and that no two
modules import each other (any cycle)::

    cli                          the h5serve command: arguments -> library calls -> exit codes
    demo                         h5serve demo; DaemonProcess (a daemon driven through the command)
    daemon | client              server side | training side: never import each other
    hdf5 | segments | topology   reading HDF5 | the shared-memory files | which ranks share a node
    wire                         protocol, the client's connection, the runtime dir (torch-free)
    order                        which rows, in which order: sharding, equal batches, stream order
    util                         small shared helpers: units, checks, crc, safeio, progress, logtext
    errors                       the exception tree (and this module: __version__)

``import h5serve`` itself imports nothing heavy (no torch, h5py or zmq). docs/architecture.md
has a line on every module.
"""
from __future__ import annotations

from . import _moved
from . import errors as _errors
from .errors import *  # noqa: F403 - the exception classes, drawn as a tree in errors.py

_moved.install()  # the old paths of the modules that were at the root: one release, with a DeprecationWarning

__version__ = "0.1.0"  # the one definition: pyproject.toml reads it (dynamic version)

__all__ = ["__version__", *(name for name in _errors.__all__ if name[0].isupper() and name != "ERROR_CODES")]
