"""Cluster topology: which ranks share my node.

    hostlist.py   SLURM's compact notations (node[01-03,7], 3(x2),2,1, 0-3,5)
    slurm.py      SLURM's variables -> this node's tasks (``slurm_node``)
    nodeplan.py   ``NodePlan``: the ranks one node runs, block distribution
    plan.py       ``resolve_plan``: explicit values > SLURM's variables (``h5serve plan``)
    torchrun.py   torchrun's variables -> its uniform layout
    group.py      an initialized torch.distributed process group (torch imported only there)
    layout.py     ``NodeLayout`` and the layouts it comes in (by host name, uniform)
    resolve.py    ``resolve_layout``: explicit > process group > torchrun > SLURM > single node

Nothing here imports torch unless ``resolve_layout`` looks for a process group.

May import: h5serve.wire (its limit on the world size), h5serve.util, h5serve.errors
"""

from __future__ import annotations

from .layout import NodeLayout
from .nodeplan import NodePlan
from .plan import resolve_plan
from .resolve import DETECT, resolve_layout

__all__ = ["DETECT", "NodeLayout", "NodePlan", "resolve_layout", "resolve_plan"]
