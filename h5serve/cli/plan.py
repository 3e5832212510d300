"""``h5serve plan``'s command line: its arguments (shared with ``preload --plan``) and printing.

The plans themselves come from ``h5serve.topology.plan``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping

from ..topology.nodeplan import NodePlan
from ..topology.plan import resolve_plan, resolve_plan_and_node_count

__all__ = ["add_plan_arguments", "plan_from_args", "run_plan"]


def plan_from_args(
    args: argparse.Namespace, env: Mapping[str, str] | None = None, hostname: str | None = None
) -> NodePlan:
    """``resolve_plan`` with ``args.world_size``, ``args.tasks_per_node`` and ``args.node_rank``
    (each may be missing from ``args``), as added by ``add_plan_arguments``.

    Raised as ``resolve_plan`` is: ConfigError.
    """
    return resolve_plan(
        getattr(args, "world_size", None), getattr(args, "tasks_per_node", None), getattr(args, "node_rank", None),
        env=env, hostname=hostname,
    )


def add_plan_arguments(
    parser: argparse.ArgumentParser, *, include_world_size: bool = True, include_json: bool = True
) -> None:
    """Add ``--world-size``, ``--tasks-per-node``, ``--node-rank`` and ``--json`` to ``parser``.

    Pass ``include_world_size=False`` for a parser that already has ``--world-size`` (such
    as ``preload``) and ``include_json=False`` where ``--json`` makes no sense; the values
    land in ``args.world_size``, ``args.tasks_per_node`` (a string: ``4`` or ``3(x2),2,1``),
    ``args.node_rank`` and ``args.json``, all ``None``/``False`` when not given.
    """
    if include_world_size:
        parser.add_argument("--world-size", type=int, metavar="W",
                            help="ranks in the whole job (default: from the SLURM environment)")
    parser.add_argument("--tasks-per-node", metavar="N|LAYOUT",
                        help="ranks per node, e.g. 4, or a SLURM layout like 3(x2),2,1 "
                             "(default: $SLURM_STEP_TASKS_PER_NODE / $SLURM_TASKS_PER_NODE)")
    parser.add_argument("--node-rank", type=int, metavar="I",
                        help="this node's 0-based index in the job (default: $SLURM_NODEID, else this host's "
                             "position in $SLURM_JOB_NODELIST)")
    if include_json:
        parser.add_argument("--json", action="store_true",
                            help='print {"node_rank": N, "ranks": [...], "world_size": W}')


def run_plan(args: argparse.Namespace, env: Mapping[str, str] | None = None, hostname: str | None = None) -> int:
    """Print this node's plan: ``node 1 of 4: ranks 4-7 (world size 16)``, or with ``--json``
    ``{"node_rank": 1, "ranks": [4, 5, 6, 7], "world_size": 16}``. Returns 0.

    ``env``/``hostname`` default to ``os.environ`` / ``socket.gethostname()``.

    Raised when no plan can be made (see ``resolve_plan``): ConfigError, which ``h5serve``'s
    ``main`` turns into exit code 1 with the message.
    """
    plan, nodes = resolve_plan_and_node_count(
        getattr(args, "world_size", None), getattr(args, "tasks_per_node", None), getattr(args, "node_rank", None),
        env=env, hostname=hostname,
    )
    print(plan.to_json() if getattr(args, "json", False) else plan.describe(nodes), file=sys.stdout)
    return 0
