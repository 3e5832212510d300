"""h5serve under a real SLURM (tests/cluster/slurm.py: slurmctld, a slurmd and a munged per
namespace node, deploy/slurm/ installed as docs/operations.md says), with jobs of throwaway users:

- sbatch -N2 --ntasks-per-node=2, ranks launched by srun and by torchrun per node: every rank on
  shared memory, every row once, h5py's bytes; `h5serve plan` in the batch script and every task;
- the epilog leaves nothing (no daemon, segment, runtime dir), also after `scancel` mid-load;
- two users' jobs on one node: each on its own daemon, neither can reach the other's;
- a hostile job user (symlinks and FIFOs in its runtime dir, a forged pid file, /dev/shm filled)
  cannot make the root prolog or epilog harm anything or hang;
- /dev/shm too small: the job's output says so;
- H5SERVE_KEEP_S: a user's second job attaches without loading; the daemon goes once unused that
  long with no job of its user (its own --idle-exit, with no job coming); an idle kept daemon
  gives /dev/shm back to another user's job that needs it (logged); back-to-back jobs racing
  epilog and prolog (tests/integration/test_slurm_keep.py has the hostile users).
"""

from __future__ import annotations

import json
import os
import signal
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


def site(py: PortablePython, keep: int = 0, max_memory: str | None = "48M") -> str:
    """The site's h5serve settings; ``max_memory`` None: the daemon's default budget."""
    opts = "" if max_memory is None else f"--max-memory {max_memory}"
    return (f"H5SERVE_BIN={py.h5serve_bin}\nH5SERVE_OPTS=\"{opts}\"\nH5SERVE_START_TIMEOUT=60\n"
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
        with slurm_cluster(nodes=2, shm="64m", share=[py.root, pub.root], site=site(py)) as s:
            data = make_h5(s.cluster.shared / "train.h5", rows=ROWS, row_shape=SHAPE)
            data.chmod(0o644)
            big = make_big(s.cluster.shared / "big.h5", rows=40000)  # 160 MiB: a node's half is 80 MiB
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
  LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS exec "$PY" "$RANKPY" "$DATA" "$OUT" '"${HOLD:+--hold $HOLD} \
  ${START_AFTER:+--start-after $START_AFTER}"
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
    """Anything h5serve left on any node: segments, runtime dirs, holds, daemons of the job users.
    Root's own dirs stay (.root: its lock; .holds: one empty dir per user), and so does the
    runtime dir of a kept daemon that exited (its log), without socket or pidfile."""
    found = []
    for node in e.s.nodes:
        found += [f"{node.hostname}:/dev/shm/{name}" for name in node.shm()]
        root = node.path(RUN_ROOT)
        if root.exists():
            for p in root.iterdir():
                kept_and_gone = p.name.startswith("user-") and not any(
                    (p / name).exists() for name in ("h5serve.sock", "h5serve.pid"))
                if p.name not in (".root", ".holds") and not kept_and_gone:
                    found.append(f"{node.hostname}:{RUN_ROOT}/{p.name}")
            holds = root / ".holds"
            if holds.exists():
                found += [f"{node.hostname}:{hold}" for user in holds.iterdir() for hold in user.iterdir()]
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
    # the daemon's forkserver exits just after the daemon the epilog stopped
    assert wait_for(lambda: leftovers(env) == [], 15), leftovers(env)


def test_torchrun_per_node_on_shm(env: Env) -> None:
    out = out_dir(env, env.a, "torchrun")
    job, state = run_job(env, env.a, TORCHRUN, out)
    assert state == "COMPLETED", f"{state}\n{env.s.output(job)}"
    check_ranks(env, out, env.a)
    assert wait_for(lambda: leftovers(env) == [], 15), leftovers(env)


def submit(e: Env, user: User, script: str, out: Path, *options: str, data: Path | None = None,
           **extra: str) -> int:
    return e.s.sbatch(user, script, "--comment=h5serve", *options, env=job_env(e, out, data, **extra))


ONE_NODE = ("-N1", "--ntasks=2")


def loaders_of(e: Env, user: User, node: int, name: str) -> list[int]:
    """Host pids of ``user``'s processes on ``node`` named ``name`` (h5serve-spare: a daemon's spare loader)."""
    found = []
    for pid in e.s.nodes[node].processes():
        try:
            if os.stat(f"/proc/{pid}").st_uid == user.uid and Path(f"/proc/{pid}/comm").read_text().strip() == name:
                found.append(pid)
        except OSError:
            continue
    return found


def test_scancel_mid_load_leaves_nothing(env: Env) -> None:
    """A load is running on every node when the job is cancelled: checked, not assumed. The
    ranks wait for a go file; meanwhile each node's daemon has its spare loader SIGSTOPped, so
    the first load of each node goes to it and stays in progress until the epilog stops the
    daemon (and with it the stopped spare)."""
    env.s.site(site(env.py, max_memory="60M"))
    out = out_dir(env, env.a, "scancel")
    go = env.s.cluster.shared / "scancel-go"
    job = submit(env, env.a, SRUN, out, "-N2", "--ntasks-per-node=2", HOLD=str(out / "never"), START_AFTER=str(go))
    runtime_dir = f"{RUN_ROOT}/{job}"
    stopped: list[int] = []
    try:
        for i in range(len(env.s.nodes)):
            assert wait_for(lambda i=i: loaders_of(env, env.a, i, "h5serve-spare"), 90), env.s.output(job)
            for pid in loaders_of(env, env.a, i, "h5serve-spare"):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        go.touch()

        def loading(i: int) -> bool:
            return any(seg["state"] == "loading" for seg in status(env, env.a, i, runtime_dir)["segments"])

        for i in range(len(env.s.nodes)):
            assert wait_for(lambda i=i: loading(i), 90), f"no load in progress on node {i}\n{env.s.output(job)}"
        assert all(loading(i) for i in range(len(env.s.nodes)))  # still running when the job is cancelled
        env.s.scancel(job)
        assert env.s.wait(job, 90) == "CANCELLED"
    finally:
        go.unlink(missing_ok=True)
        for pid in stopped:  # stopped processes of a failed test must not outlive it
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert wait_for(lambda: leftovers(env) == [], 30), leftovers(env)


def test_two_users_on_one_node_isolated(env: Env) -> None:
    node = env.s.nodes[0].hostname
    outs = {u.name: out_dir(env, u, "isolated") for u in (env.a, env.b)}
    go = env.s.cluster.shared / "isolated-go"
    jobs = {u.name: submit(env, u, SRUN, outs[u.name], *ONE_NODE, f"--nodelist={node}", HOLD=str(go))
            for u in (env.a, env.b)}
    try:
        for u in (env.a, env.b):
            assert wait_for(lambda u=u: len(reports(outs[u.name], 2)) == 2, 90), env.s.output(jobs[u.name])
        for u, other in ((env.a, env.b), (env.b, env.a)):
            mine = reports(outs[u.name], 2)
            assert {r["runtime_dir"] for r in mine} == {f"{RUN_ROOT}/{jobs[u.name]}"}
            assert all(r["backend"] == "shm" for r in mine)
            # the other user reaches neither this daemon nor its segments
            done = env.s.command([str(env.py.h5serve_bin), "status", "--runtime-dir", f"{RUN_ROOT}/{jobs[u.name]}"],
                                 user=other)
            assert done.returncode != 0, done.stdout
            segments = [n for n in env.s.nodes[0].shm() if n.startswith(f"h5serve-{u.uid}-")]
            assert segments
            done = env.s.command(["cat", f"/dev/shm/{segments[0]}"], user=other)
            assert done.returncode != 0 and "Permission denied" in done.stdout
    finally:
        go.touch()
    for u in (env.a, env.b):
        assert env.s.wait(jobs[u.name], 90) == "COMPLETED", env.s.output(jobs[u.name])
    assert wait_for(lambda: leftovers(env) == [], 30), leftovers(env)


HOSTILE = """#!/bin/bash
# the job user turns its runtime dir against the root epilog: a FIFO pid file (node 0), a pid
# file naming slurmd (node 1), symlinks to root's files and dirs, FIFOs, and /dev/shm filled
srun --ntasks-per-node=1 bash -c '
d=$H5SERVE_RUNTIME_DIR
[ -d "$d" ] || { echo "no runtime dir"; exit 1; }
rm -f "$d/h5serve.pid"
if [ "$SLURM_NODEID" = 0 ]; then mkfifo "$d/h5serve.pid"; else cat /run/slurmd/slurmd.pid > "$d/h5serve.pid"; fi
ln -s /etc/shadow "$d/shadow"; ln -s / "$d/rootdir"; mkfifo "$d/fifo" "$d/h5serve.sock.fifo"
dd if=/dev/zero of=/dev/shm/fill-$SLURM_JOB_ID bs=1M count=200 2>/dev/null
echo hostile done on $(hostname)'
"""


def test_hostile_job_user_cannot_harm_or_hang_prolog_epilog(env: Env) -> None:
    out = out_dir(env, env.a, "hostile")
    shadow = os.stat("/etc/shadow")
    slurmd = [int(n.path("/run/slurmd/slurmd.pid").read_text()) for n in env.s.nodes]
    job = submit(env, env.a, HOSTILE, out, "-N2", "--ntasks-per-node=1")
    started = time.monotonic()
    try:
        assert env.s.wait(job, 120) == "COMPLETED", env.s.output(job)
        assert env.s.output(job).count("hostile done") == 2, env.s.output(job)
        assert time.monotonic() - started < 100  # the epilogs did not hang
        assert wait_for(env.s.idle, 30), "a node is not idle (drained?)"
        after = os.stat("/etc/shadow")
        assert (after.st_uid, after.st_mode, after.st_size) == (shadow.st_uid, shadow.st_mode, shadow.st_size)
        for node, pid in zip(env.s.nodes, slurmd):
            assert node.host_pid(pid), f"slurmd of {node.hostname} is gone"
            assert [name for name in node.shm() if name.startswith("fill-")]  # the user's own: not h5serve's to remove
    finally:  # the user's files filling /dev/shm go whatever failed, or every later job here finds it full
        for node in env.s.nodes:
            for name in node.shm():
                if name.startswith("fill-"):
                    node.path(f"/dev/shm/{name}").unlink(missing_ok=True)
    assert wait_for(lambda: leftovers(env) == [], 15), leftovers(env)
    # the nodes still run jobs, with their daemons
    out2 = out_dir(env, env.a, "after-hostile")
    job2, state = run_job(env, env.a, SRUN, out2)
    assert state == "COMPLETED", env.s.output(job2)
    check_ranks(env, out2, env.a)


def test_shm_too_small_says_so_in_job_output(env: Env) -> None:
    env.s.site(site(env.py, max_memory="1G"))
    out = out_dir(env, env.a, "small")
    # AUTO_STREAM=0: a rank without room reads lazily (automatic stream mode would take some ranks
    # in, depending on timing); each node's /dev/shm (64 MiB) holds one of its two 40 MiB shards
    job = submit(env, env.a, SRUN, out, "-N2", "--ntasks-per-node=2", data=env.big, FALLBACK="lazy", AUTO_STREAM="0")
    assert env.s.wait(job, 150) == "COMPLETED", env.s.output(job)
    text = env.s.output(job)
    got = reports(out)
    # the first ranks of a node to load may fit; the others read lazily, and say why
    assert len(got) == 4 and sum(r["backend"] == "lazy" for r in got) >= 2, text
    assert text.count("h5serve: not enough room in /dev/shm for 'x'") >= 2, text
    assert all(r["differed"] == 0 for r in got) and sorted(x for r in got for x in r["rows"]) == list(range(40000))
    assert wait_for(lambda: leftovers(env) == [], 30), leftovers(env)


# --------------------------------------------------------------------------- kept daemons


def reap_all(e: Env) -> None:
    """Back to per-job daemons: KEEP_S=0, and the epilog's --stop-idle on every node stops what is
    kept, once the daemons say they are idle (2 s after their last use)."""
    e.s.site(site(e.py))

    def stopped() -> bool:
        for i in range(len(e.s.nodes)):
            e.s.command(["/etc/slurm/h5serve/epilog.sh", "--stop-idle"], node=i)
        return not any("h5serve.daemon" in line for line in leftovers(e))

    assert wait_for(stopped, 60, interval=1), leftovers(e)


def test_keep_second_job_attaches_and_daemon_goes_after_keep_s(env: Env) -> None:
    keep = 20
    env.s.site(site(env.py, keep=keep))
    try:
        first = out_dir(env, env.a, "keep1")
        job, state = run_job(env, env.a, SRUN, first)
        assert state == "COMPLETED", f"{env.s.output(job)}\n{env.s.syslog(0)}"
        kept = f"{RUN_ROOT}/user-{env.a.uid}"
        assert {r["runtime_dir"] for r in check_ranks(env, first, env.a)} == {kept}
        loads = [status(env, env.a, i, kept)["counters"]["loads"] for i in range(2)]
        assert all(loads)
        # the next job of that user, and two at once: attach, load nothing
        outs = [out_dir(env, env.a, f"keep{i}") for i in (2, 3, 4)]
        job2, state = run_job(env, env.a, SRUN, outs[0])
        assert state == "COMPLETED", env.s.output(job2)
        jobs = [submit(env, env.a, SRUN, out, "-N2", "--ntasks-per-node=2") for out in outs[1:]]
        for j in jobs:
            assert env.s.wait(j, 150) == "COMPLETED", env.s.output(j)
        for out in outs:
            check_ranks(env, out, env.a)
        assert [status(env, env.a, i, kept)["counters"]["loads"] for i in range(2)] == loads
        first_open = max(r["open_s"] for r in reports(first))
        second_open = max(r["open_s"] for r in reports(outs[0]))
        print(f"open (load) {first_open:.3f}s, second job open (attach) {second_open:.3f}s")
        assert "reusing the kept daemon" in env.s.syslog(0)
        # no job comes: the daemon exits on its own (--idle-exit KEEP_S), unused since the last job ended
        ended = time.monotonic()
        assert wait_for(lambda: leftovers(env) == [], keep + 30), leftovers(env)
        assert time.monotonic() - ended >= keep - 5
        for node in env.s.nodes:
            assert f"(--idle-exit {keep}): exiting" in node.path(f"{kept}/h5serve.log").read_text()
    finally:
        reap_all(env)


def test_keep_idle_daemon_gives_shm_to_another_users_job(env: Env) -> None:
    env.s.site(site(env.py, keep=300, max_memory="60M"))  # a 64 MiB /dev/shm: A's kept 8 MiB must go
    try:
        out_a, out_b = out_dir(env, env.a, "release"), out_dir(env, env.b, "release")
        job, state = run_job(env, env.a, SRUN, out_a)
        assert state == "COMPLETED", env.s.output(job)
        assert any(name.startswith(f"h5serve-{env.a.uid}-") for name in env.s.nodes[0].shm())
        kept = f"{RUN_ROOT}/user-{env.a.uid}"
        for i in range(len(env.s.nodes)):  # idle as the daemons say (the prolog asks them too)
            assert wait_for(lambda i=i: status(env, env.a, i, kept)["idle_exit"]["idle_s"] >= 2, 30)
        job, state = run_job(env, env.b, SRUN, out_b)
        assert state == "COMPLETED", env.s.output(job)
        check_ranks(env, out_b, env.b)
        for i, node in enumerate(env.s.nodes):
            assert not any(name.startswith(f"h5serve-{env.a.uid}-") for name in node.shm())
            assert f"stopping the idle kept daemon of uid {env.a.uid}" in env.s.syslog(i)
    finally:
        reap_all(env)
    assert wait_for(lambda: leftovers(env) == [], 30), leftovers(env)


def test_keep_another_users_job_on_a_node_with_room_never_stops_a_kept_daemon(env: Env) -> None:
    """The site's default settings (no --max-memory): A's idle kept daemon holds 8 MiB of a
    64 MiB /dev/shm, B's job needs no more than is free, so A's daemon stays with its rows. The
    earlier prolog took the whole /dev/shm as B's need and stopped every idle kept daemon."""
    env.s.site(site(env.py, keep=300, max_memory=None))
    try:
        out_a, out_b = out_dir(env, env.a, "room-a"), out_dir(env, env.b, "room-b")
        job, state = run_job(env, env.a, SRUN, out_a)
        assert state == "COMPLETED", env.s.output(job)
        kept = f"{RUN_ROOT}/user-{env.a.uid}"
        for i in range(len(env.s.nodes)):  # idle as the daemons say: the prolog could stop them
            assert wait_for(lambda i=i: status(env, env.a, i, kept)["idle_exit"]["idle_s"] >= 2, 30)
        loads = [status(env, env.a, i, kept)["counters"]["loads"] for i in range(len(env.s.nodes))]
        before = [len(env.s.syslog(i)) for i in range(len(env.s.nodes))]  # earlier tests' lines: not this one's
        job, state = run_job(env, env.b, SRUN, out_b)
        assert state == "COMPLETED", env.s.output(job)
        check_ranks(env, out_b, env.b)
        for i, node in enumerate(env.s.nodes):
            logged = env.s.syslog(i)[before[i]:]
            assert any(name.startswith(f"h5serve-{env.a.uid}-") for name in node.shm()), logged
            assert f"stopping the idle kept daemon of uid {env.a.uid}" not in logged, logged
        # A's next job attaches to the rows its daemon kept: nothing loaded again
        job, state = run_job(env, env.a, SRUN, out_dir(env, env.a, "room-a2"))
        assert state == "COMPLETED", env.s.output(job)
        assert [status(env, env.a, i, kept)["counters"]["loads"] for i in range(len(env.s.nodes))] == loads
    finally:
        reap_all(env)
    assert wait_for(lambda: leftovers(env) == [], 30), leftovers(env)


def test_keep_back_to_back_jobs_race_epilog_and_prolog(env: Env) -> None:
    """KEEP_S=1: each job's epilog (and the timer) races the next job's prolog; every job must
    find its daemon (fallback error: a daemon stopped under a job fails it) and nothing stays."""
    env.s.site(site(env.py, keep=1))
    try:
        outs = [out_dir(env, env.a, f"race{i}") for i in range(4)]
        jobs = [submit(env, env.a, SRUN, out, *ONE_NODE, f"--nodelist={env.s.nodes[1].hostname}",
                       "--job-name=race", "--dependency=singleton") for out in outs]
        for j in jobs:
            assert env.s.wait(j, 150) == "COMPLETED", f"{env.s.output(j)}\n{env.s.syslog(1)}"
        for out in outs:
            got = reports(out, 2)
            assert len(got) == 2 and all(r["backend"] == "shm" and r["differed"] == 0 for r in got)
        assert wait_for(lambda: leftovers(env) == [], 45), f"{leftovers(env)}\n{env.s.syslog(1)}"
    finally:
        reap_all(env)
