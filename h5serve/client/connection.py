"""The daemon connection, as training code imports it: ``h5serve.connection`` (torch-free,
so the command line can talk to the daemon without importing torch)."""

from ..connection import DEFAULT_TIMEOUT_S, FIRST_POLL_S, DaemonClient
from ..protocol import POLL_INTERVAL_S

__all__ = ["DaemonClient", "DEFAULT_TIMEOUT_S", "POLL_INTERVAL_S", "FIRST_POLL_S"]
