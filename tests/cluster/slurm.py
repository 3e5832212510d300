"""A real SLURM on the namespace cluster (tests/cluster/__init__.py): one munged and one slurmd per
node, slurmctld on node 0, a minimal slurm.conf written per run, and deploy/slurm/ installed as
docs/operations.md ("SLURM") tells an admin:

    with slurm_cluster(nodes=2, shm="64m", share=[py.root], site="H5SERVE_BIN=...") as s:
        job = s.sbatch(user, script, "-N2", "--ntasks-per-node=2")   # as the job user, in node 0
        s.wait(job)                                                  # "COMPLETED", "CANCELLED", ...
        s.output(job)                                                # its --output file

Every node sees the same /etc/slurm (slurm.conf, h5serve/*.sh) and /etc/default (the host's,
plus the site's h5serve-slurm) through bind mounts inside its own mount namespace: the host's
/etc is never written. The daemons keep their state, sockets, pid and log files in the node's
private /run, so nothing of one node is another's. ``skip_reason()`` says why SLURM cannot run
here (not root, packages missing: `.ci/run` installs them).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from . import Cluster, cluster
from . import skip_reason as cluster_skip_reason
from ._node import PROJECT, _wait

__all__ = ["Slurm", "skip_reason", "slurm_cluster", "slurm_conf"]

DEPLOY = PROJECT / "deploy" / "slurm"
SCRIPTS = ("prolog.sh", "epilog.sh", "task_prolog.sh")
SITE_CONFIG = "/etc/default/h5serve-slurm"
LOG = "/run/h5serve-slurm.log"  # H5SERVE_LOG in the tests' site config
_COMMANDS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel", "munged", "setpriv")
_UP_S = 60.0
_FINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                    "BOOT_FAIL", "DEADLINE"})


def skip_reason() -> str | None:
    """Why no SLURM cluster can run here, or None."""
    reason = cluster_skip_reason()
    if reason:
        return reason
    missing = [c for c in _COMMANDS if shutil.which(c) is None]
    if missing:
        return (f"SLURM tests need {', '.join(missing)} (apt-get install slurmctld slurmd slurm-client munge; "
                ".ci/run does it)")
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "SLURM tests need the munge user (apt-get install munge)"
    return None


def slurm_conf(c: Cluster, cpus: int) -> str:
    """The smallest slurm.conf that runs jobs on the namespace nodes, each line with its reason."""
    n0 = c.node(0)
    lines = [
        f"ClusterName={c.tag}  # any name; per run, so state of another run is never mistaken for ours",
        f"SlurmctldHost={n0.hostname}({n0.address})  # slurmctld runs on node 0",
        "SlurmUser=root  # slurmctld as root: no slurm-owned state dirs to prepare",
        "AuthType=auth/munge  # the only authentication 22.05 ships; one munged per node, one key per run",
        "CredType=cred/munge",
        "ProctrackType=proctrack/linuxproc  # tracks a job's processes by parentage: no cgroup setup needed",
        "TaskPlugin=task/none  # no cpuset/cgroup binding: the nodes share the host's 2 cores",
        "JobAcctGatherType=jobacct_gather/none  # no accounting: nothing to gather, no slurmdbd",
        "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none  # srun starts plain tasks (the ranks use gloo over TCP)",
        "SelectType=select/cons_tres  # CPUs are consumable: jobs of two users may share a node",
        "SelectTypeParameters=CR_CPU  # ... by CPUs only (no memory limits to configure)",
        f"SlurmdParameters=config_overrides  # trust CPUs={cpus} below, more than the host's cores, so "
        "two 2-task jobs fit on one node",
        "StateSaveLocation=/run/slurmctld  # node 0's private /run: nothing survives the run",
        "SlurmdSpoolDir=/run/slurmd  # created before slurmd starts (it does not make it)",
        "SlurmctldPidFile=/run/slurmctld/slurmctld.pid",
        "SlurmdPidFile=/run/slurmd/slurmd.pid",
        "SlurmctldLogFile=/run/slurmctld/slurmctld.log  # read from the host on failure",
        "SlurmdLogFile=/run/slurmd/slurmd.log",
        "SlurmdDebug=info",
        "Prolog=/etc/slurm/h5serve/prolog.sh  # docs/operations.md, SLURM: the admin's lines, verbatim",
        "Epilog=/etc/slurm/h5serve/epilog.sh",
        "TaskProlog=/etc/slurm/h5serve/task_prolog.sh",
        "PrologFlags=Alloc  # the prolog runs on every node at allocation, before the batch script",
        "ReturnToService=2  # a node that (re)registers is usable at once",
        "KillWait=5  # scancel: SIGKILL 5 s after SIGTERM (default 30) keeps the tests short",
        "MinJobAge=600  # finished jobs stay visible to scontrol for the whole run",
        "SchedulerParameters=sched_interval=2  # the main scheduler looks at pending jobs every 2 s",
    ]
    for node in c.nodes:
        lines.append(f"NodeName={node.hostname} NodeAddr={node.address} CPUs={cpus} State=UNKNOWN")
    lines.append("PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP  # one partition, every node")
    out = []
    for line in lines:
        setting, _, why = line.partition("  # ")
        out += [f"# {why}"] if why else []
        out.append(setting)
    return "\n".join(out) + "\n"


class Slurm:
    """A running SLURM on ``cluster``: submit, wait, cancel, read job output (all from node 0, as
    the job user or root); ``site(text)`` rewrites /etc/default/h5serve-slurm on every node."""

    def __init__(self, c: Cluster, etc: Path, default: Path) -> None:
        self.cluster = c
        self.etc = etc
        self.default = default
        self.jobs_dir = c.shared / "jobs"

    @property
    def nodes(self) -> list:
        return self.cluster.nodes

    def site(self, text: str) -> None:
        """The site config the prolog and epilog source: root's, 0644, as they require."""
        path = self.default / "h5serve-slurm"
        tmp = path.with_suffix(".new")
        tmp.write_text(text)
        tmp.chmod(0o644)
        os.replace(tmp, path)

    def command(self, args: Sequence[str], user: object | None = None, timeout: float = 60,
                env: dict[str, str] | None = None, node: int = 0) -> subprocess.CompletedProcess[str]:
        argv = list(args)
        if user is not None:
            argv = ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--init-groups", "--", *argv]  # type: ignore[attr-defined]
        base = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
        return self.cluster.node(node).run(argv, timeout=timeout, env={**base, **(env or {})}, cwd="/")

    def user_dir(self, user: object) -> Path:
        """A dir in the shared dir the job user owns: scripts and --output files go there."""
        where = self.jobs_dir / str(user.uid)  # type: ignore[attr-defined]
        where.mkdir(parents=True, exist_ok=True)
        os.chown(where, user.uid, user.gid)  # type: ignore[attr-defined]
        where.chmod(0o755)
        return where

    def sbatch(self, user: object, script: str, *options: str, env: dict[str, str] | None = None) -> int:
        """Submit ``script`` (the text of a batch script) as ``user``; its output goes to
        ``output(job)``. Returns the job id."""
        where = self.user_dir(user)
        path = where / f"job-{len(list(where.glob('job-*.sh')))}.sh"
        path.write_text(script)
        os.chown(path, user.uid, user.gid)  # type: ignore[attr-defined]
        path.chmod(0o755)
        done = self.command(["sbatch", "--parsable", f"--output={where}/%j.out", f"--chdir={where}", *options,
                             str(path)], user=user, env=env)
        assert done.returncode == 0, f"sbatch failed: {done.stdout}"
        return int(done.stdout.strip().split(";")[0].splitlines()[-1])

    def output(self, job: int) -> str:
        for path in self.jobs_dir.glob(f"*/{job}.out"):
            return path.read_text(errors="replace")
        return ""

    def state(self, job: int) -> str:
        done = self.command(["scontrol", "-o", "show", "job", str(job)])
        found = re.search(r"\bJobState=(\S+)", done.stdout)
        return found.group(1) if found else "UNKNOWN"

    def wait(self, job: int, timeout: float = 180, states: frozenset[str] | set[str] = _FINAL) -> str:
        """Wait until ``job`` is in one of ``states`` (default: finished, its epilogs done) and
        return its state; on timeout, the last state seen."""
        seen = {"state": ""}

        def reached() -> bool:
            seen["state"] = self.state(job)
            if seen["state"] not in states:
                return False
            if states is _FINAL and self.completing(job):
                return False
            return True

        _wait(reached, timeout)
        return seen["state"]

    def completing(self, job: int) -> bool:
        """True while some node still runs the job's epilog (the job record's COMPLETING flag)."""
        done = self.command(["scontrol", "-o", "show", "job", str(job)])
        return "COMPLETING" in done.stdout

    def wait_running(self, job: int, timeout: float = 120) -> str:
        return self.wait(job, timeout, states={"RUNNING", *_FINAL})

    def scancel(self, job: int) -> None:
        done = self.command(["scancel", str(job)])
        assert done.returncode == 0, done.stdout

    def idle(self) -> bool:
        """Every node idle (no job, no epilog running)."""
        done = self.command(["sinfo", "-h", "-N", "-o", "%N %T"])
        states = [line.split()[1] for line in done.stdout.splitlines() if line.strip()]
        return len(states) == len(self.nodes) and all(s == "idle" for s in states)

    def logs(self) -> str:
        """slurmctld's and every slurmd's log: for a failing test's message."""
        parts = []
        for node in self.nodes:
            for name in ("/run/slurmctld/slurmctld.log", "/run/slurmd/slurmd.log"):
                with contextlib.suppress(OSError):
                    parts.append(f"--- {node.hostname}:{name}\n" + node.path(name).read_text()[-4000:])
        return "\n".join(parts)

    def syslog(self, node: int) -> str:
        """What the prolog and epilog logged on ``node``: no syslog runs in a node, so the site
        config the tests write sets H5SERVE_LOG=/run/h5serve-slurm.log (the node's own /run)."""
        try:
            return self.cluster.node(node).path(LOG).read_text()
        except OSError:
            return ""




def _prepare(c: Cluster, etc: Path, default: Path, key: Path, cpus: int) -> None:
    """/etc/slurm and /etc/default of every node: the run's, by bind mounts in the node."""
    (etc / "h5serve").mkdir(parents=True)
    (etc / "slurm.conf").write_text(slurm_conf(c, cpus))
    (etc / "plugstack.conf").write_text("")
    # docs/operations.md, SLURM: the scripts, root's, 0755, in /etc/slurm/h5serve
    for name in SCRIPTS:
        subprocess.run(["install", "-m", "0755", "-o", "root", "-g", "root", str(DEPLOY / name),
                        str(etc / "h5serve" / name)], check=True, timeout=30)
    shutil.copytree("/etc/default", default, symlinks=True)
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)


def _start_node(s: Slurm, i: int, key: Path) -> None:
    """Bind the run's /etc/slurm and /etc/default, a /dev/log listener, then munged (as munge,
    with the run's key, everything in the node's /run/munge), slurmctld on node 0, slurmd."""
    node = s.cluster.node(i)
    munge = pwd.getpwnam("munge")
    setup = f"""set -e
mount --bind {s.etc} /etc/slurm
mount --bind {s.default} /etc/default
install -d -m 0755 -o {munge.pw_uid} -g {munge.pw_gid} /run/munge
install -m 0400 -o {munge.pw_uid} -g {munge.pw_gid} {key} /run/munge/munge.key
setpriv --reuid={munge.pw_uid} --regid={munge.pw_gid} --clear-groups -- /usr/sbin/munged \
  --key-file=/run/munge/munge.key --socket=/run/munge/munge.socket.2 --pid-file=/run/munge/munged.pid \
  --log-file=/run/munge/munged.log --seed-file=/run/munge/munged.seed
install -d -m 0755 /run/slurmd /run/slurmctld
"""
    done = node.run(["bash", "-c", setup], timeout=60, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    assert done.returncode == 0, f"{node.hostname} setup: {done.stdout}"
    daemons = (["slurmctld"] if i == 0 else []) + ["slurmd"]
    for daemon in daemons:
        done = node.run([daemon], timeout=60, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        assert done.returncode == 0, f"{daemon} on {node.hostname}: {done.stdout}\n{s.logs()}"


@contextlib.contextmanager
def slurm_cluster(nodes: int = 2, shm: str = "64m", share: Sequence[str | os.PathLike[str]] = (),
                  site: str = "", cpus: int = 4) -> Iterator[Slurm]:
    """``nodes`` namespace nodes running SLURM; ``site`` is the first /etc/default/h5serve-slurm.
    Skips (pytest.skip) with the reason where SLURM cannot run. Teardown: every daemon is
    SIGKILLed with its node (the cluster's init), in ``finally``."""
    reason = skip_reason()
    if reason:
        import pytest

        pytest.skip(reason)
    with cluster(nodes=nodes, shm=shm, share=share) as c:
        etc, default, key = c.shared / "etc-slurm", c.shared / "etc-default", c.shared / "munge.key"
        _prepare(c, etc, default, key, cpus)
        s = Slurm(c, etc, default)
        s.site(site)
        s.jobs_dir.mkdir()
        s.jobs_dir.chmod(0o755)
        try:
            for i in range(nodes):
                _start_node(s, i, key)
            if not _wait(s.idle, _UP_S):
                raise RuntimeError(f"SLURM nodes not idle after {_UP_S} s:\n{s.logs()}")
            yield s
        finally:
            for node in c.nodes:
                node.kill_all()
