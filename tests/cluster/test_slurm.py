"""h5serve under a real SLURM (tests/cluster/slurm.py: slurmctld, a slurmd and a munged per
namespace node, deploy/slurm/ installed as docs/operations.md says), with jobs of throwaway users:

- sbatch -N2 --ntasks-per-node=2, ranks launched by srun and by torchrun per node: every rank on
  shared memory, every row once, h5py's bytes; `h5serve plan` in the batch script and every task;
- the epilog leaves nothing (no daemon, segment, runtime dir), also after `scancel` mid-load;
- two users' jobs on one node: each on its own daemon, neither can reach the other's;
- a hostile job user (symlinks and FIFOs in its runtime dir, a forged pid file, /dev/shm filled)
  cannot make the root prolog or epilog harm anything or hang;
- /dev/shm too small: the job's output says so;
- H5SERVE_KEEP_S: a user's second job attaches without loading; the daemon goes when the user
  had no job for that long (the epilog's timer, with no job coming); an idle kept daemon gives
  /dev/shm back to another user's job (logged); back-to-back jobs racing epilog and prolog.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pytest

from ..helpers import make_h5, wait_for
from ..users import PortablePython, PublicInterpreter, User, portable_python, public_interpreter, throwaway_user
from .slurm import LOG, Slurm, slurm_cluster

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(300)]

RANK = Path(__file__).resolve().parent / "slurm_rank.py"
ROWS, SHAPE = 4000, (64, 64)  # 16 MiB of x: each node holds its half (contiguous) in its 64 MiB /dev/shm
RUN_ROOT = "/run/h5serve"


@dataclass(frozen=True)
class Env:
    s: Slurm
    a: User
    b: User
    py: PortablePython
    pub: PublicInterpreter
    data: Path
    big: Path  # more than a node's /dev/shm holds


def site(py: PortablePython, keep: int = 0, max_memory: str = "48M") -> str:
    return (f"H5SERVE_BIN={py.h5serve_bin}\nH5SERVE_OPTS=\"--max-memory {max_memory}\"\nH5SERVE_START_TIMEOUT=60\n"
            f"H5SERVE_LOG={LOG}\nH5SERVE_KEEP_S={keep}\n")


def make_big(path: Path, rows: int) -> Path:
    with h5py.File(path, "w") as f:
        x = f.create_dataset("x", shape=(rows, *SHAPE), dtype="uint8", chunks=(256, *SHAPE))
        for start in range(0, rows, 4096):
            x[start:start + 4096] = 7
        f.create_dataset("y", data=np.arange(rows, dtype=np.int64))
    path.chmod(0o644)
    return path


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with throwaway_user() as a, throwaway_user() as b, portable_python() as py, public_interpreter() as pub:
        prefix = Path(pub.python).parents[1]
        with slurm_cluster(nodes=2, shm="64m", share=[py.root, prefix], site=site(py)) as s:
            data = make_h5(s.cluster.shared / "train.h5", rows=ROWS, row_shape=SHAPE)
            data.chmod(0o644)
            big = make_big(s.cluster.shared / "big.h5", rows=24000)  # 96 MiB: a node's half is 48 MiB
            yield Env(s, a, b, py, pub, data, big)


@pytest.fixture(autouse=True)
def default_site(env: Env) -> Iterator[None]:
    env.s.site(site(env.py))
    yield
    assert wait_for(env.s.idle, 60), f"nodes not idle after the test:\n{env.s.logs()}"


def job_env(e: Env, out: Path, data: Path | None = None, **extra: str) -> dict[str, str]:
    return {**e.pub.env, "PATH": f"{e.py.root}:{e.pub.env['PATH']}", "PY": e.pub.python, "RANKPY": str(RANK),
            "DATA": str(data or e.data), "OUT": str(out), **extra}


def out_dir(e: Env, user: User, name: str) -> Path:
    out = e.s.user_dir(user) / name
    out.mkdir()
    os.chown(out, user.uid, user.gid)
    return out


SRUN = """#!/bin/bash
set -u
h5serve plan --json > "$OUT/plan-batch.json"
echo "batch runtime dir: ${H5SERVE_RUNTIME_DIR:-none}"
# as sbatch_example.sh: each task's rank from SLURM's variables
srun bash -c 'h5serve plan --json > "$OUT/plan-task$SLURM_PROCID.json" && RANK=$SLURM_PROCID \
  LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS exec "$PY" "$RANKPY" "$DATA" "$OUT" '"${HOLD:+--hold $HOLD}"
"""

TORCHRUN = """#!/bin/bash
set -u
master=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 bash -c 'exec "$PY" -m torch.distributed.run \
  --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node=2 --node_rank="$SLURM_NODEID" --master_addr='"$master"' \
  --master_port=29500 "$RANKPY" "$DATA" "$OUT"'
"""


def reports(out: Path, n: int = 4) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n) if (out / f"rank{r}.json").exists()]


def run_job(e: Env, user: User, script: str, out: Path, *options: str, timeout: float = 150,
            **extra: str) -> tuple[int, str]:
    job = e.s.sbatch(user, script, "-N2", "--ntasks-per-node=2", "--comment=h5serve", *options,
                     env=job_env(e, out, **extra))
    state = e.s.wait(job, timeout)
    return job, state


def check_ranks(e: Env, out: Path, user: User) -> list[dict]:
    got = reports(out)
    assert len(got) == 4, f"{len(got)} rank reports"
    assert all(r["backend"] == "shm" and r["differed"] == 0 and r["uid"] == user.uid for r in got), got
    assert sorted(row for r in got for row in r["rows"]) == list(range(ROWS))  # every row once
    hosts = {r["host"] for r in got}
    assert hosts == {n.hostname for n in e.s.nodes}
    return got


def leftovers(e: Env) -> list[str]:
    """Anything h5serve left on any node: segments, runtime dirs, daemons of the job users."""
    found = []
    for node in e.s.nodes:
        found += [f"{node.hostname}:/dev/shm/{name}" for name in node.shm()]
        root = node.path(RUN_ROOT)
        if root.exists():
            found += [f"{node.hostname}:{RUN_ROOT}/{p.name}" for p in root.iterdir()
                      if p.name not in (".keep", ".keep.lock")]
            keep = root / ".keep"
            if keep.exists():
                found += [f"{node.hostname}:{RUN_ROOT}/.keep/{p.name}" for p in keep.iterdir() if p.name != "timer.lock"]
        for pid in node.processes():
            try:
                uid = os.stat(f"/proc/{pid}").st_uid
            except OSError:
                continue
            if uid in (e.a.uid, e.b.uid):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200]
                found.append(f"{node.hostname}: process {pid} of uid {uid}: {cmdline!r}")
    return found


def status(e: Env, user: User, node: int, runtime_dir: str) -> dict:
    done = e.s.command([str(e.py.h5serve_bin), "status", "--json", "--runtime-dir", runtime_dir], user=user, node=node)
    assert done.returncode == 0, done.stdout
    return dict(json.loads(done.stdout))


# --------------------------------------------------------------------------- per-job daemons


def test_srun_ranks_on_shm_plan_and_epilog_leaves_nothing(env: Env) -> None:
    out = out_dir(env, env.a, "srun")
    job, state = run_job(env, env.a, SRUN, out)
    assert state == "COMPLETED", f"{state}\n{env.s.output(job)}\n{env.s.syslog(0)}\n{env.s.logs()}"
    got = check_ranks(env, out, env.a)
    assert all(r["runtime_dir"] == f"{RUN_ROOT}/{job}" for r in got)  # the TaskProlog's
    assert f"batch runtime dir: {RUN_ROOT}/{job}" in env.s.output(job)
    batch = json.loads((out / "plan-batch.json").read_text())
    assert batch["world_size"] == 4 and batch["node_rank"] == 0 and batch["ranks"] == [0, 1]
    for r in got:
        plan = json.loads((out / f"plan-task{r['rank']}.json").read_text())
        node = [n.hostname for n in env.s.nodes].index(r["host"])
        assert plan["node_rank"] == node and r["rank"] in plan["ranks"] and plan["world_size"] == 4
    assert leftovers(env) == []


def test_torchrun_per_node_on_shm(env: Env) -> None:
    out = out_dir(env, env.a, "torchrun")
    job, state = run_job(env, env.a, TORCHRUN, out)
    assert state == "COMPLETED", f"{state}\n{env.s.output(job)}"
    check_ranks(env, out, env.a)
    assert leftovers(env) == []
