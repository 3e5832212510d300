"""h5serve.topology: which ranks share a node (``resolve_layout``), every precedence level,
contradictions, random layouts, and a real 2-process torchrun job (gloo) that resolves its
layout through the process group's all-gather."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from h5serve.errors import ConfigError
from h5serve.topology import NodeLayout, resolve_layout
from h5serve.topology.group import GroupView
from h5serve.topology.layout import layout_from_hostnames
from h5serve.topology.slurm import plan_from_env

JOB = Path(__file__).resolve().parent.parent / "jobs" / "topology_job.py"


def group(hosts: list[str], rank: int) -> GroupView:
    """A process group as resolve_layout sees it: rank, size and the all-gather's answer."""
    return GroupView(rank, len(hosts), lambda hostname: (hosts[rank] == hostname or pytest.fail(hostname)) and hosts)


def torchrun_env(rank: int, nodes: int, per_node: int) -> dict[str, str]:
    """The variables torchrun --nnodes=nodes --nproc_per_node=per_node gives worker ``rank``."""
    return {"RANK": str(rank), "WORLD_SIZE": str(nodes * per_node), "LOCAL_RANK": str(rank % per_node),
            "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node),
            "GROUP_WORLD_SIZE": str(nodes), "ROLE_RANK": str(rank), "TORCHELASTIC_RUN_ID": "none"}


def srun_env(tasks: list[int], gtids: list[list[int]], procid: int, prefix: str = "node") -> dict[str, str]:
    """An ``srun`` task's variables: ``tasks[i]`` tasks on node ``i`` (``<prefix>0i``), which
    runs global tasks ``gtids[i]`` in local-id order; this is task ``procid``. No
    SLURM_NODEID: the node is found by host name."""
    node = next(i for i, ids in enumerate(gtids) if procid in ids)
    text = ",".join(str(t) for t in tasks)
    return {
        "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": f"{prefix}[01-{len(tasks):02d}]",
        "SLURM_TASKS_PER_NODE": text, "SLURM_NTASKS": str(sum(tasks)),
        "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": f"{prefix}[01-{len(tasks):02d}]",
        "SLURM_STEP_TASKS_PER_NODE": text, "SLURM_STEP_NUM_TASKS": str(sum(tasks)),
        "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(gtids[node].index(procid)),
        "SLURM_GTIDS": ",".join(str(g) for g in gtids[node]),
    }


def block(tasks: list[int]) -> list[list[int]]:
    out, first = [], 0
    for count in tasks:
        out.append(list(range(first, first + count)))
        first += count
    return out


HETERO = [3, 3, 2, 1]  # SLURM_TASKS_PER_NODE=3,3,2,1 (what 3(x2),2,1 expands to)
HETERO_TEXT = {**srun_env(HETERO, block(HETERO), 7), "SLURM_STEP_TASKS_PER_NODE": "3(x2),2,1",
               "SLURM_TASKS_PER_NODE": "3(x2),2,1"}

# --------------------------------------------------------------------------- each level


def test_explicit_arguments_beat_everything() -> None:
    env = {**torchrun_env(5, 2, 4), **srun_env([1, 1], [[0], [1]], 1)}
    layout = resolve_layout(local_world_size=2, env=env, hostname="node02", group=group(["a"] * 8, 5))
    assert layout == NodeLayout(5, 8, 2, 4, (4, 5), "explicit")  # rank/world from the process group
    assert (layout.local_rank, layout.local_world_size) == (1, 2)


def test_explicit_arguments_alone_describe_the_whole_layout() -> None:
    layout = resolve_layout(local_rank=1, local_world_size=4, node_rank=2, num_nodes=3, env={}, hostname="x",
                            group=None)
    assert layout == NodeLayout(9, 12, 2, 3, (8, 9, 10, 11), "explicit")


def test_explicit_num_nodes_with_world_size_from_torchrun() -> None:
    layout = resolve_layout(num_nodes=4, env=torchrun_env(5, 1, 8), hostname="x", group=None)
    assert layout == NodeLayout(5, 8, 2, 4, (4, 5), "explicit")


def test_process_group_beats_torchrun_and_slurm() -> None:
    # 5 ranks on hosts a, a, b, a, c: no uniform layout describes it; the host names do
    hosts = ["a", "a", "b", "a", "c"]
    env = {"RANK": "3", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    layout = resolve_layout(env=env, hostname="a", group=group(hosts, 3))  # another world: not compared
    assert layout == NodeLayout(3, 5, 0, 3, (0, 1, 3), "process group")
    assert layout.local_rank == 2
    assert resolve_layout(env={}, hostname="c", group=group(hosts, 4)) == NodeLayout(4, 5, 2, 3, (4,), "process group")


def test_process_group_beats_another_launchers_partial_variables() -> None:
    # Lightning's own DDP launcher sets LOCAL_RANK, NODE_RANK and WORLD_SIZE, not RANK or
    # LOCAL_WORLD_SIZE: with a process group those describe nothing to check against
    env = {"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"}
    assert resolve_layout(env=env, hostname="a", group=group(["a", "a"], 1)) == NodeLayout(1, 2, 0, 1, (0, 1),
                                                                                          "process group")
    with pytest.raises(ConfigError, match="LOCAL_RANK set but RANK"):  # without one they are an error
        resolve_layout(env=env, hostname="a", group=None)


def test_process_group_agreeing_with_torchrun() -> None:
    hosts = ["n1"] * 4 + ["n2"] * 4
    layout = resolve_layout(env=torchrun_env(6, 2, 4), hostname="n2", group=group(hosts, 6))
    assert layout == NodeLayout(6, 8, 1, 2, (4, 5, 6, 7), "process group")


def test_torchrun_beats_slurm_under_srun_torchrun() -> None:
    # srun -N2 --ntasks-per-node=1 torchrun --nproc_per_node=4: the step describes the launchers
    env = {**srun_env([1, 1], [[0], [1]], 1), **torchrun_env(6, 2, 4)}
    assert resolve_layout(env=env, hostname="node02", group=None) == NodeLayout(6, 8, 1, 2, (4, 5, 6, 7), "torchrun")


def test_slurm_step() -> None:
    env = srun_env([4, 4], block([4, 4]), 5)
    assert resolve_layout(env=env, hostname="node02", group=None) == NodeLayout(5, 8, 1, 2, (4, 5, 6, 7), "slurm")


def test_slurm_outside_a_step_is_a_single_node() -> None:
    # a batch script: SLURM_PROCID=0 is the script's own task, not a rank of the job's layout
    env = {k: v for k, v in srun_env([4, 4], block([4, 4]), 0).items() if not k.startswith("SLURM_STEP")}
    assert resolve_layout(env=env, hostname="node01", group=None) == NodeLayout(0, 1, 0, 1, (0,), "single node")


def test_single_node() -> None:
    assert resolve_layout(env={}, hostname="laptop", group=None) == NodeLayout(0, 1, 0, 1, (0,), "single node")
    layout = resolve_layout(rank=2, world_size=3, env={}, hostname="laptop", group=None)
    assert layout == NodeLayout(2, 3, 0, 1, (0, 1, 2), "single node") and layout.local_rank == 2


@pytest.mark.parametrize("procid", range(9))
def test_slurm_heterogeneous_layout_found_by_hostname(procid: int) -> None:
    node = next(i for i, ids in enumerate(block(HETERO)) if procid in ids)
    env = {**HETERO_TEXT, "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(block(HETERO)[node].index(procid)),
           "SLURM_GTIDS": ",".join(map(str, block(HETERO)[node]))}
    hostname = f"node{node + 1:02d}.cluster.example.org"  # the short name is in the node list
    layout = resolve_layout(env=env, hostname=hostname, group=None)
    assert layout == NodeLayout(procid, 9, node, 4, tuple(block(HETERO)[node]), "slurm")
    assert layout.ranks == plan_from_env(env, hostname).ranks  # the same reading as h5serve plan


def test_slurm_cyclic_distribution() -> None:
    env = srun_env([3, 3, 2], [[0, 3, 6], [1, 4, 7], [2, 5]], 4)
    layout = resolve_layout(env=env, hostname="node02", group=None)
    assert layout == NodeLayout(4, 8, 1, 3, (1, 4, 7), "slurm") and layout.local_rank == 1


def test_torchrun_env() -> None:
    layout = resolve_layout(env=torchrun_env(5, 2, 4), hostname="x", group=None)
    assert layout == NodeLayout(5, 8, 1, 2, (4, 5, 6, 7), "torchrun")
    assert (layout.local_rank, layout.local_world_size) == (1, 4)
    assert layout.to_dict() == {"rank": 5, "world_size": 8, "local_rank": 1, "local_world_size": 4, "node_rank": 1,
                                "num_nodes": 2, "ranks": [4, 5, 6, 7], "source": "torchrun"}
    assert layout.describe() == "rank 5 of 8: local rank 1 of 4 on node 1 of 2 (ranks 4-7; from torchrun)"


# --------------------------------------------------------------------------- contradictions


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"env": {**torchrun_env(3, 1, 4), "LOCAL_RANK": "4"}}, "LOCAL_RANK=4 is not below LOCAL_WORLD_SIZE=4"),
        ({"env": {**torchrun_env(3, 1, 4), "WORLD_SIZE": "10"}},
         "WORLD_SIZE=10 is not a multiple of LOCAL_WORLD_SIZE=4"),
        ({"env": {**torchrun_env(5, 2, 4), "LOCAL_RANK": "2"}},
         "RANK=5 with LOCAL_WORLD_SIZE=4 is local rank 1, but LOCAL_RANK=2"),
        ({"env": {**torchrun_env(5, 2, 4), "GROUP_RANK": "0"}},
         "GROUP_RANK=0 disagrees with RANK=5, LOCAL_WORLD_SIZE=4 (node 1)"),
        ({"env": {**torchrun_env(5, 2, 4), "GROUP_WORLD_SIZE": "3"}}, "GROUP_WORLD_SIZE=3 disagrees with WORLD_SIZE=8"),
        ({"env": {"LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2"}}, "LOCAL_RANK set but LOCAL_WORLD_SIZE not"),
        ({"env": {**torchrun_env(1, 1, 2), "LOCAL_WORLD_SIZE": "two"}}, "LOCAL_WORLD_SIZE='two' is not a non-negative"),
        # ranks launched by srun with torchrun's variables set by hand: 2 per node against SLURM's 4
        ({"env": {**srun_env([4, 4], block([4, 4]), 5), **torchrun_env(5, 4, 2)}, "hostname": "node02"},
         ("torchrun's RANK=5, WORLD_SIZE=8, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2, GROUP_RANK=2 puts ranks 4-5 on this "
         "node (of 4 node(s)), but SLURM's SLURM_PROCID=5, SLURM_STEP_TASKS_PER_NODE=4,4, SLURM_GTIDS=4,5,6,7 puts "
         "ranks 4-7 here (of 2 node(s))")),
        ({"env": {**srun_env([4, 4], block([4, 4]), 5), "SLURM_PROCID": "1"}, "hostname": "node02"},
         "SLURM_PROCID=1 is not among this node's tasks 4-7 (from SLURM_GTIDS, node 1)"),
        ({"env": {**srun_env([4, 4], block([4, 4]), 5), "SLURM_LOCALID": "4"}, "hostname": "node02"},
         "SLURM_LOCALID=4 is not below this node's 4 task(s)"),
        ({"env": srun_env([4, 4], block([4, 4]), 5), "hostname": "login1"},
         ("reading which ranks share this node from SLURM's variables: this node (hostname 'login1') is not in "
         "SLURM_STEP_NODELIST")),
        # 4 ranks on one host, but torchrun says 2 nodes of 2 (two agents on one machine)
        ({"env": torchrun_env(3, 2, 2), "hostname": "a", "group": group(["a"] * 4, 3)},
         ("the process group's host names (rank 3 of 4 on 'a' with ranks 0-3) puts ranks 0-3 on this node (of 1 "
         "node(s)), but torchrun's RANK=3, WORLD_SIZE=4, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2, GROUP_RANK=1 puts ranks "
         "2-3 here (of 2 node(s))")),
        ({"local_world_size": 3, "env": torchrun_env(5, 1, 8)},
         "local_world_size=3 does not divide the world size 8 (from RANK/WORLD_SIZE)"),
        ({"local_world_size": 4, "node_rank": 0, "env": torchrun_env(5, 1, 8)},
         ("node_rank=0 does not fit rank 5 of world size 8 (from RANK/WORLD_SIZE) with local_world_size=4: that is "
         "node_rank 1")),
        ({"local_world_size": 4, "local_rank": 0, "rank": 5, "world_size": 8},
         "local_rank=0 does not fit rank 5 of world size 8 (rank/world_size you passed)"),
        ({"num_nodes": 3, "env": torchrun_env(5, 1, 8)}, "num_nodes=3 does not divide the world size 8"),
        ({"local_world_size": 2}, ("local_world_size=2 does not divide the world size 1 (no process group, torchrun "
                                  "or SLURM step found: rank 0 of 1)")),
        ({"node_rank": 1}, "needs local_world_size or num_nodes, got only node_rank=1"),
        ({"local_rank": 2, "local_world_size": 2, "node_rank": 0, "num_nodes": 1},
         "local_rank=2 must be below local_world_size=2"),
        ({"rank": 3, "env": torchrun_env(5, 2, 4)}, "rank=3 you passed disagrees with the torchrun layout (rank 5)"),
        ({"rank": 3, "world_size": 2}, "rank=3 must be below world_size=2"),
        ({"local_world_size": 0}, "local_world_size must be an integer >= 1"),
        ({"node_rank": True}, "node_rank must be an integer >= 0"),
    ],
)
def test_contradictions_name_what_disagrees(kwargs: dict, message: str) -> None:
    kwargs = {"env": {}, "hostname": "x", "group": None, **kwargs}
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_layout(**kwargs)


def test_node_layout_validates() -> None:
    with pytest.raises(ConfigError, match="rank 3 is not among this node's ranks 0-1"):
        NodeLayout(3, 4, 0, 2, (0, 1))
    with pytest.raises(ConfigError, match="node_rank must be an integer in"):
        NodeLayout(0, 4, 2, 2, (0, 1))


# --------------------------------------------------------------------------- random layouts


def _check_partition(layouts: list[NodeLayout], world: int) -> None:
    """Every rank on exactly one node; each node's local ranks are 0..n-1; all agree on the rest."""
    by_node: dict[int, tuple[int, ...]] = {}
    for rank, layout in enumerate(layouts):
        assert (layout.rank, layout.world_size) == (rank, world)
        assert by_node.setdefault(layout.node_rank, layout.ranks) == layout.ranks
        assert layout.num_nodes == layouts[0].num_nodes
    assert sorted(r for ranks in by_node.values() for r in ranks) == list(range(world))
    assert sorted(by_node) == list(range(layouts[0].num_nodes))
    for ranks in by_node.values():
        assert sorted(layouts[r].local_rank for r in ranks) == list(range(len(ranks)))


@st.composite
def slurm_layouts(draw: st.DrawFn) -> tuple[list[int], list[list[int]]]:
    tasks = draw(st.lists(st.integers(1, 5), min_size=1, max_size=6))
    order = draw(st.permutations(range(sum(tasks))))  # any --distribution: task ids dealt to nodes at random
    gtids, first = [], 0
    for count in tasks:
        gtids.append(list(order[first:first + count]))
        first += count
    return tasks, gtids


@settings(max_examples=100, deadline=None)
@given(slurm_layouts())
def test_random_slurm_layouts_partition_the_world(layout: tuple[list[int], list[list[int]]]) -> None:
    tasks, gtids = layout
    world = sum(tasks)
    layouts = []
    for rank in range(world):
        node = next(i for i, ids in enumerate(gtids) if rank in ids)
        env = srun_env(tasks, gtids, rank)
        found = resolve_layout(env=env, hostname=f"node{node + 1:02d}", group=None)
        assert found.node_rank == node and found.ranks == plan_from_env(env, f"node{node + 1:02d}").ranks
        layouts.append(found)
    _check_partition(layouts, world)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c", "d", "e"]), min_size=1, max_size=24))
def test_random_host_assignments_partition_the_world(hosts: list[str]) -> None:
    layouts = [resolve_layout(env={}, hostname=hosts[r], group=group(hosts, r)) for r in range(len(hosts))]
    _check_partition(layouts, len(hosts))
    assert layouts == [layout_from_hostnames(hosts, r) for r in range(len(hosts))]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8))
def test_random_torchrun_layouts_partition_the_world(nodes: int, per_node: int) -> None:
    world = nodes * per_node
    layouts = [resolve_layout(env=torchrun_env(r, nodes, per_node), hostname="x", group=None) for r in range(world)]
    _check_partition(layouts, world)
    assert all(layout.local_world_size == per_node and layout.num_nodes == nodes for layout in layouts)


# --------------------------------------------------------------------------- torch stays optional


def test_no_torch_import_without_a_process_group_lookup() -> None:
    code = ("import sys; from h5serve.topology import resolve_layout; "
            "resolve_layout(env={'RANK': '1', 'WORLD_SIZE': '2', 'LOCAL_RANK': '1', 'LOCAL_WORLD_SIZE': '2'}, "
            "hostname='x', group=None); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(JOB.parents[2])})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


# --------------------------------------------------------------------------- a real process group


@pytest.mark.slow
def test_torchrun_two_ranks_resolve_through_the_process_group(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(JOB.parents[2])}
    for name in [k for k in env if k.startswith("SLURM")]:
        del env[name]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(JOB), str(tmp_path)]
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, output[-4000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, report in enumerate(reports):
        same_node = {"rank": rank, "world_size": 2, "local_rank": rank, "local_world_size": 2, "node_rank": 0,
                     "num_nodes": 1, "ranks": [0, 1]}
        assert report["default"] == {**same_node, "source": "process group"}
        assert report["group_only"] == {**same_node, "source": "process group"}
        assert report["torchrun_env"] == {**same_node, "source": "torchrun"}
        # rank r claimed host "host<r>": only an all-gather tells rank 0 that rank 1 is elsewhere
        assert report["two_hosts"] == {"rank": rank, "world_size": 2, "local_rank": 0, "local_world_size": 1,
                                       "node_rank": rank, "num_nodes": 2, "ranks": [rank], "source": "process group"}
