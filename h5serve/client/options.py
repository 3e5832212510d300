"""SharedH5Dataset's options in groups, each a small frozen object passed as one keyword instead
of loose ones:

- ``stream=StreamOptions(window=..., block_rows=..., auto_stream=...)``;
- ``place=NodePlace(local_rank, local_world_size, node_rank, num_nodes)`` (client/samplers/node.py):
  where this rank sits, for node and stream mode;
- ``daemon=DaemonOptions(runtime_dir=..., timeout=..., daemon_user=..., fallback=..., wait_ready=...)``:
  which daemon to trust and how long to wait for it, and what to do without one.

A group and any of its loose keywords together are refused (``grouped``). The loose keywords
work as they always did; an object checks its fields when built, with the checks the dataset
applies to the loose values (a block's multiple of chunks needs the file, so it waits for it).
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..order.stream_order import check_block_rows
from ..util.checks import is_int
from .streaming.backend import window_bytes

__all__ = ["DaemonOptions", "FALLBACKS", "StreamOptions", "check_fallback", "grouped"]

FALLBACKS = ("lazy", "error")


def check_fallback(fallback: object) -> str:
    """``fallback`` when it is one of FALLBACKS. Raised when not: ConfigError."""
    if fallback not in FALLBACKS:
        raise ConfigError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    return str(fallback)


@dataclass(frozen=True)
class StreamOptions:
    """Stream mode's block and window, and whether global/node data without room is streamed:
    ``SharedH5Dataset(..., stream=StreamOptions(window="2GiB", block_rows=4096))``. The fields
    mean what the dataset's keywords of the same names do.

    Raised when ``window`` is not a size, ``block_rows`` not an integer >= 1 or ``auto_stream``
    not a bool: ConfigError.
    """

    window: int | str | None = None
    block_rows: int | None = None
    auto_stream: bool = True

    def __post_init__(self) -> None:
        window_bytes(self.window)
        if self.block_rows is not None:
            check_block_rows(self.block_rows, 1)
        if not isinstance(self.auto_stream, bool):
            raise ConfigError(f"auto_stream must be True or False, got {self.auto_stream!r}")


@dataclass(frozen=True)
class DaemonOptions:
    """Which daemon to use and trust, how long to wait for it, and what to do without one:
    ``SharedH5Dataset(..., daemon=DaemonOptions(runtime_dir="/run/h5serve", fallback="error"))``.
    The fields mean what the dataset's keywords of the same names do; one object can serve
    every dataset of a job.

    Raised when a field has the wrong type or range (``timeout`` > 0 seconds, ``daemon_user`` a
    name or a uid >= 0, ``fallback`` one of FALLBACKS, ``wait_ready`` None or a bool): ConfigError.
    """

    runtime_dir: str | os.PathLike[str] | None = None
    timeout: float | None = None
    daemon_user: str | int | None = None
    fallback: str = "lazy"
    wait_ready: bool | None = None

    def __post_init__(self) -> None:
        if self.runtime_dir is not None and not isinstance(self.runtime_dir, (str, os.PathLike)):
            raise ConfigError(f"runtime_dir must be a path (str or os.PathLike) or None, got {self.runtime_dir!r}")
        timeout = self.timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                                    or not timeout > 0):
            raise ConfigError(f"timeout must be a number of seconds > 0 or None (the default), got {timeout!r}")
        user = self.daemon_user
        if user is not None and not (isinstance(user, str) and user) and not (is_int(user) and user >= 0):
            raise ConfigError(f"daemon_user must be a user name, a uid >= 0 or None, got {user!r}")
        check_fallback(self.fallback)
        if self.wait_ready is not None and not isinstance(self.wait_ready, bool):
            raise ConfigError(f"wait_ready must be None, True or False, got {self.wait_ready!r}")


def _default(field: dataclasses.Field[Any]) -> object:
    return None if field.default is dataclasses.MISSING else field.default


def grouped(name: str, group: object | None, kind: type, **loose: object) -> tuple[Any, ...]:
    """The values of ``loose`` (keyword name: value, in the caller's order): from ``group``, the
    ``kind`` object passed as keyword ``name``, when there is one (numpy integers as ints), else
    as passed.

    A loose keyword counts as passed when it differs from its default (the field's default in
    ``kind``, or None for a field without one: NodePlace's), so one left at its default defers to
    the group.

    Raised when ``group`` is not a ``kind``, or comes with a loose keyword it holds: ConfigError
    naming both."""
    if group is None:
        return tuple(loose.values())
    if not isinstance(group, kind):
        raise ConfigError(f"{name}= takes a {kind.__name__}, got {group!r}")
    fields = {f.name: f for f in dataclasses.fields(kind)}
    passed = [key for key, value in loose.items()
              if value is not _default(fields[key]) and value != _default(fields[key])]
    if passed:
        shown = ", ".join(f"{key}={loose[key]!r}" for key in passed)
        raise ConfigError(f"{name}={group!r} and {shown} both set {', '.join(passed)}: pass them in {name}= only, "
                          f"or drop {name}= and pass the keywords")
    values = (getattr(group, key) for key in loose)
    return tuple(int(v) if is_int(v, numpy=True) else v for v in values)
