"""The cluster's network (tests/cluster): a bridge in a network namespace of its own and one
network namespace per node, joined by a veth pair created inside the bridge's namespace, so the
host's namespace never holds a new link, address or route. Every name starts with the run's tag;
``remove`` deletes only names that do.

Nodes get ``SUBNET.<1 + i>/24`` and no default route: traffic to any other address fails in the
node (ENETUNREACH) instead of leaving it, and the bridge has no uplink.
"""

from __future__ import annotations

import ipaddress
import subprocess
from dataclasses import dataclass

__all__ = ["Network", "pick_subnet"]

NETNS_DIR = "/run/netns"
CANDIDATE_SUBNETS = ("10.223.23.0/24", "10.224.23.0/24", "172.30.223.0/24", "192.168.223.0/24")


def ip(*args: str, timeout: float = 30) -> str:
    """``ip ARGS``; raises RuntimeError with ip's message when it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def pick_subnet() -> ipaddress.IPv4Network:
    """The first candidate /24 that no address or route of the host's namespace touches (the
    nodes could reuse one, being isolated, but a reader of `ip` output should never confuse them)."""
    used = []
    for line in ip("-o", "-4", "addr").splitlines() + ip("-4", "route").splitlines():
        for word in line.replace("/", " / ").split():
            try:
                used.append(ipaddress.ip_address(word))
            except ValueError:
                pass
    for candidate in CANDIDATE_SUBNETS:
        net = ipaddress.ip_network(candidate)
        if not any(a in net for a in used):
            return net
    raise RuntimeError(f"every candidate subnet {CANDIDATE_SUBNETS} is in use on this host")


@dataclass(frozen=True)
class Network:
    tag: str
    subnet: ipaddress.IPv4Network
    nodes: int

    @property
    def bridge_ns(self) -> str:
        return f"{self.tag}-br"

    @property
    def bridge(self) -> str:
        return f"{self.tag}-b"

    def node_ns(self, i: int) -> str:
        return f"{self.tag}-n{i}"

    def netns_path(self, i: int) -> str:
        return f"{NETNS_DIR}/{self.node_ns(i)}"

    def address(self, i: int) -> str:
        return str(self.subnet.network_address + 1 + i)

    def create(self) -> None:
        """Everything, in the order that needs no link in the host's namespace. A failure
        leaves what was made for ``remove``."""
        ip("netns", "add", self.bridge_ns)
        ip("-n", self.bridge_ns, "link", "add", self.bridge, "type", "bridge")
        ip("-n", self.bridge_ns, "link", "set", self.bridge, "up")
        for i in range(self.nodes):
            ns, outside, inside = self.node_ns(i), f"{self.tag}-p{i}", f"{self.tag}-e{i}"
            ip("netns", "add", ns)
            ip("-n", self.bridge_ns, "link", "add", outside, "type", "veth", "peer", "name", inside, "netns", ns)
            ip("-n", self.bridge_ns, "link", "set", outside, "master", self.bridge, "up")
            ip("-n", ns, "addr", "add", f"{self.address(i)}/{self.subnet.prefixlen}", "dev", inside)
            ip("-n", ns, "link", "set", inside, "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def names(self) -> list[str]:
        """The network namespaces of this run that exist now."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        return [line.split()[0] for line in listed.splitlines() if line.split() and line.split()[0].startswith(
            f"{self.tag}-")]

    def remove(self) -> list[str]:
        """Delete this run's namespaces (their links go with them); returns what could not be."""
        failed = []
        for name in self.names():
            done = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                failed.append(f"{name}: {done.stderr.strip()}")
        return failed
