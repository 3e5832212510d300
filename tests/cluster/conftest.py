"""The namespace cluster as fixtures: one 3-node cluster per test module (making one costs well
under a second; sharing it keeps each module's daemons and their counters), its data file, and
a real daemon in every node."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ..helpers import make_h5
from . import Cluster, NodeDaemon, cluster

ROWS = 1000


@pytest.fixture(scope="module")
def nodes3() -> Iterator[Cluster]:
    with cluster(nodes=3, shm="64m") as c:
        yield c


@pytest.fixture(scope="module")
def data(nodes3: Cluster) -> Path:
    """``ROWS`` rows of make_h5's file in the cluster's shared dir: the same path on every node."""
    return make_h5(nodes3.shared / "train.h5", rows=ROWS)


@pytest.fixture(scope="module")
def daemons(nodes3: Cluster) -> Iterator[list[NodeDaemon]]:
    """A daemon in each node, on the node's default runtime dir (jobs find it without settings)."""
    started: list[NodeDaemon] = []
    try:
        for node in nodes3.nodes:
            started.append(node.start_daemon())
        yield started
    finally:
        for d in started:
            d.stop()
