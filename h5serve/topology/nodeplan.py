"""Node plans: the global ranks one node runs (``NodePlan``), laid out like SLURM's default
``block`` distribution (and torchrun's static ``--node_rank``): node ``i`` runs the
consecutive ranks that follow the tasks of nodes ``0 .. i-1``.

``h5serve plan`` prints a plan, and a node-local daemon preloads exactly those ranks' shards.
A wrong plan never gives wrong data: clients acquire their own rank's shard and the daemon
loads whatever is asked for. A wrong plan only preloads shards nobody reads.

Pure arithmetic; where the numbers come from is slurm.py (the environment) and plan.py
(explicit values, else the environment).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..util.checks import is_int
from ..wire.protocol import MAX_WORLD_SIZE
from .hostlist import format_ranks
from .layout import check_node_ranks

__all__ = ["NodePlan", "plan_explicit", "plan_from_layout"]


@dataclass(frozen=True)
class NodePlan:
    """The global ranks one node runs.

    ``node_rank`` is the node's 0-based position in the job; ``ranks`` are the global ranks
    that run on it, ascending; ``world_size`` is the number of ranks in the whole job.

    Raised when a field has the wrong type, a rank is out of ``[0, world_size)`` or the
    ranks are not strictly ascending: ConfigError.
    """

    node_rank: int
    ranks: tuple[int, ...]
    world_size: int

    def __post_init__(self) -> None:
        if not is_int(self.node_rank) or self.node_rank < 0:
            raise ConfigError(f"node_rank must be a non-negative integer, got {self.node_rank!r}")
        if not is_int(self.world_size) or not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise ConfigError(f"world_size must be an integer in [1, {MAX_WORLD_SIZE}], got {self.world_size!r}")
        check_node_ranks(self.ranks, self.world_size)

    def to_dict(self) -> dict[str, Any]:
        """``{"node_rank": N, "ranks": [...], "world_size": W}``."""
        return {"node_rank": self.node_rank, "ranks": list(self.ranks), "world_size": self.world_size}

    def to_json(self) -> str:
        """``{"node_rank": N, "ranks": [...], "world_size": W}`` as one line of JSON."""
        return json.dumps(self.to_dict())

    def describe(self, nodes: int) -> str:
        """``"node 1 of 4: ranks 4-7 (world size 16)"`` for a job of ``nodes`` nodes."""
        return f"node {self.node_rank} of {nodes}: ranks {format_ranks(self.ranks)} (world size {self.world_size})"


def plan_from_layout(tasks_per_node: Sequence[int], node_rank: int) -> NodePlan:
    """Block distribution over a (possibly uneven) layout: node ``i`` runs the
    ``tasks_per_node[i]`` consecutive ranks that follow the tasks of nodes ``0 .. i-1``.

    ``plan_from_layout([3, 3, 2, 1], 2)`` -> ``NodePlan(node_rank=2, ranks=(6, 7), world_size=9)``.

    Raised when the layout is empty, has a negative count, has no tasks at all, or
    ``node_rank`` is not a node of it: ConfigError.
    """
    tasks = list(tasks_per_node)
    if not tasks or not all(is_int(t) and t >= 0 for t in tasks):
        raise ConfigError(f"tasks per node must be a non-empty list of non-negative integers, got {tasks!r}")
    world = sum(tasks)
    if not 1 <= world <= MAX_WORLD_SIZE:
        raise ConfigError(f"the layout {tasks!r} has {world} tasks; it needs between 1 and {MAX_WORLD_SIZE}")
    if not is_int(node_rank) or not 0 <= node_rank < len(tasks):
        raise ConfigError(
            f"node rank {node_rank!r} is out of range: the job has {len(tasks)} node(s), "
            f"so pass a --node-rank in 0-{len(tasks) - 1}"
        )
    first = sum(tasks[:node_rank])
    return NodePlan(node_rank, tuple(range(first, first + tasks[node_rank])), world)


def plan_explicit(world_size: int, tasks_per_node: int, node_rank: int) -> NodePlan:
    """Block distribution of ``world_size`` ranks, ``tasks_per_node`` per node; the last node
    may have fewer. ``plan_explicit(10, 4, 2)`` -> ranks ``(8, 9)``.

    Raised when ``world_size`` is not in ``[1, MAX_WORLD_SIZE]``, ``tasks_per_node`` is not
    at least 1, or ``node_rank`` is not in ``[0, ceil(world_size / tasks_per_node))``: ConfigError.
    """
    if not is_int(world_size) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ConfigError(f"--world-size must be an integer in [1, {MAX_WORLD_SIZE}], got {world_size!r}")
    if not is_int(tasks_per_node) or tasks_per_node < 1:
        raise ConfigError(f"--tasks-per-node must be an integer >= 1, got {tasks_per_node!r}")
    nodes = -(-world_size // tasks_per_node)
    if not is_int(node_rank) or not 0 <= node_rank < nodes:
        raise ConfigError(
            f"--node-rank {node_rank!r} is out of range: world size {world_size} with {tasks_per_node} "
            f"tasks per node is {nodes} node(s), so node ranks are 0-{nodes - 1}"
        )
    first = node_rank * tasks_per_node
    return NodePlan(node_rank, tuple(range(first, min(first + tasks_per_node, world_size))), world_size)
