"""Mapping a segment the daemon answered ready, and asking again when it was evicted meanwhile.

Between the daemon's ``ready`` and the client's mapping, the segment may be evicted (another
load needed its room) or replaced: the mapping then fails with SegmentError, and the answer
is stale. Every caller does the same thing about it: forget the answer, ask the daemon again
(which loads the segment again), map what it answers, for as long as its ``EvictionRetry``
allows. ``attach_asking_again`` is that loop for a caller that waits (``ShmBackend``,
stream mode's ``DaemonBlocks``); a caller that polls (``ProgressiveBackend``) keeps an
``EvictionRetry`` across its polls and resets its answers with ``asked_again``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from ...errors import SegmentError
from ...segments import AttachedSegment, PublishStamp, open_segment
from ...wire.connection import DaemonClient
from ...wire.protocol import AcquireResult

__all__ = ["ATTACH_TRIES", "EvictionRetry", "asked_again", "attach_asking_again", "check_same_shm", "open_acquired"]

ATTACH_TRIES = 3  # a segment evicted between the answer and the mapping is asked for again, this often


def check_same_shm(result: AcquireResult) -> None:
    """Raised when this process does not see the daemon's shm filesystem: SegmentError."""
    try:
        st = os.stat(result.shm_dir)
        same = (st.st_dev, st.st_ino) == (result.shm_dev, result.shm_ino)
    except OSError:
        same = False
    if not same:
        raise SegmentError(
            f"this process does not see the daemon's {result.shm_dir}: the daemon and this job do not share "
            "shared memory (a container without shared IPC / Docker's private /dev/shm, SLURM "
            "job_container/tmpfs, Apptainer --containall); see docs/operations.md"
        )


def open_acquired(client: DaemonClient, result: AcquireResult) -> AttachedSegment:
    """Map the segment an acquire answered ready, as the runtime dir's owner (checked to be
    trusted: never the uid the daemon reports) and against the reply's publish stamp.

    Raised when it cannot be mapped (evicted, changed, not the daemon's): SegmentError; when
    the daemon refuses this user its descriptor: AccessDenied.
    """
    owner = os.getuid() if client.daemon_uid is None else client.daemon_uid
    return open_segment(client.location.directory, result.shm_dir, result.name, owner,
                        PublishStamp(result.ino, result.ctime_ns))


@dataclass
class EvictionRetry:
    """How long a caller asks again for segments evicted between the answer and the mapping:
    until ``tries`` mappings failed, or (``deadline``, monotonic) until that time has passed;
    either or both."""

    tries: int | None = None
    deadline: float | None = None
    failed: int = 0

    def again(self) -> bool:
        """Count one failed mapping; whether to ask again (else the caller raises its error)."""
        self.failed += 1
        if self.tries is not None and self.failed >= self.tries:
            return False
        return self.deadline is None or time.monotonic() <= self.deadline


def asked_again(result: AcquireResult) -> AcquireResult:
    """``result`` made a not-ready answer, so that the next step asks the daemon again."""
    return AcquireResult("loading", result.name, result.shm_dir)


def attach_asking_again(client: DaemonClient, result: AcquireResult | None, ask: Callable[[], AcquireResult],
                        retry: EvictionRetry) -> tuple[AttachedSegment, AcquireResult]:
    """The segment ``result`` names, mapped (with the answer it was mapped from); ``ask()`` for
    a fresh answer first when ``result`` is None or not ready, and again after each mapping that
    failed while ``retry`` allows.

    Raised when it stays unmappable: SegmentError; as ``ask`` and ``open_acquired`` are."""
    while True:
        if result is None or result.state != "ready":
            result = ask()
        try:
            return open_acquired(client, result), result
        except SegmentError:
            if not retry.again():
                raise
            result = None
