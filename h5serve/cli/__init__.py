"""The ``h5serve`` command: arguments -> library calls -> messages and exit codes. The command
table and ``main`` are in main.py (``h5serve.cli:main`` is the console script, ``python -m
h5serve`` runs it too); one module per command or pair of commands: start.py (start, stop),
status.py, preload.py, plan.py, inspect.py (the preflight report); common.py holds the exit
codes and the daemon client they share. Nothing imports this package but the entry points.

May import: h5serve.demo, h5serve.daemon, h5serve.hdf5, h5serve.segments, h5serve.topology, h5serve.wire,
h5serve.order, h5serve.util, h5serve.errors
"""

from .main import EXIT_ERROR, EXIT_NOT_RUNNING, EXIT_OK, EXIT_USAGE, build_parser, main

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_NOT_RUNNING"]
