"""An initialized torch.distributed process group, seen only as what ``resolve_layout``
needs from it: this rank, the world size and an all-gather of host names.

torch is imported only here, and only when asked (``current_group``): the rest of
``h5serve.topology`` works without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["GroupView", "current_group"]


@dataclass(frozen=True)
class GroupView:
    """``rank`` of ``world_size`` in a process group, and ``all_gather(hostname)`` -> every
    rank's host name in rank order (a collective: every rank of the group must call it)."""

    rank: int
    world_size: int
    all_gather: Callable[[str], list[str]]


def _all_gather_hostnames(hostname: str) -> list[str]:
    import torch.distributed as dist

    names: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(names, hostname)  # gloo on CPU; NCCL needs torch.cuda.set_device first
    return [str(name) for name in names]


def current_group() -> GroupView | None:
    """The default process group when torch.distributed is installed and initialized, else None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return GroupView(dist.get_rank(), dist.get_world_size(), _all_gather_hostnames)
