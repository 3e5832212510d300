"""Which ranks share my node: ``resolve_layout``, the one answer for the node-scoped datasets
(and, through ``slurm_node``, the same SLURM reading as ``h5serve plan``).

Precedence, first match wins:

1. explicit arguments (``local_rank``, ``local_world_size``, ``node_rank``, ``num_nodes``):
   a uniform, torchrun-style layout of ``local_world_size`` consecutive ranks per node;
2. an initialized torch.distributed process group: every rank's host name, all-gathered
   once; ranks on the same host share a node (any layout);
3. torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
   ``GROUP_RANK``);
4. SLURM's variables inside an ``srun`` step (``SLURM_PROCID``, ``SLURM_STEP_TASKS_PER_NODE``,
   ``SLURM_GTIDS``, ``SLURM_NODEID``, ``SLURM_STEP_NODELIST``...: ``slurm_node``), any layout
   such as ``3(x2),2,1``;
5. a single node holding every rank.

A lower level that describes the same processes as the level chosen (the same rank and world
size) must agree with it about which ranks share this node; when it does not, the layout is
contradictory and ``resolve_layout`` raises a ConfigError naming the variables. (Under
``srun torchrun`` the SLURM step describes the launchers, one per node, not the ranks: it has
another world size and is not compared.)
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from ..errors import ConfigError
from ..util.checks import is_int
from .group import GroupView, current_group
from .hostlist import format_ranks
from .layout import NodeLayout, layout_from_hostnames, uniform_layout
from .slurm import layout_from_slurm_env
from .torchrun import layout_from_torchrun_env, torchrun_rank_world

__all__ = ["DETECT", "resolve_layout"]


class _Detect:
    def __repr__(self) -> str:
        return "DETECT"


DETECT = _Detect()  # resolve_layout(group=DETECT): look for an initialized torch.distributed process group

_EXPLICIT_HINT = "pass local_world_size (and node_rank) explicitly to say which ranks share this node"


def resolve_layout(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    node_rank: int | None = None,
    num_nodes: int | None = None,
    env: Mapping[str, str] | None = None,
    hostname: str | None = None,
    group: GroupView | _Detect | None = DETECT,
) -> NodeLayout:
    """This process's ``NodeLayout`` (precedence in the module docstring).

    ``rank``/``world_size``, when given, are this process's global rank and the job's size;
    they override where levels 1 and 5 take them from and must agree with levels 2-4.
    ``env`` defaults to ``os.environ``, ``hostname`` to ``socket.gethostname()``, ``group``
    to the initialized default process group, if any (``None``: do not look; a
    ``GroupView``: that one). With a process group this is a collective: call it on every
    rank.

    Explicit layouts are uniform: node ``n`` runs ranks ``n*L .. n*L+L-1`` with
    ``L = local_world_size`` (or ``world_size / num_nodes``); their rank and world size come
    from ``rank``/``world_size``, else the process group, torchrun, SLURM, else from the four
    arguments themselves (``node_rank * L + local_rank`` of ``num_nodes * L``).

    Raised when an argument has the wrong type, explicit arguments do not fit the world size
    or each other, or the environment's variables disagree with each other or with the
    process group (the message names them): ConfigError.
    """
    env = os.environ if env is None else env
    hostname = socket.gethostname() if hostname is None else hostname
    _check_arguments(rank=rank, world_size=world_size, local_rank=local_rank,
                     local_world_size=local_world_size, node_rank=node_rank, num_nodes=num_nodes)
    found = current_group() if isinstance(group, _Detect) else group
    if (local_rank, local_world_size, node_rank, num_nodes) != (None, None, None, None):
        return _explicit(rank, world_size, local_rank, local_world_size, node_rank, num_nodes, env, hostname, found)
    layout = _automatic(env, hostname, found)
    if layout is None:
        r = 0 if rank is None else rank
        w = (r + 1 if rank is not None else 1) if world_size is None else world_size
        if not r < w:
            raise ConfigError(f"rank={r} must be below world_size={w}")
        return NodeLayout(r, w, 0, 1, tuple(range(w)), "single node")
    for name, given, actual in (("rank", rank, layout.rank), ("world_size", world_size, layout.world_size)):
        if given is not None and given != actual:
            raise ConfigError(
                f"{name}={given} you passed disagrees with the {layout.source} layout ({name} {actual}); "
                f"{_EXPLICIT_HINT}"
            )
    return layout


def _check_arguments(**values: int | None) -> None:
    for name, value in values.items():
        low = 1 if name in ("world_size", "local_world_size", "num_nodes") else 0
        if value is not None and (not is_int(value) or value < low):
            raise ConfigError(f"{name} must be an integer >= {low} (or None), got {value!r}")


# --------------------------------------------------------------------------- levels 2-4


def _automatic(env: Mapping[str, str], hostname: str, group: GroupView | None) -> NodeLayout | None:
    """The first of process group, torchrun and SLURM that describes a layout, checked
    against the lower levels that describe the same processes; None when none does."""
    if group is not None:
        try:
            torchrun = layout_from_torchrun_env(env)
        except ConfigError:  # another launcher's partial variables (Lightning's sets LOCAL_RANK, not
            torchrun = None  # LOCAL_WORLD_SIZE or RANK): the process group decides, nothing to compare
    else:
        torchrun = layout_from_torchrun_env(env)
    if group is not None:
        layout = layout_from_hostnames(group.all_gather(hostname), group.rank)
        evidence = (f"the process group's host names (rank {layout.rank} of {layout.world_size} on "
                    f"{hostname!r} with ranks {format_ranks(layout.ranks)})")
        if torchrun is not None:
            _agree(layout, evidence, torchrun, _torchrun_evidence(env, torchrun))
        _agree_with_slurm(layout, evidence, env, hostname)
        return layout
    if torchrun is not None:
        _agree_with_slurm(torchrun, _torchrun_evidence(env, torchrun), env, hostname)
        return torchrun
    return _slurm(env, hostname)


def _slurm(env: Mapping[str, str], hostname: str) -> NodeLayout | None:
    try:
        return layout_from_slurm_env(env, hostname)
    except ConfigError as exc:
        raise ConfigError(f"reading which ranks share this node from SLURM's variables: {exc}") from exc


def _agree_with_slurm(layout: NodeLayout, evidence: str, env: Mapping[str, str], hostname: str) -> None:
    """Compare with the SLURM step when its tasks are these ranks (same rank and world size)."""
    if env.get("SLURM_PROCID", "").strip() != str(layout.rank) or not env.get("SLURM_STEP_TASKS_PER_NODE"):
        return
    slurm = _slurm(env, hostname)
    if slurm is not None:
        _agree(layout, evidence, slurm, _slurm_evidence(env, slurm))


def _agree(chosen: NodeLayout, chosen_evidence: str, other: NodeLayout, other_evidence: str) -> None:
    """Raised when ``other`` describes the same processes as ``chosen`` (same rank and world
    size) but another set of ranks on this node: ConfigError naming both."""
    if (other.rank, other.world_size) != (chosen.rank, chosen.world_size):
        return
    if other.ranks != chosen.ranks or other.num_nodes != chosen.num_nodes:
        raise ConfigError(
            f"contradictory layout: {chosen_evidence} puts ranks {format_ranks(chosen.ranks)} on this node "
            f"(of {chosen.num_nodes} node(s)), but {other_evidence} puts ranks {format_ranks(other.ranks)} here "
            f"(of {other.num_nodes} node(s)); fix the launch so they agree, or {_EXPLICIT_HINT}"
        )


def _torchrun_evidence(env: Mapping[str, str], layout: NodeLayout) -> str:
    shown = ", ".join(f"{name}={env[name]}" for name in
                      ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK") if env.get(name))
    return f"torchrun's {shown}"


def _slurm_evidence(env: Mapping[str, str], layout: NodeLayout) -> str:
    shown = ", ".join(f"{name}={env[name]}" for name in
                      ("SLURM_PROCID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_GTIDS") if env.get(name))
    return f"SLURM's {shown}"


# --------------------------------------------------------------------------- level 1


def _explicit(
    rank: int | None,
    world_size: int | None,
    local_rank: int | None,
    local_world_size: int | None,
    node_rank: int | None,
    num_nodes: int | None,
    env: Mapping[str, str],
    hostname: str,
    group: GroupView | None,
) -> NodeLayout:
    base, where = _rank_world(env, hostname, group)
    if base is None:
        four = (local_rank, local_world_size, node_rank, num_nodes)
        if rank is None and world_size is None and None not in four:
            assert local_rank is not None and local_world_size is not None and node_rank is not None
            assert num_nodes is not None
            if local_rank >= local_world_size or node_rank >= num_nodes:
                raise ConfigError(
                    f"local_rank={local_rank} must be below local_world_size={local_world_size} and "
                    f"node_rank={node_rank} below num_nodes={num_nodes}"
                )
            base, where = (node_rank * local_world_size + local_rank, num_nodes * local_world_size), "your arguments"
        else:
            base, where = (0, 1), "no process group, torchrun or SLURM step found: rank 0 of 1"
    r = base[0] if rank is None else rank
    w = base[1] if world_size is None else world_size
    if rank is not None and world_size is not None:
        where = "rank/world_size you passed"
    elif rank is not None or world_size is not None:
        where = f"{'rank' if rank is not None else 'world_size'} you passed, the rest {where}"
    if not r < w:
        raise ConfigError(f"rank {r} must be below world size {w} ({where})")
    if local_world_size is None:
        if num_nodes is None:
            raise ConfigError(
                f"which ranks share a node needs local_world_size or num_nodes, got only "
                f"{_shown(local_rank=local_rank, node_rank=node_rank)}"
            )
        if w % num_nodes:
            raise ConfigError(
                f"num_nodes={num_nodes} does not divide the world size {w} ({where}); explicit layouts run the "
                "same number of ranks on every node: pass a num_nodes that divides it, or local_world_size"
            )
        local_world_size = w // num_nodes
    if w % local_world_size:
        raise ConfigError(
            f"local_world_size={local_world_size} does not divide the world size {w} ({where}); explicit layouts "
            "run the same number of ranks on every node (torchrun's): pass matching values, or leave them out "
            "to take the layout from the process group, torchrun or SLURM"
        )
    layout = uniform_layout(r, w, local_world_size, "explicit")
    for name, given, actual in (("num_nodes", num_nodes, layout.num_nodes), ("node_rank", node_rank, layout.node_rank),
                                ("local_rank", local_rank, layout.local_rank)):
        if given is not None and given != actual:
            raise ConfigError(
                f"{name}={given} does not fit rank {r} of world size {w} ({where}) with local_world_size="
                f"{local_world_size}: that is {name} {actual} (node n runs ranks n*{local_world_size} .. "
                f"n*{local_world_size}+{local_world_size - 1}); pass matching values"
            )
    return layout


def _rank_world(
    env: Mapping[str, str], hostname: str, group: GroupView | None
) -> tuple[tuple[int, int] | None, str]:
    """This process's rank and world size without an all-gather: the process group, torchrun,
    SLURM, else None."""
    if group is not None:
        return (group.rank, group.world_size), "from the process group"
    found = torchrun_rank_world(env)
    if found is not None:
        return found, "from RANK/WORLD_SIZE"
    slurm = _slurm(env, hostname)
    if slurm is not None:
        return (slurm.rank, slurm.world_size), "from SLURM_PROCID/SLURM_STEP_TASKS_PER_NODE"
    return None, ""


def _shown(**values: int | None) -> str:
    given = [f"{name}={value}" for name, value in values.items() if value is not None]
    return ", ".join(given) or "nothing"
