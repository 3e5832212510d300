"""``resolve_plan``: a node's plan from explicit values where given (``h5serve plan``'s
``--world-size``, ``--tasks-per-node``, ``--node-rank``), the SLURM environment for the rest.
Every error is a ``ConfigError`` whose message says what to do.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from ..errors import ConfigError
from ..util.checks import is_int
from ..wire.protocol import MAX_WORLD_SIZE
from .hostlist import parse_tasks_per_node
from .nodeplan import NodePlan, plan_explicit, plan_from_layout
from .slurm import node_rank_from_env, plan_and_node_count_from_env

__all__ = ["resolve_plan", "resolve_plan_and_node_count"]


def _resolve(
    world_size: int | None,
    tasks_per_node: int | str | None,
    node_rank: int | None,
    env: Mapping[str, str],
    hostname: str | None,
) -> tuple[NodePlan, int]:
    if node_rank is not None and (not is_int(node_rank) or node_rank < 0):
        raise ConfigError(f"--node-rank must be a non-negative integer, got {node_rank!r}")
    if tasks_per_node is None:
        plan, nodes = plan_and_node_count_from_env(env, hostname, node_rank)
        if world_size is not None and world_size != plan.world_size:
            raise ConfigError(
                f"--world-size {world_size} disagrees with the SLURM environment ({plan.world_size} tasks); "
                "when the training job's layout differs from this step's, pass --tasks-per-node too"
            )
        return plan, nodes
    if isinstance(tasks_per_node, str) and tasks_per_node.strip().isdigit():
        tasks_per_node = int(tasks_per_node.strip())
    if is_int(tasks_per_node):
        assert isinstance(tasks_per_node, int)
        if world_size is None:
            raise ConfigError("--tasks-per-node N needs --world-size (or pass a SLURM layout such as 4(x2))")
        if tasks_per_node < 1:
            raise ConfigError(f"--tasks-per-node must be an integer >= 1, got {tasks_per_node}")
        if not is_int(world_size) or not 1 <= world_size <= MAX_WORLD_SIZE:
            raise ConfigError(f"--world-size must be an integer in [1, {MAX_WORLD_SIZE}], got {world_size!r}")
        nodes = -(-world_size // tasks_per_node)
        if node_rank is None:
            node_rank = node_rank_from_env(env, hostname, nodes)
        return plan_explicit(world_size, tasks_per_node, node_rank), nodes
    if not isinstance(tasks_per_node, str):
        raise ConfigError(f"--tasks-per-node must be a number or a SLURM layout like 3(x2),2,1, got {tasks_per_node!r}")
    tasks = parse_tasks_per_node(tasks_per_node)
    if world_size is not None and world_size != sum(tasks):
        raise ConfigError(
            f"--world-size {world_size} disagrees with --tasks-per-node {tasks_per_node!r} ({sum(tasks)} tasks)"
        )
    if node_rank is None:
        node_rank = node_rank_from_env(env, hostname, len(tasks))
    return plan_from_layout(tasks, node_rank), len(tasks)


def resolve_plan(
    world_size: int | None = None,
    tasks_per_node: int | str | None = None,
    node_rank: int | None = None,
    *,
    env: Mapping[str, str] | None = None,
    hostname: str | None = None,
) -> NodePlan:
    """The plan from explicit values where given, the SLURM environment for the rest.

    - Nothing given: ``plan_from_env(env, hostname)``.
    - ``tasks_per_node`` an integer (or digits): ``plan_explicit(world_size, tasks_per_node,
      node_rank)``; ``world_size`` is required.
    - ``tasks_per_node`` a SLURM layout such as ``"3(x2),2,1"``: block distribution over it
      (``plan_from_layout``); ``world_size``, if given, must equal its sum. This lets a batch
      script pass its own ``$SLURM_TASKS_PER_NODE`` to a one-task-per-node helper step.
    - With a ``tasks_per_node`` but no ``node_rank``, the node index comes from
      ``SLURM_NODEID``, else from ``SLURMD_NODENAME``/``hostname`` in ``SLURM_JOB_NODELIST``.
    - Without ``tasks_per_node``: the layout comes from the environment; ``node_rank``, if
      given, picks the node (block distribution); ``world_size``, if given, must match.

    ``env`` defaults to ``os.environ`` and ``hostname`` to ``socket.gethostname()``.

    Raised when the values are out of range, disagree with each other or with the
    environment, or what is missing cannot be found in the environment: ConfigError.
    """
    env = os.environ if env is None else env
    hostname = socket.gethostname() if hostname is None else hostname
    return _resolve(world_size, tasks_per_node, node_rank, env, hostname)[0]


def resolve_plan_and_node_count(
    world_size: int | None = None,
    tasks_per_node: int | str | None = None,
    node_rank: int | None = None,
    *,
    env: Mapping[str, str] | None = None,
    hostname: str | None = None,
) -> tuple[NodePlan, int]:
    """``resolve_plan``'s plan and the number of nodes in the job (for ``NodePlan.describe``).

    Raised as ``resolve_plan`` is: ConfigError.
    """
    env = os.environ if env is None else env
    hostname = socket.gethostname() if hostname is None else hostname
    return _resolve(world_size, tasks_per_node, node_rank, env, hostname)
