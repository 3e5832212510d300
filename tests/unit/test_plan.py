"""Unit tests for h5serve.topology (hostlist, nodeplan, slurm, plan) and h5serve.cli.plan:
hostlists, task layouts, node plans, ``h5serve plan`` output.

The environment sets below are recorded from (or modelled exactly on) real SLURM jobs:
``env | grep SLURM`` in a batch script and inside ``srun`` tasks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from h5serve.cli.plan import add_plan_arguments, plan_from_args, run_plan
from h5serve.errors import ConfigError, H5ServeError
from h5serve.topology.hostlist import (
    MAX_HOSTS,
    expand_nodelist,
    expand_tasks_per_node,
    format_ranks,
    parse_tasks_per_node,
)
from h5serve.topology.nodeplan import NodePlan, plan_explicit, plan_from_layout
from h5serve.topology.plan import resolve_plan
from h5serve.topology.slurm import plan_from_env

HINT = "run inside a SLURM allocation or pass --world-size/--tasks-per-node/--node-rank"

# --------------------------------------------------------------------------- recorded environments

# sbatch -N2 --ntasks-per-node=4 --gres=gpu:4 train.sbatch; `env | grep SLURM` in the batch
# script (runs on the first node). SLURM_GTIDS=0 is the batch script's own single task.
BATCH_2X4 = {
    "SLURM_JOB_ID": "481516",
    "SLURM_JOBID": "481516",
    "SLURM_JOB_NAME": "train",
    "SLURM_JOB_USER": "alice",
    "SLURM_JOB_UID": "1000",
    "SLURM_JOB_PARTITION": "gpu",
    "SLURM_CLUSTER_NAME": "hpc",
    "SLURM_SUBMIT_HOST": "login1",
    "SLURM_SUBMIT_DIR": "/home/alice/proj",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "8",
    "SLURM_NPROCS": "8",
    "SLURM_NTASKS_PER_NODE": "4",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_CPUS_PER_NODE": "32(x2)",
    "SLURM_CPUS_ON_NODE": "32",
    "SLURM_GPUS_ON_NODE": "4",
    "SLURM_NODEID": "0",
    "SLURMD_NODENAME": "gpu07",
    "SLURM_TOPOLOGY_ADDR": "gpu07",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_GTIDS": "0",
    "SLURM_TASK_PID": "20931",
    "SLURM_PRIO_PROCESS": "0",
}

# `srun python train.py` in that job: the environment of global task 5 (node gpu08, local 1).
STEP_2X4_TASK5 = {
    **BATCH_2X4,
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_LAUNCHER_PORT": "40731",
    "SLURM_NODEID": "1",
    "SLURMD_NODENAME": "gpu08",
    "SLURM_TOPOLOGY_ADDR": "gpu08",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_GTIDS": "4,5,6,7",
    "SLURM_DISTRIBUTION": "block",
    "SLURM_TASK_PID": "51207",
}

# The same step launched with --distribution=cyclic: gpu08 runs tasks 1, 3, 5, 7.
STEP_2X4_CYCLIC_TASK3 = {**STEP_2X4_TASK5, "SLURM_PROCID": "3", "SLURM_GTIDS": "1,3,5,7",
                         "SLURM_DISTRIBUTION": "cyclic"}

# A helper step in that job: `srun -N2 -n2 --ntasks-per-node=1 --overlap h5serve ...` on gpu08.
HELPER_STEP_2X4_NODE1 = {
    **STEP_2X4_TASK5,
    "SLURM_STEP_ID": "1",
    "SLURM_STEPID": "1",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_NTASKS": "2",
    "SLURM_NPROCS": "2",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_GTIDS": "1",
}

# sbatch -n9 -w node[01-03,10] with SLURM packing 3, 3, 2 and 1 tasks; batch script on node01.
BATCH_HETERO = {
    "SLURM_JOB_ID": "77",
    "SLURM_JOB_NODELIST": "node[01-03,10]",
    "SLURM_NODELIST": "node[01-03,10]",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_NNODES": "4",
    "SLURM_NTASKS": "9",
    "SLURM_NPROCS": "9",
    "SLURM_TASKS_PER_NODE": "3(x2),2,1",
    "SLURM_JOB_CPUS_PER_NODE": "3(x2),2,1",
    "SLURM_NODEID": "0",
    "SLURMD_NODENAME": "node01",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_GTIDS": "0",
}

# sbatch -N1 -n2 on a workstation-like node.
BATCH_SINGLE = {
    "SLURM_JOB_ID": "9",
    "SLURM_JOB_NODELIST": "ws1",
    "SLURM_NODELIST": "ws1",
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_NNODES": "1",
    "SLURM_NTASKS": "2",
    "SLURM_NPROCS": "2",
    "SLURM_TASKS_PER_NODE": "2",
    "SLURM_NODEID": "0",
    "SLURMD_NODENAME": "ws1",
    "SLURM_GTIDS": "0",
}

# `salloc -N4 -n9 -w node[01-03,10]` shell and prolog-like environments: no SLURM_NODEID.
NO_NODEID_HETERO = {k: v for k, v in BATCH_HETERO.items() if k not in ("SLURM_NODEID", "SLURMD_NODENAME")}


# --------------------------------------------------------------------------- expand_nodelist


@pytest.mark.parametrize(
    "text, expected",
    [
        ("node[01-03,7],gpu-a[1-2]x,login1",
         ["node01", "node02", "node03", "node7", "gpu-a1x", "gpu-a2x", "login1"]),
        ("ws1", ["ws1"]),
        ("gpu[07-08]", ["gpu07", "gpu08"]),
        ("node[01-03,10]", ["node01", "node02", "node03", "node10"]),
        ("n[8-10]", ["n8", "n9", "n10"]),  # no padding without a leading zero
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("n[007]", ["n007"]),  # a single number is kept as written
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),  # last group varies fastest
        ("rack[1-2]-node[01-02].ib", ["rack1-node01.ib", "rack1-node02.ib", "rack2-node01.ib", "rack2-node02.ib"]),
        ("[1-3]x", ["1x", "2x", "3x"]),
        (" a1 , b[1-2] ", ["a1", "b1", "b2"]),
        ("a,a", ["a", "a"]),  # duplicates are kept: expansion is not lookup
        ("host-1.example.org", ["host-1.example.org"]),
    ],
)
def test_expand_nodelist(text: str, expected: list[str]) -> None:
    assert expand_nodelist(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("a,,b", "empty entry"),
        ("a,", "empty entry"),
        ("n[1-3", "never closed"),
        ("n1-3]", "no matching"),
        ("n[1-[2]]", "nest"),
        ("n[3-1]", "backwards"),
        ("n[a-b]", "numbers or ranges"),
        ("n[1-]", "numbers or ranges"),
        ("n[]", "numbers or ranges"),
        ("n[1,,2]", "numbers or ranges"),
        ("my node", "whitespace"),
        ("n[1, 3-4]", "whitespace"),
        ("n[0-2000000]", "more than"),
        ("a[0-1023]b[0-1023]c[0-1]", "more than"),
    ],
)
def test_expand_nodelist_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        expand_nodelist(text)


def test_nodelist_errors_are_h5serve_errors() -> None:
    with pytest.raises(H5ServeError):
        expand_nodelist("n[")
    assert MAX_HOSTS >= 65536  # the largest SLURM clusters fit


def _compress(hosts: list[tuple[str, int, int]]) -> tuple[str, list[str]]:
    """A test-only compressor: (prefix, number, width) -> 'prefix[...]' runs, and the names."""
    entries, names = [], []
    for prefix, number, width in hosts:
        name = f"{prefix}{number:0{width}d}"
        names.append(name)
        entries.append(f"{prefix}[{number:0{width}d}]" if number % 2 else name)
    return ",".join(entries), names


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["n", "gpu-", "r1c", "x.y-"]), st.integers(0, 5000), st.integers(1, 5)),
                min_size=1, max_size=30))
def test_expand_nodelist_round_trips(hosts: list[tuple[str, int, int]]) -> None:
    text, names = _compress(hosts)
    assert expand_nodelist(text) == names


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 999), st.integers(0, 200), st.integers(1, 4))
def test_range_expansion_matches_padding_rule(lo: int, span: int, width: int) -> None:
    lo_text = f"{lo:0{width}d}"
    hi = lo + span
    assert expand_nodelist(f"n[{lo_text}-{hi}]") == [f"n{n:0{len(lo_text)}d}" for n in range(lo, hi + 1)]


# --------------------------------------------------------------------------- tasks per node


@pytest.mark.parametrize(
    "text, nodes, expected",
    [
        ("3(x2),2,1", 4, [3, 3, 2, 1]),
        ("4(x2)", 2, [4, 4]),
        ("2", 1, [2]),
        ("1(x4)", 4, [1, 1, 1, 1]),
        (" 8(x3) , 4 ", 4, [8, 8, 8, 4]),
        ("2(x1)", 1, [2]),
    ],
)
def test_expand_tasks_per_node(text: str, nodes: int, expected: list[int]) -> None:
    assert expand_tasks_per_node(text, nodes) == expected
    assert parse_tasks_per_node(text) == expected


@pytest.mark.parametrize(
    "text, nodes, message",
    [
        ("3(x2),2,1", 3, "describes 4 node(s) but the node list has 3"),
        ("4(x2)", 3, "describes 2 node(s)"),
        ("", 1, "empty"),
        ("4x2", 2, "not N or N(xK)"),
        ("4(2)", 2, "not N or N(xK)"),
        ("-1", 1, "not N or N(xK)"),
        ("4(x0)", 0, "at least 1"),
        ("1,,1", 2, "not N or N(xK)"),
        ("1(x99999999999)", 1, "more than"),
    ],
)
def test_expand_tasks_per_node_errors(text: str, nodes: int, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        expand_tasks_per_node(text, nodes)


# --------------------------------------------------------------------------- NodePlan


def test_node_plan_json_and_describe() -> None:
    plan = NodePlan(node_rank=1, ranks=(4, 5, 6, 7), world_size=16)
    assert json.loads(plan.to_json()) == {"node_rank": 1, "ranks": [4, 5, 6, 7], "world_size": 16}
    assert list(json.loads(plan.to_json())) == ["node_rank", "ranks", "world_size"]
    assert plan.describe(4) == "node 1 of 4: ranks 4-7 (world size 16)"
    assert NodePlan(3, (), 9).describe(5) == "node 3 of 5: ranks none (world size 9)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.node_rank = 2  # type: ignore[misc]  # frozen
    assert plan == NodePlan(1, (4, 5, 6, 7), 16) and hash(plan) == hash(NodePlan(1, (4, 5, 6, 7), 16))


@pytest.mark.parametrize(
    "node_rank, ranks, world_size, message",
    [
        (-1, (0,), 1, "node_rank"),
        (0, (0,), 0, "world_size"),
        (0, (1,), 1, "must lie in"),
        (0, (2, 1), 3, "ascending"),
        (0, (1, 1), 3, "ascending"),
        (0, [0], 1, "tuple"),
        (True, (0,), 1, "node_rank"),
    ],
)
def test_node_plan_validates(node_rank, ranks, world_size, message) -> None:
    with pytest.raises(ConfigError, match=message):
        NodePlan(node_rank, ranks, world_size)


@pytest.mark.parametrize(
    "ranks, text", [([0, 1, 2, 3], "0-3"), ([0, 1, 2, 3, 5], "0-3,5"), ([7], "7"), ([], "none"), ([1, 3, 5], "1,3,5")]
)
def test_format_ranks(ranks: list[int], text: str) -> None:
    assert format_ranks(ranks) == text


# --------------------------------------------------------------------------- explicit plans


@pytest.mark.parametrize(
    "world, per_node, node, ranks",
    [
        (16, 4, 0, (0, 1, 2, 3)),
        (16, 4, 3, (12, 13, 14, 15)),
        (10, 4, 2, (8, 9)),  # the last node has fewer
        (1, 8, 0, (0,)),
        (5, 1, 4, (4,)),
    ],
)
def test_plan_explicit(world: int, per_node: int, node: int, ranks: tuple[int, ...]) -> None:
    assert plan_explicit(world, per_node, node) == NodePlan(node, ranks, world)


@pytest.mark.parametrize(
    "world, per_node, node, message",
    [
        (16, 4, 4,
         "--node-rank 4 is out of range: world size 16 with 4 tasks per node is 4 node(s), so node ranks are 0-3"),
        (16, 4, -1, "out of range"),
        (0, 4, 0, "--world-size"),
        (16, 0, 0, "--tasks-per-node"),
        (16, -2, 0, "--tasks-per-node"),
        (2**21, 4, 0, "--world-size"),
        (True, 4, 0, "--world-size"),
    ],
)
def test_plan_explicit_errors(world, per_node, node, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan_explicit(world, per_node, node)


def test_plan_from_layout() -> None:
    assert [plan_from_layout([3, 3, 2, 1], i).ranks for i in range(4)] == [(0, 1, 2), (3, 4, 5), (6, 7), (8,)]
    assert plan_from_layout([2, 0, 1], 1) == NodePlan(1, (), 3)
    for layout, node, message in [([], 0, "non-empty"), ([0, 0], 0, "has 0 tasks"), ([2, -1], 0, "non-negative"),
                                  ([2, 2], 2, "pass a --node-rank in 0-1")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            plan_from_layout(layout, node)


# --------------------------------------------------------------------------- recorded environments


def test_batch_2x4_first_node_ignores_batch_gtids() -> None:
    # SLURM_GTIDS=0 in the batch script describes the script, not the job: block distribution.
    assert plan_from_env(BATCH_2X4, "gpu07") == NodePlan(0, (0, 1, 2, 3), 8)


def test_batch_2x4_second_node_by_nodeid() -> None:
    env = {**BATCH_2X4, "SLURM_NODEID": "1", "SLURMD_NODENAME": "gpu08"}
    assert plan_from_env(env, "whatever") == NodePlan(1, (4, 5, 6, 7), 8)


def test_step_2x4_uses_gtids() -> None:
    assert plan_from_env(STEP_2X4_TASK5, "gpu08") == NodePlan(1, (4, 5, 6, 7), 8)
    assert plan_from_env(STEP_2X4_CYCLIC_TASK3, "gpu08") == NodePlan(1, (1, 3, 5, 7), 8)


def test_step_variables_take_precedence_over_job_variables() -> None:
    # a 2-node step in a 4-node job: the job's node list has 4 names, the step's 2
    env = {
        **STEP_2X4_TASK5,
        "SLURM_JOB_NODELIST": "gpu[05-08]", "SLURM_JOB_NUM_NODES": "4", "SLURM_TASKS_PER_NODE": "4(x4)",
    }
    assert plan_from_env(env, "gpu08") == NodePlan(1, (4, 5, 6, 7), 8)


def test_heterogeneous_layout_every_node() -> None:
    expected = {"node01": (0, 1, 2), "node02": (3, 4, 5), "node03": (6, 7), "node10": (8,)}
    for index, (name, ranks) in enumerate(expected.items()):
        env = {**BATCH_HETERO, "SLURM_NODEID": str(index), "SLURMD_NODENAME": name}
        assert plan_from_env(env, name) == NodePlan(index, ranks, 9)


def test_single_node() -> None:
    assert plan_from_env(BATCH_SINGLE, "ws1") == NodePlan(0, (0, 1), 2)


def test_lookup_by_slurmd_nodename_beats_hostname() -> None:
    env = {**NO_NODEID_HETERO, "SLURMD_NODENAME": "node03"}
    # hostname is the interface name (NodeHostname differs from NodeName): SLURMD_NODENAME wins
    assert plan_from_env(env, "node03-ib0.cluster") == NodePlan(2, (6, 7), 9)


def test_lookup_by_hostname_argument_full_and_short() -> None:
    assert plan_from_env(NO_NODEID_HETERO, "node10") == NodePlan(3, (8,), 9)
    assert plan_from_env(NO_NODEID_HETERO, "node02.cluster.example.org") == NodePlan(1, (3, 4, 5), 9)


def test_hostname_falls_back_when_slurmd_nodename_is_not_listed() -> None:
    env = {**NO_NODEID_HETERO, "SLURMD_NODENAME": "elsewhere"}
    assert plan_from_env(env, "node01") == NodePlan(0, (0, 1, 2), 9)


def test_nodeid_without_nodelist_is_enough() -> None:
    env = {"SLURM_TASKS_PER_NODE": "3(x2),2,1", "SLURM_NODEID": "2", "SLURM_NTASKS": "9"}
    assert plan_from_env(env, "anything") == NodePlan(2, (6, 7), 9)


def test_legacy_slurm_nodelist_and_nprocs() -> None:
    env = {"SLURM_NODELIST": "c[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NPROCS": "4"}
    assert plan_from_env(env, "c2") == NodePlan(1, (2, 3), 4)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=12).filter(lambda t: sum(t) > 0))
def test_every_rank_on_exactly_one_node_from_env(tasks: list[int]) -> None:
    """Property: over all node plans of a job, every global rank appears exactly once."""
    nodelist = f"n[{0:03d}-{len(tasks) - 1:03d}]"
    compressed = ",".join(str(t) for t in tasks)
    seen: list[int] = []
    for index in range(len(tasks)):
        by_name = {"SLURM_JOB_NODELIST": nodelist, "SLURM_TASKS_PER_NODE": compressed, "SLURM_NTASKS": str(sum(tasks))}
        plan = plan_from_env(by_name, f"n{index:03d}")
        assert plan == plan_from_env({**by_name, "SLURM_NODEID": str(index)}, "ignored")
        assert plan.node_rank == index and plan.world_size == sum(tasks) and len(plan.ranks) == tasks[index]
        seen.extend(plan.ranks)
    assert sorted(seen) == list(range(sum(tasks))) and len(seen) == len(set(seen))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 600), st.integers(1, 64))
def test_every_rank_on_exactly_one_node_explicit(world: int, per_node: int) -> None:
    nodes = -(-world // per_node)
    plans = [plan_explicit(world, per_node, node) for node in range(nodes)]
    seen = [rank for plan in plans for rank in plan.ranks]
    assert seen == list(range(world))
    assert all(0 < len(p.ranks) <= per_node for p in plans)
    with pytest.raises(ConfigError):
        plan_explicit(world, per_node, nodes)


# --------------------------------------------------------------------------- environment errors


@pytest.mark.parametrize(
    "env, hostname, message",
    [
        ({}, "laptop", "no SLURM variables are set; " + HINT),
        ({"PATH": "/usr/bin"}, "laptop", "no SLURM variables are set"),
        ({"SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "1"}, "gpu07",
         "SLURM_TASKS_PER_NODE is not set; " + HINT),
        ({"SLURM_TASKS_PER_NODE": "4(x2)"}, "gpu07", "neither SLURM_NODEID nor a node list"),
        ({**BATCH_2X4, "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_NODELIST": "gpu[07-09]"}, "gpu07",
         "describes 2 node(s) but the node list has 3"),
        ({**BATCH_2X4, "SLURM_NTASKS": "6"}, "gpu07",
         "SLURM_NTASKS=6 disagrees with SLURM_TASKS_PER_NODE='4(x2)' (8 tasks)"),
        ({**STEP_2X4_TASK5, "SLURM_STEP_NUM_TASKS": "7"}, "gpu08", "SLURM_STEP_NUM_TASKS=7 disagrees"),
        ({**BATCH_2X4, "SLURM_NODEID": "2"}, "gpu07", "SLURM_NODEID=2 is out of range for 2 node(s)"),
        ({**BATCH_2X4, "SLURM_NODEID": "one"}, "gpu07", "SLURM_NODEID='one' is not a non-negative integer"),
        ({**BATCH_2X4, "SLURM_NODEID": "1"}, "gpu07", "SLURM_NODEID=1 but SLURMD_NODENAME='gpu07' is node 0"),
        (NO_NODEID_HETERO, "login1", "this node (hostname 'login1') is not in SLURM_JOB_NODELIST"),
        ({**NO_NODEID_HETERO, "SLURMD_NODENAME": "x9"}, "", "SLURMD_NODENAME 'x9'"),
        ({**NO_NODEID_HETERO, "SLURM_JOB_NODELIST": "a,a,b,c", "SLURM_NODELIST": "a,a,b,c"}, "a", "appears 2 times"),
        ({**BATCH_2X4, "SLURM_TASKS_PER_NODE": "0(x2)", "SLURM_NTASKS": "0"}, "gpu07", "no tasks at all"),
        ({**BATCH_2X4, "SLURM_JOB_NODELIST": "gpu[07-08"}, "gpu07", "never closed"),
        ({**STEP_2X4_TASK5, "SLURM_GTIDS": "4,5,x"}, "gpu08", "SLURM_GTIDS='4,5,x' is not a comma-separated list"),
        ({**STEP_2X4_TASK5, "SLURM_GTIDS": "4,5,6,8"}, "gpu08", "distinct task ids in [0, 7]"),
        ({**STEP_2X4_TASK5, "SLURM_GTIDS": "4,5,6"}, "gpu08",
         "lists 3 task(s) but SLURM_STEP_TASKS_PER_NODE gives this node 4"),
    ],
)
def test_plan_from_env_errors(env: dict[str, str], hostname: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan_from_env(env, hostname)


def test_missing_environment_message_says_what_to_do() -> None:
    with pytest.raises(ConfigError) as info:
        plan_from_env({}, "laptop")
    assert str(info.value).endswith(HINT)


# --------------------------------------------------------------------------- resolve_plan / args


def test_resolve_explicit_ignores_environment() -> None:
    assert resolve_plan(16, 4, 2, env=BATCH_2X4, hostname="gpu07") == NodePlan(2, (8, 9, 10, 11), 16)
    assert resolve_plan(16, "4", 3, env={}, hostname="x") == NodePlan(3, (12, 13, 14, 15), 16)


def test_resolve_helper_step_with_explicit_layout_takes_node_from_environment() -> None:
    # In a one-task-per-node helper step the environment describes the helper step ...
    assert plan_from_env(HELPER_STEP_2X4_NODE1, "gpu08") == NodePlan(1, (1,), 2)
    # ... so the batch script passes its own layout; the node still comes from SLURM_NODEID.
    assert resolve_plan(8, 4, env=HELPER_STEP_2X4_NODE1, hostname="gpu08") == NodePlan(1, (4, 5, 6, 7), 8)
    assert resolve_plan(None, "4(x2)", env=HELPER_STEP_2X4_NODE1, hostname="gpu08") == NodePlan(1, (4, 5, 6, 7), 8)
    assert resolve_plan(9, "3(x2),2,1", env=NO_NODEID_HETERO, hostname="node03") == NodePlan(2, (6, 7), 9)


def test_resolve_from_environment_with_overrides() -> None:
    assert resolve_plan(env=STEP_2X4_TASK5, hostname="gpu08") == NodePlan(1, (4, 5, 6, 7), 8)
    assert resolve_plan(8, env=BATCH_2X4, hostname="gpu07") == NodePlan(0, (0, 1, 2, 3), 8)
    assert resolve_plan(node_rank=3, env=BATCH_HETERO, hostname="node01") == NodePlan(3, (8,), 9)
    # torchrun with 4 processes per node under `srun --ntasks-per-node=1`: the layout is explicit
    torchrun_env = {**HELPER_STEP_2X4_NODE1}
    assert resolve_plan(8, 4, env=torchrun_env, hostname="gpu08").ranks == (4, 5, 6, 7)


@pytest.mark.parametrize(
    "args, env, hostname, message",
    [
        ((None, 4, 0), {}, "x", "--tasks-per-node N needs --world-size"),
        ((16, 4, None), {}, "x", "--node-rank is missing and SLURM_NODEID / SLURM_JOB_NODELIST are not set"),
        ((16, 4, None), {"SLURM_JOB_NODELIST": "n[1-4]"}, "login1",
         "this node (hostname 'login1') is not in SLURM_JOB_NODELIST"),
        ((16, 4, None), {"SLURM_JOB_NODELIST": "n[1-3]"}, "n1", "has 3 node(s) but the layout you passed has 4"),
        ((8, 4, None), HELPER_STEP_2X4_NODE1 | {"SLURM_NODEID": "5"}, "gpu08", "SLURM_NODEID=5 is out of range"),
        ((16, "3(x2)", 0), {}, "x", "--world-size 16 disagrees with --tasks-per-node '3(x2)' (6 tasks)"),
        ((16, None, None), BATCH_2X4, "gpu07", "--world-size 16 disagrees with the SLURM environment (8 tasks)"),
        ((16, 4, -1), {}, "x", "--node-rank must be a non-negative integer"),
        ((16, "four", 0), {}, "x", "not N or N(xK)"),
        ((16, 4.0, 0), {}, "x", "--tasks-per-node must be a number or a SLURM layout"),
        ((None, None, None), {}, "x", HINT),
        ((None, None, 5), BATCH_2X4, "gpu07", "out of range"),
    ],
)
def test_resolve_plan_errors(args, env, hostname, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_plan(*args, env=env, hostname=hostname)


def test_resolve_plan_defaults_to_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("SLURM")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x3)")
    monkeypatch.setenv("SLURM_NODEID", "2")
    assert resolve_plan() == NodePlan(2, (4, 5), 6)


def _parser(**kwargs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="h5serve plan")
    add_plan_arguments(parser, **kwargs)
    return parser


def test_add_plan_arguments_defaults() -> None:
    args = _parser().parse_args([])
    assert (args.world_size, args.tasks_per_node, args.node_rank, args.json) == (None, None, None, False)
    args = _parser().parse_args(["--world-size", "16", "--tasks-per-node", "3(x2),2,1", "--node-rank", "1", "--json"])
    assert (args.world_size, args.tasks_per_node, args.node_rank, args.json) == (16, "3(x2),2,1", 1, True)


def test_add_plan_arguments_next_to_an_existing_world_size() -> None:
    preload = argparse.ArgumentParser(prog="h5serve preload")
    preload.add_argument("--world-size", type=int, required=True)
    add_plan_arguments(preload, include_world_size=False, include_json=False)
    args = preload.parse_args(["--world-size", "8", "--tasks-per-node", "4"])
    assert not hasattr(args, "json")
    assert plan_from_args(args, env=HELPER_STEP_2X4_NODE1, hostname="gpu08") == NodePlan(1, (4, 5, 6, 7), 8)


def test_add_plan_arguments_usage_errors() -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--node-rank", "one"])


@pytest.mark.parametrize(
    "argv, env, hostname, expected",
    [
        (["--world-size", "16", "--tasks-per-node", "4", "--node-rank", "0"], {}, "x",
         "node 0 of 4: ranks 0-3 (world size 16)"),
        (["--world-size", "10", "--tasks-per-node", "4", "--node-rank", "2"], {}, "x",
         "node 2 of 3: ranks 8-9 (world size 10)"),
        ([], STEP_2X4_TASK5, "gpu08", "node 1 of 2: ranks 4-7 (world size 8)"),
        ([], STEP_2X4_CYCLIC_TASK3, "gpu08", "node 1 of 2: ranks 1,3,5,7 (world size 8)"),
        ([], NO_NODEID_HETERO, "node10", "node 3 of 4: ranks 8 (world size 9)"),
        ([], BATCH_SINGLE, "ws1", "node 0 of 1: ranks 0-1 (world size 2)"),
        (["--tasks-per-node", "3(x2),2,1"], {"SLURM_NODEID": "1"}, "x", "node 1 of 4: ranks 3-5 (world size 9)"),
    ],
)
def test_run_plan_human(capsys: pytest.CaptureFixture[str], argv, env, hostname, expected) -> None:
    assert run_plan(_parser().parse_args(argv), env=env, hostname=hostname) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_run_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_plan(_parser().parse_args(["--json"]), env=BATCH_HETERO, hostname="node01") == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert json.loads(out) == {"node_rank": 0, "ranks": [0, 1, 2], "world_size": 9}


def test_run_plan_error_is_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=re.escape(HINT)):
        run_plan(_parser().parse_args([]), env={}, hostname="laptop")
    assert capsys.readouterr().out == ""
