"""The daemon connection, as training code imports it: ``h5serve.wire.connection`` (torch-free,
so the command line can talk to the daemon without importing torch)."""

from ..wire.connection import DEFAULT_TIMEOUT_S, FIRST_POLL_S, DaemonClient
from ..wire.protocol import POLL_INTERVAL_S

__all__ = ["DaemonClient", "DEFAULT_TIMEOUT_S", "POLL_INTERVAL_S", "FIRST_POLL_S"]
