"""``NodeLayout``: this process's place in the job (which ranks share its node), and the two
shapes a layout comes in: any grouping of ranks by host (``layout_from_hostnames``) and
torchrun's uniform blocks (``uniform_layout``). Pure functions; no environment, no torch.

Where a layout comes from (explicit arguments, a process group, torchrun, SLURM) is decided in
``resolve.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..util.checks import is_int
from ..wire.protocol import MAX_WORLD_SIZE
from .hostlist import format_ranks

__all__ = ["NodeLayout", "layout_from_hostnames", "uniform_layout", "check_node_ranks"]


def check_node_ranks(ranks: object, world_size: int) -> None:
    """Raised when ``ranks`` (a node's global ranks) is not a tuple of integers in
    ``[0, world_size)``, strictly ascending: ConfigError."""
    if not isinstance(ranks, tuple) or not all(is_int(r) for r in ranks):
        raise ConfigError(f"ranks must be a tuple of integers, got {ranks!r}")
    if any(not 0 <= r < world_size for r in ranks):
        raise ConfigError(f"ranks {format_ranks(ranks)} must lie in [0, {world_size - 1}]")
    if any(a >= b for a, b in zip(ranks, ranks[1:])):
        raise ConfigError(f"ranks must be strictly ascending without repeats, got {list(ranks)}")


@dataclass(frozen=True)
class NodeLayout:
    """Where this process sits in the job.

    ``rank`` of ``world_size`` global ranks; this node is ``node_rank`` of ``num_nodes``; the
    global ranks on this node, ascending, are ``ranks`` (any layout: nodes may run different
    numbers of ranks, and a node's ranks need not be consecutive). ``local_rank`` is this
    rank's position among them and ``local_world_size`` their number. ``source`` names where
    the layout came from: ``explicit``, ``process group``, ``torchrun``, ``slurm`` or
    ``single node``.

    Raised when a field has the wrong type or they do not fit together (a rank outside
    ``[0, world_size)``, ``ranks`` not strictly ascending or without ``rank``, ``node_rank``
    not below ``num_nodes``, more nodes than ranks): ConfigError.
    """

    rank: int
    world_size: int
    node_rank: int
    num_nodes: int
    ranks: tuple[int, ...]
    source: str = "explicit"

    def __post_init__(self) -> None:
        if not is_int(self.world_size) or not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise ConfigError(f"world_size must be an integer in [1, {MAX_WORLD_SIZE}], got {self.world_size!r}")
        if not is_int(self.rank) or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank must be an integer in [0, {self.world_size - 1}], got {self.rank!r}")
        if not is_int(self.num_nodes) or not 1 <= self.num_nodes <= self.world_size:
            raise ConfigError(f"num_nodes must be an integer in [1, {self.world_size}], got {self.num_nodes!r}")
        if not is_int(self.node_rank) or not 0 <= self.node_rank < self.num_nodes:
            raise ConfigError(f"node_rank must be an integer in [0, {self.num_nodes - 1}], got {self.node_rank!r}")
        check_node_ranks(self.ranks, self.world_size)
        if self.rank not in self.ranks:
            raise ConfigError(f"rank {self.rank} is not among this node's ranks {format_ranks(self.ranks)}")

    @property
    def local_rank(self) -> int:
        """This rank's position among the ranks on its node (0 for the lowest global rank)."""
        return self.ranks.index(self.rank)

    @property
    def local_world_size(self) -> int:
        """The number of ranks on this node."""
        return len(self.ranks)

    def to_dict(self) -> dict[str, Any]:
        """Every field and property, JSON-ready."""
        return {
            "rank": self.rank, "world_size": self.world_size, "local_rank": self.local_rank,
            "local_world_size": self.local_world_size, "node_rank": self.node_rank, "num_nodes": self.num_nodes,
            "ranks": list(self.ranks), "source": self.source,
        }

    def describe(self) -> str:
        """``"rank 5 of 8: local rank 1 of 4 on node 1 of 2 (ranks 4-7; from torchrun)"``."""
        return (f"rank {self.rank} of {self.world_size}: local rank {self.local_rank} of {self.local_world_size} "
                f"on node {self.node_rank} of {self.num_nodes} (ranks {format_ranks(self.ranks)}; from {self.source})")


def layout_from_hostnames(hostnames: Sequence[str], rank: int, source: str = "process group") -> NodeLayout:
    """The layout in which ranks with the same host name share a node: ``hostnames[r]`` is
    rank ``r``'s host. Nodes are numbered in the order of their lowest rank (torchrun's
    ``GROUP_RANK`` order, and SLURM's node order for block and cyclic distributions).

    ``layout_from_hostnames(["a", "a", "b", "a"], 3)`` -> node 0 of 2, ranks ``(0, 1, 3)``.

    Raised when ``hostnames`` is empty or holds something that is not a non-empty string,
    or ``rank`` is not one of its positions: ConfigError.
    """
    names = list(hostnames)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"every rank needs a non-empty host name, got {names[:8]!r}")
    if not is_int(rank) or not 0 <= rank < len(names):
        raise ConfigError(f"rank {rank!r} is not one of the {len(names)} ranks whose host names were gathered")
    order = list(dict.fromkeys(names))  # hosts in order of their lowest rank
    mine = names[rank]
    ranks = tuple(r for r, name in enumerate(names) if name == mine)
    return NodeLayout(rank, len(names), order.index(mine), len(order), ranks, source)


def uniform_layout(rank: int, world_size: int, local_world_size: int, source: str) -> NodeLayout:
    """torchrun's layout: ``world_size / local_world_size`` nodes of ``local_world_size``
    consecutive ranks each; node ``n`` runs ranks ``n*L .. n*L + L-1``.

    Raised when ``local_world_size`` is not a positive divisor of ``world_size`` or ``rank``
    is out of range: ConfigError (callers say which variables or arguments were wrong).
    """
    if not is_int(local_world_size) or local_world_size < 1 or not is_int(world_size) or world_size < 1 \
            or world_size % local_world_size:
        raise ConfigError(
            f"a uniform layout needs the local world size ({local_world_size!r}) to divide the world size "
            f"({world_size!r})"
        )
    if not is_int(rank) or not 0 <= rank < world_size:
        raise ConfigError(f"rank must be an integer in [0, {world_size - 1}], got {rank!r}")
    node = rank // local_world_size
    first = node * local_world_size
    return NodeLayout(rank, world_size, node, world_size // local_world_size,
                      tuple(range(first, first + local_world_size)), source)
