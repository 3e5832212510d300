"""Report only: a 2-node job beside a 1-node job, on the namespace cluster of the test suite
(tests/cluster: each node its own network, host name, /dev/shm and daemon; needs root, else the
group reports nothing and says why). Both on the same machine's cores, so this shows what
multi-node costs h5serve itself (the rendezvous, one daemon and one load per node), not a
network's speed.

For global and node mode, 2 ranks per node: the first batch of a warm job (the daemons loaded by
a job before it) from launching torchrun, samples/s per rank over the rest of the epoch, and
the /dev/shm each node holds.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from .common import Row, log

JOB = Path(__file__).resolve().parent / "multinode_job.py"
MODES = ("global", "node")


def _job(nodes: list, path: Path, out: Path, mode: str) -> tuple[float, float]:
    """One torchrun per node, 2 ranks each: seconds from launch to rank 0's first batch, and
    the median samples/s of the ranks."""
    from tests.cluster.launch import torchrun

    launched = time.time()
    run = torchrun(nodes, 2, [str(path), str(out), "--mode", mode], out, deadline=900, job=JOB)
    if not run.ok or any(r["backend"] != "shm" for r in run.reports):
        raise RuntimeError(f"the {len(nodes)}-node {mode} job failed: {run.explain()}")
    rank0 = next(r for r in run.reports if r["rank"] == 0)
    return rank0["first_batch"] - launched, statistics.median(r["samples_per_s"] for r in run.reports)


def multinode(files: dict[str, Path], repeat: int) -> list[Row]:
    from tests.cluster import cluster, skip_reason

    reason = skip_reason()
    if reason:
        log(f"multinode: skipped ({reason})")
        return []
    path = files["plain"]
    shm = f"{path.stat().st_size * 2 // 2**20 + 64}m"  # the whole file fits, with room
    rows: list[Row] = []
    for mode in MODES:
        measured: dict[int, tuple[float, float, float]] = {}
        for count in (1, 2):
            with cluster(nodes=count, shm=shm, share=[path.parent]) as c:
                daemons = [node.start_daemon() for node in c.nodes]
                try:
                    _job(c.nodes, path, c.shared / "cold", mode)  # loads: the runs below attach
                    runs = [_job(c.nodes, path, c.shared / f"warm{i}", mode) for i in range(repeat)]
                    held = statistics.mean(sum(node.shm().values()) for node in c.nodes) / 1e6
                finally:
                    for d in daemons:
                        d.stop()
            measured[count] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs), held)
            log(f"multinode {mode} {count} node(s): first batch {measured[count][0]:.2f} s, "
                f"{measured[count][1]:,.0f} samples/s per rank, {held:.0f} MB /dev/shm per node")
        note = "h5serve: 2 nodes x 2 ranks; baseline: 1 node x 2 ranks (namespace nodes on one machine)"
        (fb2, sps2, mem2), (fb1, sps1, mem1) = measured[2], measured[1]
        rows += [
            Row(f"2-node job, {mode} mode: first batch, warm daemons (report only)", "s", fb2, fb1,
                higher_is_better=False, note=note),
            Row(f"2-node job, {mode} mode: samples/s per rank (report only)", "samples/s", sps2, sps1, note=note),
            Row(f"2-node job, {mode} mode: /dev/shm per node (report only)", "MB", mem2, mem1,
                higher_is_better=False, note=note),
        ]
    return rows
