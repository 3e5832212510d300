"""The per-node daemon. Server side only: client code never imports this package."""

from .config import DaemonConfig
from .server import serve

__all__ = ["DaemonConfig", "serve"]
