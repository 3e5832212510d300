"""The per-node daemon. Server side only: client code never imports this package.

``python -m h5serve.daemon`` (``__main__.py``) is ``h5serve start --foreground``: an entry
point, it runs the command line.

May import: h5serve.hdf5, h5serve.segments, h5serve.topology, h5serve.wire, h5serve.order, h5serve.util,
h5serve.errors
"""

from .config import DaemonConfig
from .server import serve

__all__ = ["DaemonConfig", "serve"]
