"""The namespace cluster itself (tests/cluster/__init__.py): what its tests rely on about the
nodes, checked from inside them: each its own host name, /etc/hosts, network (no way out), /dev/shm
of the asked size, /tmp and /run, pid namespace whose init reaps; the project and shared files at
the same paths; the host's network untouched; nothing of the run left after teardown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ..helpers import wait_for
from . import cluster, kill_tree

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(120)]

PROBE = textwrap.dedent("""
    import errno, json, os, socket, sys
    out = {"host": socket.gethostname(), "hosts": open("/etc/hosts").read(), "pid": os.getpid(),
           "cgroup": os.path.isdir("/sys/fs/cgroup") and bool(os.listdir("/sys/fs/cgroup"))}
    st = os.statvfs("/dev/shm")
    out["shm_bytes"] = st.f_blocks * st.f_frsize
    out["shm"] = sorted(os.listdir("/dev/shm"))
    out["tmp"] = sorted(os.listdir("/tmp"))
    out["shared"] = open(sys.argv[1]).read()
    out["peers"] = {name: socket.gethostbyname(name) for name in sys.argv[2:]}
    try:  # outside the cluster's /24 there is no route: nothing leaves the node
        socket.create_connection(("203.0.113.1", 9), timeout=5)
        out["outside"] = "connected"
    except OSError as exc:
        out["outside"] = errno.errorcode.get(exc.errno, str(exc))
    print(json.dumps(out))
""")


def host_network() -> list[str]:
    return [subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30).stdout
            for args in (["-o", "link"], ["-o", "addr"], ["route"], ["-6", "route"])]


def test_nodes_are_separate_machines_that_see_one_another() -> None:
    before = host_network()
    with cluster(nodes=2, shm="8m") as c:
        assert host_network() == before  # the host gets no new link, address or route
        names = [n.hostname for n in c.nodes]
        assert all(name.startswith(c.tag) for name in names) and len(set(names)) == 2
        (c.shared / "note").write_text("from the host")
        mine = f"{c.tag}-mine"  # tagged: were isolation broken, teardown still finds it on the host
        c.node(0).run(["sh", "-c", f"echo node0 > /dev/shm/{mine}; echo x > /tmp/{mine}"], timeout=30)
        seen = []
        for node in c.nodes:
            done = node.run([sys.executable, "-c", PROBE, str(c.shared / "note"), *names], timeout=60)
            assert done.returncode == 0, done.stdout
            seen.append(json.loads(done.stdout))
        for node, probe in zip(c.nodes, seen):
            assert probe["host"] == node.hostname
            assert probe["peers"] == {n.hostname: n.address for n in c.nodes}
            assert probe["shm_bytes"] == 8 * 2**20
            assert probe["shared"] == "from the host"  # a shared path under the host's /tmp, bound through
            assert probe["outside"] == "ENETUNREACH"
            assert probe["cgroup"]  # /sys is the host's: nsenter, not `ip netns exec`
            assert probe["pid"] < 100  # a pid namespace of its own
        assert seen[0]["shm"] == [mine] and seen[1]["shm"] == []  # private /dev/shm
        assert mine not in os.listdir("/dev/shm")
        assert mine in seen[0]["tmp"] and mine not in seen[1]["tmp"] and not os.path.exists(f"/tmp/{mine}")
        assert c.node(0).shm() == {mine: 6}
        # node 1 reaches node 0 over the bridge
        listener = c.node(0).popen([sys.executable, "-c", "import socket; s = socket.create_server(('', 7777)); "
                                    "print('up', flush=True); c, _ = s.accept(); c.sendall(b'hello')"])
        try:
            assert listener.stdout is not None and listener.stdout.readline().strip() == "up"
            done = c.node(1).run([sys.executable, "-c", "import socket; "
                                  f"print(socket.create_connection(('{c.node(0).hostname}', 7777)).recv(5))"],
                                 timeout=30)
            assert done.stdout.strip() == "b'hello'", done.stdout
        finally:
            kill_tree(listener.pid)
            listener.wait()
        tag = c.tag
        inits = [n.init_pid for n in c.nodes]
    # torn down: no namespace, link or directory of the run, no process of the nodes
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert tag not in listed and host_network() == before
    assert not [p for p in os.listdir("/tmp") if p.startswith(tag)]
    assert not any(os.path.exists(f"/proc/{pid}") for pid in inits)


def test_the_init_reaps_orphans_and_takes_the_node_with_it() -> None:
    with cluster(nodes=1) as c:
        node = c.node(0)
        # a daemon-like double fork: the grandchild is orphaned to the node's init
        done = node.run(["sh", "-c", "sh -c 'exec sleep 600' </dev/null >/dev/null 2>&1 & echo $!"], timeout=30)
        orphan = node.host_pid(int(done.stdout.split()[-1]))
        assert orphan and wait_for(lambda: _parent(orphan) == node.init_pid, 10)
        os.kill(orphan, 9)
        assert wait_for(lambda: not os.path.exists(f"/proc/{orphan}"), 10)  # reaped, not left a zombie
        survivor = node.popen(["sleep", "600"])
        inside = wait_for(lambda: len(node.processes()) == 1, 10) and node.processes()[0]
        os.kill(node.init_pid, 9)  # the node's init goes: so does everything in it
        assert wait_for(lambda: not os.path.exists(f"/proc/{inside}"), 10)
        survivor.wait(timeout=10)


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return 0


def test_a_daemon_in_a_node_is_that_nodes_alone() -> None:
    with cluster(nodes=2) as c:
        d = c.node(0).start_daemon()
        try:
            status = d.status()
            assert status["running"] and status["shm_dir"] == "/dev/shm"
            assert d.host_pid in c.node(0).processes()
            done = c.node(1).run([sys.executable, "-m", "h5serve", "status"], timeout=60)
            assert done.returncode == 3, done.stdout  # node 1 has no daemon: the same runtime dir is its own
        finally:
            d.stop()
        assert not d.alive()
