"""torch for tests/users.py's portable Python, so other users can run every ``h5serve`` command.

``h5serve start`` (without --foreground), ``stop`` and ``status`` import ``h5serve.client``,
which imports torch, and ``portable_python`` copies the daemon's packages only. Copying
torch (~750 MiB) for each test module would be slow, so its files are hard-linked instead:
instant, no space, readable by everyone as the originals are (``0644``; only ``/root`` above
them is ``0700``). Nothing is chmod-ed: a hard link shares the original's mode.
"""

from __future__ import annotations

import errno
import os
import sysconfig
from pathlib import Path

import pytest

from .users import PortablePython

# What `import torch` loads (2.x), by top-level name; the missing ones are skipped.
_TORCH_PACKAGES = ("torch", "torchgen", "typing_extensions", "sympy", "mpmath", "filelock", "networkx", "jinja2",
                   "markupsafe", "fsspec")


def _link_tree(source: Path, target: Path) -> None:
    if source.is_file():
        os.link(source, target)
        return
    for top, dirs, files in os.walk(source):
        here = target / Path(top).relative_to(source)
        here.mkdir(mode=0o755, exist_ok=True)
        os.chmod(here, 0o755)
        for name in files:
            os.link(Path(top) / name, here / name, follow_symlinks=False)


def add_torch(py: PortablePython) -> None:
    """Hard-link torch and what it imports into ``py``'s site dir.

    Skips the test when the interpreter's packages are on another filesystem than ``py``.
    """
    purelib = Path(sysconfig.get_paths()["purelib"])
    site = py.root / "site"
    for name in _TORCH_PACKAGES:
        for source in (purelib / name, purelib / f"{name}.py"):
            if source.exists() and not (site / source.name).exists():
                try:
                    _link_tree(source, site / source.name)
                except OSError as exc:
                    if exc.errno in (errno.EXDEV, errno.EPERM):
                        pytest.skip(f"cannot hard-link {source} into {site} ({exc.strerror}): no torch for other users")
                    raise
