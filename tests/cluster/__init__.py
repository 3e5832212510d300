"""A cluster of N nodes on this machine, made of Linux namespaces (docs/testing.md, "A cluster
inside the suite"):

    with cluster(nodes=2, shm="256m") as c:
        d = c.node(0).start_daemon()            # a real `h5serve start` inside node 0
        c.node(1).run([sys.executable, "-c", "import socket; print(socket.gethostname())"], timeout=30)
        c.node(0).address, c.node(0).hostname   # "10.223.23.1", "h5c1a2b3c-n0"
        c.node(0).shm()                          # {name: size} of node 0's /dev/shm

Each node: a network namespace with one veth into a bridge that lives in a namespace of its own
(tests/cluster/_net.py), its own host name (UTS) and /etc/hosts naming every node, a mount
namespace with private tmpfs on /dev/shm (``shm=`` bytes), /run and /tmp, and a pid namespace
whose init (tests/cluster/_init.py) reaps daemons; killing that init ends everything in the node.
The project, the interpreter and the cluster's ``shared`` directory are at the same paths on every
node (paths under /tmp or /run are bound through). Commands enter a node with ``nsenter``, never
``ip netns exec`` (which remounts /sys and hides /sys/fs/cgroup).

Every name made (network namespaces, links, host names, the shared directory) starts with the
run's tag; teardown, in ``finally``, SIGKILLs the nodes' inits by pid and removes only what
carries the tag. ``skip_reason()`` says why a cluster cannot be made here (not root, a command
missing, namespaces refused).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ._net import Network, pick_subnet
from ._node import PROJECT, Node, NodeDaemon, kill_tree

__all__ = ["Cluster", "Node", "NodeDaemon", "cluster", "kill_tree", "skip_reason"]

INIT = Path(__file__).resolve().parent / "_init.py"
_READY_S = 30.0
_COMMANDS = ("unshare", "nsenter", "ip")


def skip_reason() -> str | None:
    """Why no cluster can be made here, or None."""
    if os.geteuid() != 0:
        return "the namespace cluster needs root (network, mount and pid namespaces, tmpfs mounts)"
    missing = [c for c in _COMMANDS if shutil.which(c) is None]
    if missing:
        return f"the namespace cluster needs {', '.join(missing)} (util-linux, iproute2)"
    probe = subprocess.run(["unshare", "--net", "--mount", "--uts", "--ipc", "--pid", "--fork", "--mount-proc",
                            "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"this machine refuses new namespaces: {probe.stderr.strip()}"
    return None


class Cluster:
    """The nodes of one ``cluster()``; ``shared`` is a directory every node sees at this path."""

    def __init__(self, tag: str, network: Network, shared: Path, nodes: list[Node]) -> None:
        self.tag = tag
        self.network = network
        self.shared = shared
        self.nodes = nodes

    def node(self, i: int) -> Node:
        return self.nodes[i]


def hosts_file(network: Network) -> str:
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{network.address(i)}\t{network.node_ns(i)}" for i in range(network.nodes)]
    return "\n".join(lines) + "\n"


def _share_list(shared: Path, extra: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Every path the nodes must see as the host does: the project, the interpreter, the shared
    dir and ``extra``. Only those under /tmp or /run need binding; the init skips the rest."""
    paths = {PROJECT, Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).resolve().parent, shared}
    return sorted({str(Path(p).resolve()) for p in (*paths, *extra)})


def _start_init(network: Network, i: int, config: dict[str, Any]) -> Node:
    """Node ``i``'s init, in its network namespace, with new mount, UTS, IPC and pid namespaces.
    ``--kill-child``: if the unshare process dies, so does the init, and with it the node."""
    cmd = ["nsenter", f"--net={network.netns_path(i)}", "--", "unshare", "--mount", "--uts", "--ipc", "--pid",
           "--fork", "--kill-child", "--mount-proc", "--", sys.executable, "-I", str(INIT), json.dumps(config)]
    launcher = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    node = Node(i, network.node_ns(i), network.address(i), network.netns_path(i), launcher)
    deadline = time.monotonic() + _READY_S
    line = ""
    assert launcher.stdout is not None
    while time.monotonic() < deadline and not line:
        if select.select([launcher.stdout], [], [], deadline - time.monotonic())[0]:
            line = launcher.stdout.readline() or "exited"
    if line.strip() != "ready":
        kill_tree(launcher.pid)
        _, err = launcher.communicate()
        raise RuntimeError(f"node {i} did not start: {line.strip() or 'no answer in 30 s'} {err}".strip())
    node.find_init()
    return node


def _remove_tagged(tag: str) -> list[str]:
    """Anything of this run in the host's /dev/shm or /tmp (there only if a node's isolation
    failed): removed, and reported."""
    found = [Path(d) / name for d in ("/dev/shm", "/tmp") for name in os.listdir(d) if name.startswith(tag)]
    for path in found:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return [f"{path} on the host (removed)" for path in found]


@contextlib.contextmanager
def cluster(nodes: int = 2, shm: str = "256m", share: Sequence[str | os.PathLike[str]] = ()) -> Iterator[Cluster]:
    """``nodes`` namespace nodes, each with a ``shm``-sized /dev/shm (mount's syntax: ``256m``);
    ``share``: more host paths every node must see (the cluster's ``shared`` dir always is).
    Skips the calling test (pytest.skip) where ``skip_reason()`` says so."""
    reason = skip_reason()
    if reason:
        import pytest

        pytest.skip(reason)
    tag = f"h5c{secrets.token_hex(3)}"
    network = Network(tag, pick_subnet(), nodes)
    shared = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir="/tmp"))
    shared.chmod(0o755)
    made: list[Node] = []
    try:
        network.create()
        (shared / "hosts").write_text(hosts_file(network))
        paths = _share_list(shared, share)
        for i in range(nodes):
            config = {"hostname": network.node_ns(i), "hosts": str(shared / "hosts"), "shm": shm, "share": paths}
            made.append(_start_init(network, i, config))
        yield Cluster(tag, network, shared, made)
    finally:
        problems = [p for node in made for p in node.end()]
        problems += network.remove()
        shutil.rmtree(shared, ignore_errors=True)
        problems += _remove_tagged(tag)
        if problems:
            raise RuntimeError(f"cluster {tag} teardown left: {'; '.join(problems)}")

