"""Checks of argument types shared by every layer (torch-free, daemon-free)."""

from __future__ import annotations

from typing import Literal, TypeGuard, overload

import numpy as np

__all__ = ["is_int"]


@overload
def is_int(value: object, numpy: Literal[False] = False) -> TypeGuard[int]: ...
@overload
def is_int(value: object, numpy: Literal[True]) -> TypeGuard[int | np.integer]: ...


def is_int(value: object, numpy: bool = False) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is an ``int`` to Python, never a count or an
    index to us); with ``numpy``, numpy integers too."""
    return isinstance(value, (int, np.integer) if numpy else int) and not isinstance(value, bool)
