"""Which global ranks run on this node, from SLURM's variables: the one reading of them.

Pure functions, no I/O (the environment and the hostname are arguments); every error is a
``ConfigError`` whose message says what to do. The variables read are listed in
``plan_from_env``.

``slurm_node`` is that reading: ``h5serve plan`` uses it (``plan_from_env``, and
``resolve_plan`` in plan.py for what is not given explicitly), and so does ``resolve_layout``
(``layout_from_slurm_env``). Inside an ``srun`` step the actual placement (``SLURM_GTIDS``)
is used, so ``--distribution=cyclic`` is right too; elsewhere, block distribution
(nodeplan.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError
from .hostlist import expand_nodelist, expand_tasks_per_node, format_ranks, parse_tasks_per_node
from .layout import NodeLayout
from .nodeplan import NodePlan, plan_from_layout

__all__ = [
    "SlurmNode",
    "layout_from_slurm_env",
    "node_rank_from_env",
    "plan_and_node_count_from_env",
    "plan_from_env",
    "slurm_node",
]


_HINT = "run inside a SLURM allocation or pass --world-size/--tasks-per-node/--node-rank"
_LAYOUT_HINT = "pass local_world_size/node_rank (or launch with torchrun) to say which ranks share a node"


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


def plan_and_node_count_from_env(
    env: Mapping[str, str], hostname: str | None, node_rank: int | None = None
) -> tuple[NodePlan, int]:
    """``plan_from_env``'s plan (of node ``node_rank`` when given: block distribution over
    the environment's layout) and the number of nodes in the layout.

    Raised as ``plan_from_env`` is: ConfigError.
    """
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
    return plan_and_node_count_from_env(env, hostname)[0]


def node_rank_from_env(env: Mapping[str, str], hostname: str | None, nodes: int) -> int:
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
