"""One node of the namespace cluster (tests/cluster/__init__.py): run commands in it through
``nsenter``, start real daemons in it, look at its /dev/shm, kill what runs in it by pid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from h5serve.segments import segment_prefix
from h5serve.wire.runtime import LOGFILE_NAME, resolve_runtime

__all__ = ["Node", "NodeDaemon", "kill_tree"]

PROJECT = Path(__file__).resolve().parents[2]
RUNTIME_DIR = "/run/h5serve"  # a node's default daemon runtime dir: in its private /run
_GONE_S = 15.0
# what must not leak from the host's environment into a node: host-side runtime paths, a
# launcher's rank variables, the host's name
_HOST_ONLY = ("XDG_RUNTIME_DIR", "HOSTNAME", "H5SERVE_RUNTIME_DIR", "H5SERVE_SHM_DIR", "MASTER_ADDR", "MASTER_PORT",
              "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")


def _ppids() -> dict[int, int]:
    """pid -> parent pid of every process now."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    table[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return table


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants (torchrun starts its ranks in sessions of their
    own: a process group kill would miss them). Children are collected before anything is
    killed, twice, so a fork in flight is caught."""
    for _ in range(2):
        table = _ppids()
        family, grew = {pid}, True
        while grew:
            more = {child for child, parent in table.items() if parent in family} - family
            family |= more
            grew = bool(more)
        for member in family:
            try:
                os.kill(member, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _wait(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def _pidns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


class Node:
    """Node ``index`` of a cluster: ``hostname``, ``address``, and ``init_pid`` (the host's pid
    of its init)."""

    def __init__(self, index: int, hostname: str, address: str, netns_path: str, launcher: subprocess.Popen) -> None:
        self.index = index
        self.hostname = hostname
        self.address = address
        self.netns_path = netns_path
        self.launcher = launcher
        self.init_pid = 0
        self.runtime_dir = RUNTIME_DIR
        self._pidns: str | None = None

    def __repr__(self) -> str:
        return f"Node({self.index}, {self.hostname}, {self.address}, init {self.init_pid})"

    def find_init(self) -> None:
        """The init is the only child of the unshare process that launched it."""
        with open(f"/proc/{self.launcher.pid}/task/{self.launcher.pid}/children") as f:
            (self.init_pid,) = (int(p) for p in f.read().split())
        self._pidns = _pidns(self.init_pid)

    # ----- running things ------------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        """The host's environment without what belongs to the host, with the project first on
        PYTHONPATH (the worktree the test runs from) and clients pointed at the node's default
        daemon."""
        env = {k: v for k, v in os.environ.items() if k not in _HOST_ONLY and not k.startswith("TORCHELASTIC_")}
        env.update(PYTHONPATH=str(PROJECT), H5SERVE_RUNTIME_DIR=self.runtime_dir, OMP_NUM_THREADS="1")
        env.update(extra)
        return env

    def command(self, args: Sequence[str], cwd: str | os.PathLike[str] | None = None) -> list[str]:
        """``args`` as run inside the node: nsenter into its namespaces (the network one by its
        /run/netns path), forking into its pid namespace, in ``cwd`` (default: the project)."""
        return ["nsenter", f"--target={self.init_pid}", "--mount", "--uts", "--ipc", "--pid",
                f"--net={self.netns_path}", f"--wd={cwd or PROJECT}", "--", *map(str, args)]

    def popen(self, args: Sequence[str], env: Mapping[str, str] | None = None,
              cwd: str | os.PathLike[str] | None = None, **kwargs: Any) -> subprocess.Popen:
        """Start ``args`` in the node (stdout and stderr together, text, a session of its own);
        the caller kills it (``kill_tree(p.pid)``) in ``finally``."""
        options: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True,
                                   "stdin": subprocess.DEVNULL, **kwargs}
        return subprocess.Popen(self.command(args, cwd), env=dict(env) if env is not None else self.env(),
                                start_new_session=True, **options)

    def run(self, args: Sequence[str], timeout: float, env: Mapping[str, str] | None = None,
            cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``args`` in the node to the end; past ``timeout`` it is killed with all it
        started and TimeoutExpired (with its output) is raised."""
        process = self.popen(args, env=env, cwd=cwd)
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            kill_tree(process.pid)
            output, _ = process.communicate()
            raise subprocess.TimeoutExpired(exc.cmd, timeout, output=output) from None
        finally:
            if process.poll() is None:
                kill_tree(process.pid)
                process.wait()
        return subprocess.CompletedProcess(args, process.returncode, output, "")

    # ----- looking in ----------------------------------------------------------------------

    def path(self, path: str | os.PathLike[str]) -> Path:
        """``path`` as the node sees it, read from the host (through its init's root)."""
        return Path(f"/proc/{self.init_pid}/root") / str(path).lstrip("/")

    def shm(self) -> dict[str, int]:
        """The node's /dev/shm: name -> size in bytes."""
        root = self.path("/dev/shm")
        return {p.name: p.stat().st_size for p in root.iterdir()}

    def processes(self) -> list[int]:
        """Host pids of every process in the node's pid namespace but its init."""
        return [pid for pid in _ppids() if pid != self.init_pid and _pidns(pid) == self._pidns]

    def host_pid(self, node_pid: int) -> int:
        """The host's pid of the node's process ``node_pid``; 0 if there is none."""
        for pid in self.processes():
            try:
                with open(f"/proc/{pid}/status") as f:
                    line = next(x for x in f if x.startswith("NSpid:"))
            except (OSError, StopIteration):
                continue
            if int(line.split()[-1]) == node_pid:
                return pid
        return 0

    def kill_all(self) -> None:
        """SIGKILL everything in the node but its init (which reaps them)."""
        for pid in self.processes():
            kill_tree(pid)
        _wait(lambda: not self.processes(), _GONE_S)

    def start_daemon(self, *args: str, runtime_dir: str | None = None) -> NodeDaemon:
        return NodeDaemon(self, runtime_dir or self.runtime_dir, args).start()

    def end(self) -> list[str]:
        """Kill the init (so the whole node) and its launcher, by pid; what was left, if anything."""
        problems = []
        for pid in (self.init_pid, self.launcher.pid):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.launcher.communicate(timeout=_GONE_S)
        except subprocess.TimeoutExpired:
            problems.append(f"{self.hostname}: its launcher {self.launcher.pid} outlived SIGKILL")
        pidns = self._pidns
        if pidns and not _wait(lambda: not any(_pidns(p) == pidns for p in _ppids()), _GONE_S):
            problems.append(f"{self.hostname}: processes of its pid namespace outlived its init")
        return problems


class NodeDaemon:
    """A real daemon in ``node``, started with ``h5serve start --runtime-dir RUNTIME_DIR ARGS``
    inside it; ``pid`` is its pid in the node, ``host_pid`` on the host."""

    def __init__(self, node: Node, runtime_dir: str, args: Sequence[str]) -> None:
        self.node = node
        self.runtime_dir = runtime_dir
        self.args = tuple(args)
        self.pid = 0
        self.host_pid = 0

    def env(self) -> dict[str, str]:
        return self.node.env(H5SERVE_RUNTIME_DIR=self.runtime_dir)

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """The real ``h5serve`` command line, in the node, against this daemon."""
        return self.node.run([sys.executable, "-m", "h5serve", *args], timeout=timeout, env=self.env())

    def start(self) -> NodeDaemon:
        done = self.cli("start", "--runtime-dir", self.runtime_dir, *self.args, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"h5serve start failed in {self.node.hostname}: {done.stdout.strip()}")
        self.pid = int(self.node.path(f"{self.runtime_dir}/h5serve.pid").read_text())
        self.host_pid = self.node.host_pid(self.pid)
        assert self.host_pid, f"no process {self.pid} in {self.node.hostname}"
        return self

    def status(self) -> dict[str, Any]:
        done = self.cli("status", "--json")
        assert done.returncode == 0, f"status in {self.node.hostname}: {done.stdout}"
        return dict(json.loads(done.stdout))

    def log(self) -> str:
        try:
            return self.node.path(f"{self.runtime_dir}/{LOGFILE_NAME}").read_text()
        except OSError:
            return ""

    def alive(self) -> bool:
        try:
            with open(f"/proc/{self.host_pid}/stat") as f:
                return bool(self.host_pid) and f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.kill(self.host_pid, sig)
        except ProcessLookupError:
            pass

    def segment_files(self) -> list[str]:
        """This daemon's files in the node's /dev/shm."""
        prefix = segment_prefix(resolve_runtime(self.runtime_dir).namespace)
        return sorted(name for name in self.node.shm() if name.startswith(prefix))

    def stop(self, timeout: float = 40) -> None:
        """``h5serve stop``; if it is still alive then, SIGKILL it and remove its segments."""
        if self.alive():
            try:
                self.cli("stop", timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        if self.alive():
            self.kill()
            _wait(lambda: not self.alive(), _GONE_S)
        for name in self.segment_files():
            self.node.path(f"/dev/shm/{name}").unlink(missing_ok=True)
