"""Which global ranks run on this node: SLURM hostlists, task layouts and node plans.

Pure functions, no I/O (the environment and the hostname are arguments); ``h5serve plan``'s
arguments and printing live in ``h5serve._plan_cli``. Every error is a ``ConfigError`` whose
message says what to do.

A *node plan* names the global ranks one node runs: ``h5serve plan`` prints it, and a
node-local daemon preloads exactly those ranks' shards. Ranks are laid out like SLURM's
default ``block`` distribution (and torchrun's static ``--node_rank``): node ``i`` runs the
consecutive ranks that follow the tasks of nodes ``0 .. i-1``. Inside an ``srun`` step the
actual placement (``SLURM_GTIDS``) is used instead, so ``--distribution=cyclic`` is right too.

``slurm_node`` is the one reading of "which ranks run on this node" from SLURM's variables:
``h5serve plan`` uses it, and so does ``resolve_layout`` (``layout_from_slurm_env``).

A wrong plan never gives wrong data: clients acquire their own rank's shard and the daemon
loads whatever is asked for. A wrong plan only preloads shards nobody reads.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..checks import is_int
from ..errors import ConfigError
from ..protocol import MAX_WORLD_SIZE
from .hostlist import MAX_HOSTS, expand_nodelist, expand_tasks_per_node, format_ranks, parse_tasks_per_node
from .layout import NodeLayout, check_node_ranks

__all__ = [
    "MAX_HOSTS",
    "MAX_WORLD_SIZE",
    "NodePlan",
    "SlurmNode",
    "expand_nodelist",
    "expand_tasks_per_node",
    "format_ranks",
    "layout_from_slurm_env",
    "parse_tasks_per_node",
    "plan_explicit",
    "plan_from_env",
    "plan_from_layout",
    "resolve_plan",
    "resolve_plan_and_node_count",
    "slurm_node",
]


_HINT = "run inside a SLURM allocation or pass --world-size/--tasks-per-node/--node-rank"
_LAYOUT_HINT = "pass local_world_size/node_rank (or launch with torchrun) to say which ranks share a node"


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


# --------------------------------------------------------------------------- SLURM environment


def _get(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of ``names`` that is set and not empty, with its value."""
    for name in names:
        value = env.get(name)
        if value is not None and value.strip() != "":
            return name, value.strip()
    return None


def _env_int(env: Mapping[str, str], *names: str) -> tuple[str, int] | None:
    found = _get(env, *names)
    if found is None:
        return None
    name, value = found
    if not value.isdigit():
        raise ConfigError(f"environment variable {name}={value!r} is not a non-negative integer; {_HINT}")
    return name, int(value)


@dataclass(frozen=True)
class _EnvLayout:
    tasks: list[int]
    tasks_var: str
    nodelist: list[str] | None
    nodelist_var: str | None
    in_step: bool


def _layout_from_env(env: Mapping[str, str]) -> _EnvLayout:
    """Tasks per node (and the node list, if any) of the current step or job."""
    in_step = _get(env, "SLURM_STEP_TASKS_PER_NODE") is not None
    tasks_names: tuple[str, ...]
    list_names: tuple[str, ...]
    count_names: tuple[str, ...]
    if in_step:
        tasks_names, list_names, count_names = (
            ("SLURM_STEP_TASKS_PER_NODE",), ("SLURM_STEP_NODELIST",), ("SLURM_STEP_NUM_TASKS",)
        )
    else:
        tasks_names, list_names, count_names = (
            ("SLURM_TASKS_PER_NODE",), ("SLURM_JOB_NODELIST", "SLURM_NODELIST"), ("SLURM_NTASKS", "SLURM_NPROCS")
        )
    found_tasks = _get(env, *tasks_names)
    if found_tasks is None:
        seen = sorted(k for k in env if k.startswith("SLURM"))
        where = "no SLURM variables are set" if not seen else f"{tasks_names[0]} is not set"
        raise ConfigError(f"cannot tell which ranks run on this node: {where}; {_HINT}")
    tasks_var, tasks_text = found_tasks
    found_list = _get(env, *list_names)
    nodelist = nodelist_var = None
    if found_list is not None:
        nodelist_var, list_text = found_list
        nodelist = expand_nodelist(list_text)
        tasks = expand_tasks_per_node(tasks_text, len(nodelist))
    else:
        tasks = parse_tasks_per_node(tasks_text)
    world = sum(tasks)
    if world < 1:
        raise ConfigError(f"{tasks_var}={tasks_text!r} describes no tasks at all; {_HINT}")
    count = _env_int(env, *count_names)
    if count is not None and count[1] != world:
        raise ConfigError(
            f"{count[0]}={count[1]} disagrees with {tasks_var}={tasks_text!r} ({world} tasks); "
            "the environment mixes two jobs or steps: " + _HINT
        )
    return _EnvLayout(tasks, tasks_var, nodelist, nodelist_var, in_step)


def _find_node(nodelist: list[str], name: str, what: str, nodelist_var: str) -> int | None:
    """Index of ``name`` in ``nodelist``: exact, else its short form (before the first dot)."""
    for candidate in dict.fromkeys([name, name.split(".", 1)[0]]):
        hits = [i for i, node in enumerate(nodelist) if node == candidate]
        if len(hits) > 1:
            raise ConfigError(f"{what} {candidate!r} appears {len(hits)} times in {nodelist_var}; pass --node-rank")
        if hits:
            return hits[0]
    return None


def _node_index(env: Mapping[str, str], hostname: str | None, layout: _EnvLayout) -> int:
    """This node's index in the layout: SLURM_NODEID, else SLURMD_NODENAME or ``hostname`` in
    the node list."""
    nodes = len(layout.tasks)
    node_id = _env_int(env, "SLURM_NODEID")
    node_name = _get(env, "SLURMD_NODENAME")
    if node_id is not None:
        name, index = node_id
        if index >= nodes:
            raise ConfigError(f"{name}={index} is out of range for {nodes} node(s) in {layout.tasks_var}; {_HINT}")
        if node_name is not None and layout.nodelist is not None:
            listed = _find_node(layout.nodelist, node_name[1], "SLURMD_NODENAME", layout.nodelist_var or "")
            if listed is not None and listed != index:
                raise ConfigError(
                    f"SLURM_NODEID={index} but SLURMD_NODENAME={node_name[1]!r} is node {listed} of "
                    f"{layout.nodelist_var}; the environment mixes two jobs or steps: {_HINT}"
                )
        return index
    if layout.nodelist is None:
        raise ConfigError(
            f"cannot find this node: neither SLURM_NODEID nor a node list (SLURM_JOB_NODELIST) is set; {_HINT}"
        )
    tried: list[str] = []
    for what, candidate in (("SLURMD_NODENAME", node_name[1] if node_name else None), ("hostname", hostname)):
        if not candidate:
            continue
        tried.append(f"{what} {candidate!r}")
        found = _find_node(layout.nodelist, candidate, what, layout.nodelist_var or "")
        if found is not None:
            return found
    shown = ",".join(layout.nodelist[:8]) + (",..." if len(layout.nodelist) > 8 else "")
    raise ConfigError(
        f"this node ({' / '.join(tried) or 'no SLURMD_NODENAME and no hostname'}) is not in "
        f"{layout.nodelist_var} ({shown}): run on a node of the job (e.g. through srun) or pass --node-rank"
    )


def _gtids(env: Mapping[str, str], world: int, expected: int) -> tuple[int, ...]:
    name, text = _get(env, "SLURM_GTIDS") or ("SLURM_GTIDS", "")
    try:
        ranks = sorted(int(part) for part in text.split(","))
    except ValueError as exc:
        raise ConfigError(f"{name}={text!r} is not a comma-separated list of task ids; {_HINT}") from exc
    if len(set(ranks)) != len(ranks) or any(not 0 <= r < world for r in ranks):
        raise ConfigError(f"{name}={text!r} must hold distinct task ids in [0, {world - 1}]; {_HINT}")
    if len(ranks) != expected:
        raise ConfigError(
            f"{name}={text!r} lists {len(ranks)} task(s) but SLURM_STEP_TASKS_PER_NODE gives this node {expected}; "
            f"{_HINT}"
        )
    return tuple(ranks)


@dataclass(frozen=True)
class SlurmNode:
    """This node as the SLURM environment describes it: the tasks on every node
    (``tasks_per_node``, in node-list order, from ``tasks_var``), this node's index, the
    global task ids it runs (ascending) and whether the variables are an ``srun`` step's.
    """

    tasks_per_node: tuple[int, ...]
    tasks_var: str
    node_rank: int
    ranks: tuple[int, ...]
    in_step: bool

    @property
    def world_size(self) -> int:
        return sum(self.tasks_per_node)

    @property
    def num_nodes(self) -> int:
        return len(self.tasks_per_node)

    def plan(self) -> NodePlan:
        return NodePlan(self.node_rank, self.ranks, self.world_size)


def slurm_node(env: Mapping[str, str], hostname: str | None) -> SlurmNode:
    """Which global ranks run on this node, from SLURM's variables: the one implementation
    behind both ``h5serve plan`` (``plan_from_env``) and ``resolve_layout``'s SLURM level
    (``layout_from_slurm_env``). The variables read are listed in ``plan_from_env``.

    Raised as ``plan_from_env`` is: ConfigError.
    """
    layout = _layout_from_env(env)
    index = _node_index(env, hostname, layout)
    world = sum(layout.tasks)
    if layout.in_step and _get(env, "SLURM_GTIDS") is not None:
        ranks = _gtids(env, world, layout.tasks[index])
    else:
        ranks = plan_from_layout(layout.tasks, index).ranks
    return SlurmNode(tuple(layout.tasks), layout.tasks_var, index, ranks, layout.in_step)


def layout_from_slurm_env(env: Mapping[str, str], hostname: str | None) -> NodeLayout | None:
    """This process's ``NodeLayout`` when it is a task of an ``srun`` step (a ``None``
    elsewhere: a batch script or ``salloc`` shell is no task of the layout its variables
    describe, and a lone process there is a single node).

    The rank is ``SLURM_PROCID``; the node's ranks and the world size are ``slurm_node``'s
    (``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_GTIDS``, ...), checked against ``SLURM_PROCID``
    and ``SLURM_LOCALID``.

    Raised when the step's variables are malformed or disagree (``SLURM_PROCID`` not among
    this node's tasks, ``SLURM_LOCALID`` not below its task count): ConfigError.
    """
    if _get(env, "SLURM_STEP_TASKS_PER_NODE") is None:
        return None
    node = slurm_node(env, hostname)
    procid = _env_int(env, "SLURM_PROCID")
    if procid is None:
        raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE is set but SLURM_PROCID is not; {_LAYOUT_HINT}")
    rank = procid[1]
    where = "SLURM_GTIDS" if _get(env, "SLURM_GTIDS") is not None else f"{node.tasks_var} (block distribution)"
    if rank not in node.ranks:
        raise ConfigError(
            f"SLURM_PROCID={rank} is not among this node's tasks {format_ranks(node.ranks)} (from {where}, "
            f"node {node.node_rank}); the environment mixes two steps: {_LAYOUT_HINT}"
        )
    localid = _env_int(env, "SLURM_LOCALID")
    if localid is not None and localid[1] >= len(node.ranks):
        raise ConfigError(
            f"SLURM_LOCALID={localid[1]} is not below this node's {len(node.ranks)} task(s) (from {where}); "
            f"the environment mixes two steps: {_LAYOUT_HINT}"
        )
    return NodeLayout(rank, node.world_size, node.node_rank, node.num_nodes, node.ranks, "slurm")


def _plan_from_env(
    env: Mapping[str, str], hostname: str | None, node_rank: int | None = None
) -> tuple[NodePlan, int]:
    if node_rank is not None:
        layout = _layout_from_env(env)
        return plan_from_layout(layout.tasks, node_rank), len(layout.tasks)
    node = slurm_node(env, hostname)
    return node.plan(), node.num_nodes


def plan_from_env(env: Mapping[str, str], hostname: str) -> NodePlan:
    """This node's plan from the variables SLURM sets (heterogeneous jobs are not supported).

    Variables used, and nothing else:

    1. The layout (tasks on each node, in node-list order) and its node list:

       - inside an ``srun`` step (``SLURM_STEP_TASKS_PER_NODE`` is set):
         ``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_STEP_NODELIST`` and, as a cross-check,
         ``SLURM_STEP_NUM_TASKS``;
       - otherwise (batch script, ``salloc`` shell, prolog-like environments):
         ``SLURM_TASKS_PER_NODE``, ``SLURM_JOB_NODELIST`` (else the older
         ``SLURM_NODELIST``) and, as a cross-check, ``SLURM_NTASKS`` (else ``SLURM_NPROCS``).

       The tasks-per-node text is required. The node list is optional when ``SLURM_NODEID``
       is set; when present it must have as many nodes as the tasks-per-node text. The world
       size is the sum of the tasks; the cross-check variable, if set, must equal it.

    2. This node's index: ``SLURM_NODEID`` if set (checked against ``SLURMD_NODENAME``'s
       position in the node list when both are available); else the position of
       ``SLURMD_NODENAME`` in the node list; else of ``hostname`` (exact, then its short
       name before the first dot).

    3. The ranks: inside an ``srun`` step, ``SLURM_GTIDS`` (the global task ids slurmstepd
       started on this node, right for any ``--distribution``); otherwise block
       distribution over the layout (``plan_from_layout``). ``SLURM_GTIDS`` is ignored
       outside a step, where it describes the batch script's single task.

    In a helper step such as ``srun --ntasks-per-node=1 h5serve ...`` the step's layout is
    one task per node, not the training job's: pass ``--world-size``/``--tasks-per-node``
    there (see ``resolve_plan``).

    Raised when the variables are missing ("run inside a SLURM allocation or pass
    --world-size/--tasks-per-node/--node-rank"), malformed, inconsistent with each other,
    or this node is not in the node list: ConfigError.
    """
    return _plan_from_env(env, hostname)[0]


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
        plan, nodes = _plan_from_env(env, hostname, node_rank)
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
            node_rank = _index_for_explicit(env, hostname, nodes)
        return plan_explicit(world_size, tasks_per_node, node_rank), nodes
    if not isinstance(tasks_per_node, str):
        raise ConfigError(f"--tasks-per-node must be a number or a SLURM layout like 3(x2),2,1, got {tasks_per_node!r}")
    tasks = parse_tasks_per_node(tasks_per_node)
    if world_size is not None and world_size != sum(tasks):
        raise ConfigError(
            f"--world-size {world_size} disagrees with --tasks-per-node {tasks_per_node!r} ({sum(tasks)} tasks)"
        )
    if node_rank is None:
        node_rank = _index_for_explicit(env, hostname, len(tasks))
    return plan_from_layout(tasks, node_rank), len(tasks)


def _index_for_explicit(env: Mapping[str, str], hostname: str | None, nodes: int) -> int:
    """This node's index in an explicit layout of ``nodes`` nodes: SLURM_NODEID, else
    SLURMD_NODENAME or ``hostname`` in SLURM_JOB_NODELIST (the job's, not a step's)."""
    node_id = _env_int(env, "SLURM_NODEID")
    if node_id is not None:
        if node_id[1] >= nodes:
            raise ConfigError(
                f"{node_id[0]}={node_id[1]} is out of range for the {nodes} node(s) of the layout you passed; "
                "pass --node-rank"
            )
        return node_id[1]
    found = _get(env, "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if found is None:
        raise ConfigError("--node-rank is missing and SLURM_NODEID / SLURM_JOB_NODELIST are not set; pass --node-rank")
    nodelist = expand_nodelist(found[1])
    if len(nodelist) != nodes:
        raise ConfigError(
            f"{found[0]} has {len(nodelist)} node(s) but the layout you passed has {nodes}; pass --node-rank"
        )
    return _node_index(env, hostname, _EnvLayout([0] * nodes, "--tasks-per-node", nodelist, found[0], False))


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
