"""``python -m h5serve`` is the ``h5serve`` command."""

import os
import sys

# `python -m` put the working directory first on sys.path (unless -P): an `h5serve` run as root in
# a directory another user can write would import their msgpack.py. h5serve itself is imported
# already; its own modules are found through the package, so the entry is not needed.
if not getattr(sys.flags, "safe_path", False) and sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from h5serve.cli import main  # noqa: E402 - after the path is made safe

sys.exit(main())
