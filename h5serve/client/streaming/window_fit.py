"""What a stream's window may hold on this node: the daemon's budget (``daemon_window``,
``check_window``) and, in each process, the kernel's limits on mappings and descriptors
(``mappable_blocks``)."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import ConfigError
from ...hdf5.source import DatasetInfo
from ...order.sharding import STREAM
from ...segments.arena import ARENA_VERSION
from ...segments.stitch import mappings_in_use, max_mappings
from ...util.units import format_bytes, row_nbytes
from ...wire.connection import DaemonClient
from ...wire.protocol import Acquire
from ..spec import BackendSpec

__all__ = ["DaemonWindow", "KERNEL_SHARE", "MAX_MAPPED_ENV", "check_window", "daemon_window", "mappable_blocks",
           "past_the_cap", "remote_probe"]

# of the memory mappings (vm.max_map_count) and descriptors (RLIMIT_NOFILE) the kernel lets a
# process have, the share a stream's mapped blocks may take; the rest is the program's own
KERNEL_SHARE = 0.5
MAX_MAPPED_ENV = "H5SERVE_MAX_MAPPED_BLOCKS"  # a lower cap on the blocks a process keeps mapped (tests, sites)


@dataclass(frozen=True)
class DaemonWindow:
    """What the client learnt from the node's daemon for stream mode: its memory budget, and
    whether it offers stream arenas."""

    budget: int  # the daemon's --max-memory (or what it derived from /dev/shm), bytes
    # its ping offers the arena layout this client maps (a daemon started with H5SERVE_ARENA=1);
    # False: an older daemon, or one started without it: a segment per block
    arena: bool = False


def daemon_window(spec: BackendSpec, probe: Acquire | None = None) -> DaemonWindow:
    """Ask the node's daemon (ping) for its budget and whether it offers arenas; with ``probe``
    (an s3:// object's first row of its smallest key, ``remote_probe``), whether it fetches that
    object for this job at all, so that a refusal (``--allow-url``) falls back before the first
    batch, as in global mode.

    Raised when no (trusted) daemon answers: DaemonUnavailable (or UntrustedDaemon); when it
    refuses the probe: its error (AccessDenied, SourceChanged, ObjectStoreError...)."""
    with DaemonClient(spec.runtime_dir, spec.timeout, spec.daemon_user) as client:
        info = client.ping()
        budget = info.get("budget")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:  # an older daemon: its status
            budget = int(client.status()["memory"]["budget"])
        if probe is not None:
            client.acquire(probe, deadline=None if spec.timeout is None else time.monotonic() + spec.timeout)
    return DaemonWindow(budget, info.get("arena") == ARENA_VERSION)


def remote_probe(spec: BackendSpec, infos: Sequence[DatasetInfo]) -> Acquire | None:
    """For an s3:// object the daemon is to fetch (``spec.pin``): an acquire of the first row
    of its key of the smallest rows, the cheapest load that tells whether the daemon fetches it
    (one row and the object's metadata); None for a local file."""
    pin = spec.pins[0] if spec.pins else spec.pin  # many objects: the first (a block names one object)
    if pin is None:
        return None
    index = min(range(len(infos)), key=lambda i: row_nbytes(infos[i].row_shape, infos[i].dtype))
    dtype = spec.dtypes[index]
    sel = spec.selection
    return Acquire(spec.path, spec.keys[index], sel.world_size, sel.rank, STREAM,
                   None if dtype is None else dtype.str, rows=(0, 1), pin=pin)


def mappable_blocks(keys: int, stitched: bool, floor: int) -> int:
    """How many blocks of ``keys`` streamed keys this process may keep mapped within KERNEL_SHARE
    of the kernel's limits, counting what it maps and opens already: a stitched block takes
    a mapping per key and splits its stitch's reservation once more (no descriptor: the slot's
    mapping holds the file); an unstitched one a mapping and two descriptors per key (ours,
    holding the lease, and Python's mmap's own). At least ``floor``; ``MAX_MAPPED_ENV`` lowers
    it. A batch's own blocks are mapped whatever the cap (at most its rows')."""
    keys = max(keys, 1)
    room = (int(max_mappings() * KERNEL_SHARE) - mappings_in_use()) // (2 * keys)
    if not stitched:
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if limit != resource.RLIM_INFINITY:
            try:
                open_now = len(os.listdir("/proc/self/fd"))
            except OSError:
                open_now = 0
            room = min(room, (int(limit * KERNEL_SHARE) - open_now) // (2 * keys))
    room = max(room, floor)
    asked = os.environ.get(MAX_MAPPED_ENV, "")
    return min(room, int(asked)) if asked.isdigit() and int(asked) > 0 else room


def check_window(window: int, capacity: int, block_bytes: int, block_cost: int, budget: int) -> None:
    """Raised when a window of ``capacity`` blocks costing ``block_cost`` each in shared memory
    (``block_bytes`` of rows and a header page per key, in whole pages) does not fit the daemon's ``budget``:
    ConfigError naming them."""
    if capacity * block_cost > budget:
        fits = budget // block_cost
        raise ConfigError(
            f"window={format_bytes(window)} holds {capacity} blocks (those in use and those prefetched ahead of "
            f"them), which take {capacity} x {format_bytes(block_cost)} = {format_bytes(capacity * block_cost)} in "
            f"the daemon's shared memory (rows and a header page per key, in whole pages), more than its budget of "
            f"{format_bytes(budget)}: pass a window of at most {format_bytes(fits * block_bytes)} ({fits} blocks), "
            "window=None for what the budget holds, or start the daemon with a larger --max-memory")


def past_the_cap(window: int, cap: int) -> str:
    """The warning for a window of more blocks than this process may keep mapped."""
    return (f"h5serve: the stream's window holds {window} blocks but this process may keep only {cap} mapped "
            f"(half of vm.max_map_count and of the open-files limit, or {MAX_MAPPED_ENV}): batches drawn across the "
            "window will map many blocks again, each an attach and a request (an epoch can take several times "
            "longer; the order is unchanged). Raise vm.max_map_count (sysctl), use larger blocks (block_rows=), "
            "or a smaller window (window=)")
