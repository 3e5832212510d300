"""Multi-node training on the namespace cluster (tests/cluster): ``torchrun --nnodes=2
--nproc_per_node=2`` with c10d rendezvous on node 0 and gloo, a real daemon per node, every mode:
every rank on shared memory, every row once per epoch across the 4 ranks, h5py's bytes, each
node's /dev/shm holding only what its ranks need; a second job attaching without loading; a node
without a daemon giving the same sequences; a daemon SIGKILLed on one node mid-job hanging
nothing; a 2-node job resumed from its checkpoint on 1 node x 3 ranks and on 3 nodes x 1 rank."""

from __future__ import annotations

import json
import threading
import time
import zlib
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from h5serve.segments.arena import ARENA_MARK

from ..helpers import wait_for
from . import Cluster, NodeDaemon, kill_tree
from .conftest import ROWS
from .launch import JobRun, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(300)]

MODES = ("global", "node", "contiguous", "interleave", "stream")
SHM_MODES = MODES[:4]  # the modes with one segment per selection (stream: one per block, dealt per epoch)
BATCH, SEED, CHECKPOINT_AT = 32, 42, 3  # the job's make_loader: batch 32, seed 42
BLOCK_ROWS = 64
STREAM = ["--window", "16KiB", "--block-rows", str(BLOCK_ROWS)]  # 4 blocks of 16 in the window
DEADLINE = 200  # seconds for one job, everything killed past it


@dataclass(frozen=True)
class Reference:
    """The first 2x2 job, on fresh daemons: its run, where it wrote, and each node's daemon
    status and /dev/shm right after it."""

    run: JobRun
    out: Path
    status: tuple[dict, ...]
    shm: tuple[dict[str, int], ...]


def flat(batches: list[list[int]]) -> list[int]:
    return list(chain.from_iterable(batches))


def labels(report: dict, mode: str, epoch: int) -> list[int]:
    return flat(report["modes"][mode]["epochs"][epoch])


def crc_of(x_all: np.ndarray, batches: list[list[int]]) -> int:
    """crc32 of h5py's x rows of ``batches``, in order: what the job hashed of the rows it got."""
    crc = 0
    for batch in batches:
        crc = zlib.crc32(np.ascontiguousarray(x_all[batch]).tobytes(), crc)
    return crc


def assert_bytes(x_all: np.ndarray, report: dict, modes: tuple[str, ...] | list[str]) -> None:
    """Every batch ``report``'s rank trained on, in ``modes``, is h5py's rows of the test's file."""
    for mode in modes:
        got = report["modes"][mode]
        assert got["differed"] == 0, mode
        if "epochs" in got:
            assert got["crcs"] == [crc_of(x_all, batches) for batches in got["epochs"]], mode
        else:
            assert got["resumed_crc"] == crc_of(x_all, got["resumed"]), mode


def without_arenas(shm: dict[str, int]) -> dict[str, int]:
    """A node's /dev/shm but the daemon's stream arenas (segments/arena.py)."""
    return {name: size for name, size in shm.items() if ARENA_MARK not in name}


def rows_of(selection: str) -> range:
    start, stop, step = (int(x) for x in selection.split(":"))
    return range(start, stop, step)


def job(c: Cluster, nodes: int, nproc: int, name: str, *args: str, **kwargs) -> JobRun:
    out = c.shared / name
    run = torchrun(c.nodes[:nodes], nproc, [str(c.shared / "train.h5"), str(out), *args], out, DEADLINE, **kwargs)
    assert run.ok, run.explain()
    assert len(run.reports) == nodes * nproc
    return run


@pytest.fixture(scope="module")
def x_all(data: Path) -> np.ndarray:
    with h5py.File(data) as f:
        return f["x"][:]


@pytest.fixture(scope="module")
def first(nodes3: Cluster, data: Path, daemons: list[NodeDaemon]) -> Reference:
    run = job(nodes3, 2, 2, "first", "--checkpoint-at", str(CHECKPOINT_AT), *STREAM)
    return Reference(run, nodes3.shared / "first", tuple(d.status() for d in daemons),
                     tuple(n.shm() for n in nodes3.nodes))


def test_every_mode_sees_every_row_once_per_epoch_on_shm(first: Reference, x_all: np.ndarray) -> None:
    reports = first.run.reports
    for r in reports:
        assert_bytes(x_all, r, MODES)  # every batch's bytes are h5py's
    assert len(first.run.by_host()) == 2 and {len(v) for v in first.run.by_host().values()} == {2}
    for mode in MODES:
        each = [r["modes"][mode] for r in reports]
        assert [e["backend"] for e in each] == ["shm"] * 4, mode  # stream too: its blocks are the daemon's segments
        for epoch in range(2):
            batches = [e["epochs"][epoch] for e in each]
            assert len({len(b) for b in batches}) == 1, mode  # equal batch counts (or the all-reduce hangs)
            rows = flat([flat(b) for b in batches])
            if mode == "stream":  # equal samples on every rank: padding repeats a few rows
                assert set(rows) == set(range(ROWS)) and len(rows) - ROWS < 4 * BATCH
            else:
                assert sorted(rows) == list(range(ROWS)), mode
            for e, b in zip(each, batches):
                assert set(flat(b)) <= set(rows_of(e["selection"])), mode  # only the dataset's rows
        assert each[0]["epochs"][0] != each[0]["epochs"][1], mode  # reshuffled per epoch
    for r in reports:  # global: DistributedSampler's exact order, across nodes
        for epoch in range(2):
            sampler = DistributedSampler(range(ROWS), num_replicas=4, rank=r["rank"], seed=SEED)
            sampler.set_epoch(epoch)
            assert labels(r, "global", epoch) == list(sampler)
    hosts = first.run.by_host()
    for epoch in range(2):  # stream: each epoch's blocks are dealt to nodes, no block read on both
        blocks = [{row // BLOCK_ROWS for r in ranks for row in labels(r, "stream", epoch)} for ranks in hosts.values()]
        assert not blocks[0] & blocks[1] and len(blocks[0] | blocks[1]) == -(-ROWS // BLOCK_ROWS)


def test_each_node_holds_only_what_its_ranks_need(nodes3: Cluster, first: Reference) -> None:
    hosts = first.run.by_host()
    node_rows = []
    for i, node in enumerate(nodes3.nodes):
        segments = first.status[i]["segments"]
        ranks = hosts.get(node.hostname, [])
        held = sorted((s["mode"], s["key"], s["selection"]) for s in segments if s["mode"] != "stream")
        want = sorted({(m, key, r["modes"][m]["selection"]) for r in ranks for m in SHM_MODES for key in ("x", "y")})
        assert held == want, node.hostname  # nothing another node's ranks need, nothing twice
        # stream: the blocks still resident are blocks this node's ranks read (dealt to it in some epoch)
        read_here = {row for r in ranks for epoch in range(2) for row in labels(r, "stream", epoch)}
        blocks = [s for s in segments if s["mode"] == "stream"]
        assert all(set(rows_of(s["selection"])) <= read_here for s in blocks), node.hostname
        # and nothing else in its /dev/shm but the stream's arenas (x's and y's; a finished
        # stream's arena is removed once nobody has had it open for ARENA_GRACE_S)
        assert set(without_arenas(first.shm[i])) == {s["name"] for s in segments}
        assert len(set(first.shm[i]) - set(without_arenas(first.shm[i]))) <= (2 if ranks else 0)
        assert all(s["rows"] == len(rows_of(s["selection"])) for s in segments)
        whole = [s for s in segments if s["mode"] == "global"]
        assert len(whole) == (2 if ranks else 0) and all(s["whole_file"] for s in whole)  # the file once
        node_rows.append({row for s in segments if s["mode"] == "node" for row in rows_of(s["selection"])})
    assert len(node_rows[0]) == len(node_rows[1]) == ROWS // 2 and not node_rows[0] & node_rows[1]
    assert first.shm[2] == {}  # the node that ran no rank holds nothing


def test_a_second_job_attaches_without_loading(nodes3: Cluster, daemons: list[NodeDaemon], first: Reference,
                                               x_all: np.ndarray) -> None:
    before = [d.status()["counters"] for d in daemons[:2]]
    run = job(nodes3, 2, 2, "second", "--modes", ",".join(SHM_MODES), "--epochs", "1")
    after = [d.status()["counters"] for d in daemons[:2]]
    for b, a in zip(before, after):
        assert (a["loads_requested"], a["loads"]) == (b["loads_requested"], b["loads"])  # loaded nothing
        assert a["hits"] == b["hits"] + 2 * 2 * len(SHM_MODES)  # 2 ranks x (x, y) x mode, all attached
    for r, ref in zip(run.reports, first.run.reports):
        assert_bytes(x_all, r, SHM_MODES)
        for mode in SHM_MODES:
            assert r["modes"][mode]["backend"] == "shm"
            assert labels(r, mode, 0) == labels(ref, mode, 0)


def test_a_node_without_a_daemon_gives_identical_sequences(nodes3: Cluster, first: Reference,
                                                           x_all: np.ndarray) -> None:
    """Node 1's clients point at a runtime dir where nothing runs: they read lazily (fallback)
    and every rank sees what it saw with both nodes on shared memory, batch for batch."""
    quiet = without_arenas(nodes3.node(1).shm())  # the first job's arenas may go meanwhile (ARENA_GRACE_S)
    run = job(nodes3, 2, 2, "lazy", "--modes", ",".join(SHM_MODES), "--fallback", "lazy",
              env={1: {"H5SERVE_RUNTIME_DIR": "/run/h5s-nothing"}})
    for r, ref in zip(run.reports, first.run.reports):
        assert r["host"] == ref["host"]
        on_node1 = r["host"] == nodes3.node(1).hostname
        assert_bytes(x_all, r, SHM_MODES)
        for mode in SHM_MODES:
            assert r["modes"][mode]["backend"] == ("lazy" if on_node1 else "shm")
            assert r["modes"][mode]["epochs"] == ref["modes"][mode]["epochs"], mode
    assert without_arenas(nodes3.node(1).shm()) == quiet


@pytest.mark.parametrize("num_nodes, nproc", [(1, 3), (3, 1)], ids=["1x3", "3x1"])
def test_a_2x2_checkpoint_resumes_on_another_layout(nodes3: Cluster, daemons: list[NodeDaemon], first: Reference,
                                                    x_all: np.ndarray, num_nodes: int, nproc: int) -> None:
    """global: elastic, exactly the rest of the epoch's permutation dealt to the 3 new ranks
    (docs/usage.md, "Global mode"); node: a mid-epoch resume on another layout is refused with a
    ConfigError, and ``next_epoch=True`` starts the next epoch, every row once."""
    run = job(nodes3, num_nodes, nproc, f"resume-{num_nodes}x{nproc}", "--modes", "global,node",
              "--resume-from", str(first.out))
    world = num_nodes * nproc
    state = json.loads((first.out / "state-global.json").read_text())
    consumed = 4 * CHECKPOINT_AT * BATCH
    assert (state["epoch"], state["world_size"], state["consumed_global"]) == (1, 4, consumed)
    perm = torch.randperm(ROWS, generator=torch.Generator().manual_seed(SEED + 1)).tolist()
    trained = flat([labels(r, "global", 1)[:CHECKPOINT_AT * BATCH] for r in first.run.reports])
    assert sorted(trained) == sorted(perm[:consumed])  # what the 2x2 job had trained on at its checkpoint
    rest = perm[consumed:]
    rest += rest[:(-len(rest)) % world]  # padded to a multiple of the new world size, as DistributedSampler pads
    for r in run.reports:
        assert_bytes(x_all, r, ("global", "node"))
        g = r["modes"]["global"]
        assert (g["backend"], g["refused"], g["resumed_epoch"]) == ("shm", None, 1)
        assert flat(g["resumed"]) == rest[r["rank"]::world]
    seen = []
    for r in run.reports:
        n = r["modes"]["node"]
        assert n["backend"] == "shm"
        assert "layout" in n["refused"] and "next_epoch=True" in n["refused"], n["refused"]
        assert n["resumed_epoch"] == 2
        assert set(flat(n["resumed"])) <= set(rows_of(n["selection"]))
        seen += flat(n["resumed"])
    assert set(seen) == set(range(ROWS)) and len(seen) - ROWS < world  # every row, padding aside


@pytest.mark.parametrize("fallback", ["lazy", "error"])
def test_a_daemon_killed_mid_job_hangs_nothing(nodes3: Cluster, data: Path, first: Reference, x_all: np.ndarray,
                                               fallback: str) -> None:
    """Both nodes' ranks pause after epoch 0 of global mode; node 1's daemon is SIGKILLed; the job
    goes on to epoch 1 (from the segments the ranks mapped) and to node mode. With
    ``fallback="lazy"`` node 1's ranks read node mode lazily and every rank's sequence is the
    undisturbed job's; with ``"error"`` they fail with DaemonUnavailable. Either way the job ends
    well within the deadline, and node 0 keeps its daemon and its segments intact."""
    runtime_dir = "/run/h5s-kill"  # daemons of this test alone
    node0, node1 = nodes3.nodes[:2]
    out, go = nodes3.shared / f"kill-{fallback}", nodes3.shared / f"kill-{fallback}-go"
    killed: list[NodeDaemon] = []
    started: list = []
    result: list[JobRun] = []
    try:
        killed = [node.start_daemon(runtime_dir=runtime_dir) for node in (node0, node1)]
        env = {i: {"H5SERVE_RUNTIME_DIR": runtime_dir} for i in (0, 1)}
        args = [str(data), str(out), "--modes", "global,node", "--fallback", fallback, "--pause", "global",
                "--go-file", str(go)]
        thread = threading.Thread(target=lambda: result.append(torchrun(nodes3.nodes[:2], 2, args, out, DEADLINE,
                                                                        env=env, started=started)))
        thread.start()
        assert wait_for(lambda: len(list(out.glob("paused-rank*"))) == 4 or not thread.is_alive(), 120)
        assert thread.is_alive(), result[0].explain() if result else "the job ended before pausing"
        loads = killed[0].status()["counters"]["loads"]
        killed[1].kill()
        assert wait_for(lambda: not killed[1].alive(), 10)
        go.touch()
        began = time.monotonic()
        thread.join(DEADLINE + 30)
        assert not thread.is_alive() and result
        run = result[0]
        assert all(code is not None for code in run.returncodes), run.explain()  # no node hung
        assert time.monotonic() - began < 90, run.explain()
        if fallback == "lazy":
            assert run.ok, run.explain()
            for r, ref in zip(run.reports, first.run.reports):
                assert r["host"] == ref["host"]
                on_node1 = r["host"] == node1.hostname
                assert_bytes(x_all, r, ("global", "node"))
                assert r["modes"]["global"]["backend"] == "shm"  # mapped before the kill, read after it
                assert r["modes"]["node"]["backend"] == ("lazy" if on_node1 else "shm")
                for mode in ("global", "node"):
                    assert r["modes"][mode]["epochs"] == ref["modes"][mode]["epochs"], mode
            assert killed[0].status()["counters"]["loads"] == loads + 2  # node 0: its node block, x and y
        else:  # node 1's ranks fail, saying why; node 0's then lose their peers and end too
            assert run.returncodes[1] != 0 and "DaemonUnavailable: no h5serve daemon is running" in run.outputs[1]
            assert run.returncodes[0] != 0, run.explain()
        assert killed[0].alive()
        verify = killed[0].cli("status", "--verify")
        assert verify.returncode == 0, verify.stdout  # node 0's segments intact
    finally:
        for process in started:
            kill_tree(process.pid)
        for d in killed:
            d.stop()
