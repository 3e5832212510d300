"""Multi-node torchrun on the namespace cluster: one ``torchrun --nnodes=N`` per node, c10d
rendezvous on the first node's address, gloo; a shared deadline, everything killed at the end."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import Node, kill_tree

__all__ = ["JOB", "JobRun", "torchrun"]

JOB = Path(__file__).resolve().parent / "job.py"
RDZV_PORT = 29400  # each node has its own network namespace: a fixed port never collides with the host's


@dataclass(frozen=True)
class JobRun:
    """What a multi-node job left: each node's torchrun exit code and output (in node order),
    and every rank's report that was written (by global rank)."""

    returncodes: tuple[int | None, ...]
    outputs: tuple[str, ...]
    reports: tuple[dict, ...]

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.returncodes)

    def explain(self) -> str:
        return "\n".join(f"--- node {i} (exit {code}):\n{out[-3000:]}"
                         for i, (code, out) in enumerate(zip(self.returncodes, self.outputs)))

    def by_host(self) -> dict[str, list[dict]]:
        hosts: dict[str, list[dict]] = {}
        for report in self.reports:
            hosts.setdefault(report["host"], []).append(report)
        return hosts


_run_ids = itertools.count(1)  # each job its own rendezvous id


def torchrun(nodes: Sequence[Node], nproc: int, args: Sequence[str], out: Path, deadline: float,
             env: Mapping[int, Mapping[str, str]] | None = None, job: Path = JOB,
             started: list[subprocess.Popen] | None = None) -> JobRun:
    """``job ARGS`` on ``nodes`` with ``nproc`` ranks each; the job writes ``out/rank<N>.json``
    (``out`` must be in the cluster's shared dir). ``env``: extra variables per node index.
    Past ``deadline`` seconds every node's torchrun is killed with all it started, and the run
    reports exit code None there. ``started`` receives the processes as soon as they run (for a
    test that acts while the job runs)."""
    out.mkdir(parents=True, exist_ok=True)
    endpoint = f"{nodes[0].address}:{RDZV_PORT}"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(nodes)}", f"--nproc_per_node={nproc}",
           "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", f"--rdzv_id=job{next(_run_ids)}", "--max_restarts=0",
           "--monitor_interval=0.5", str(job), *args]
    processes: list[subprocess.Popen] = []
    try:
        for node in nodes:
            processes.append(node.popen(cmd, env=node.env(**dict((env or {}).get(node.index, {})))))
        if started is not None:
            started.extend(processes)
        end = time.monotonic() + deadline
        outputs, codes = [], []
        for process in processes:
            try:
                output, _ = process.communicate(timeout=max(0.1, end - time.monotonic()))
                codes.append(process.returncode)
            except subprocess.TimeoutExpired:
                kill_tree(process.pid)
                output, _ = process.communicate()
                output += f"\n[killed after the {deadline} s deadline]"
                codes.append(None)
            outputs.append(output)
    finally:
        for process in processes:
            if process.poll() is None:
                kill_tree(process.pid)
                process.wait()
    reports = []
    for rank in range(len(nodes) * nproc):
        path = out / f"rank{rank}.json"
        if path.exists():
            reports.append(json.loads(path.read_text()))
    return JobRun(tuple(codes), tuple(outputs), tuple(reports))
