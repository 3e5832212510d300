"""What the commands of the ``h5serve`` command line share: the exit codes (documented in
cli/main.py) and the daemon client they talk through."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_NOT_RUNNING", "daemon_client"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_RUNNING = 0, 1, 2, 3


def daemon_client(runtime_dir: str | os.PathLike[str] | None, timeout: float | None = None) -> Any:
    from ..wire.connection import DaemonClient  # zmq only for the commands that talk

    return DaemonClient(runtime_dir, timeout)
