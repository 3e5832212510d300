"""Old import paths of the modules that lived at the package root until 0.1 grouped them
(docs/architecture.md, "Moved modules"): ``import h5serve.sharding`` still works for one release
and gives the very module ``h5serve.order.sharding`` is, with a DeprecationWarning naming the new
path. One meta-path finder and this table, so the package root holds no shim files.

The private modules ``h5serve._plan_cli``, ``h5serve._status_cli`` and ``h5serve._daemon_process``
were never part of the surface and have no old path (they are h5serve.cli.plan,
h5serve.cli.status and h5serve.demo.daemon).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import importlib.abc

__all__ = ["MOVED", "install"]

# old path -> new path; remove the table (and this module) in the release after next
MOVED = {
    "h5serve.protocol": "h5serve.wire.protocol",
    "h5serve.connection": "h5serve.wire.connection",
    "h5serve.runtime": "h5serve.wire.runtime",
    "h5serve.sharding": "h5serve.order.sharding",
    "h5serve.equalise": "h5serve.order.equalise",
    "h5serve.stream_order": "h5serve.order.stream_order",
    "h5serve.stream_plan": "h5serve.order.stream_plan",
    "h5serve.units": "h5serve.util.units",
    "h5serve.checks": "h5serve.util.checks",
    "h5serve.crc": "h5serve.util.crc",
    "h5serve.safeio": "h5serve.util.safeio",
    "h5serve.progress": "h5serve.util.progress",
    "h5serve.logtext": "h5serve.util.logtext",
    "h5serve.inspect": "h5serve.cli.inspect",
    # modules moved inside a package since (the house, third pass)
    "h5serve.client.connection": "h5serve.wire.connection",
    "h5serve.client.loader": "h5serve.client.dataloader",
    "h5serve.client.sampler": "h5serve.client.samplers.shuffle",
    "h5serve.client.node_sampler": "h5serve.client.samplers.node",
    "h5serve.client.stream_sampler": "h5serve.client.streaming.sampler",
    "h5serve.client.stream": "h5serve.client.streaming.backend",
}


class _Alias:  # an importlib Loader (create_module, exec_module); not importlib.abc's, which imports much more
    """Loads an old path as the module at its new path (the same object, not a copy)."""

    def __init__(self, new: str) -> None:
        self.new = new
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        # stacklevel 2: the warnings module skips the import system's frames, so this names the importing line
        warnings.warn(f"{spec.name} has moved to {self.new}: import it from there (the old path goes in the "
                      "next release)", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system stamped the old path's spec on the module: give it its own back
        module.__spec__ = self._spec


class _Finder:  # an importlib MetaPathFinder
    def find_spec(self, fullname: str, path: object = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, cast("importlib.abc.Loader", _Alias(new)))


def install() -> None:
    """Put the finder after the others (once): only a name no file answers reaches it."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
