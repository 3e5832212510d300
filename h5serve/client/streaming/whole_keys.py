"""The keys a stream holds whole (labels: ``stream.whole_keys``, rows small beside the budget):
one global segment each, asked for with the stream's first prefetch (their loads start then),
mapped at their first use and held until the dataset closes. DaemonBlocks serves the other keys
block by block."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from ...errors import CapacityError
from ...order.sharding import GLOBAL
from ...segments import AttachedSegment
from ...wire.connection import DaemonClient
from ...wire.protocol import Acquire, AcquireResult
from ..backends.sources import ShmBackend
from ..gather import as_column
from ..ragged import RaggedColumn
from ..spec import BackendSpec

__all__ = ["WholeKeys"]

# waits for a request's segment to be loaded (DaemonBlocks._wait_ready: a load, and room)
WaitReady = Callable[[DaemonClient, Acquire], AcquireResult]


class WholeKeys:
    """The keys of ``spec`` marked in ``whole``, each one global segment of this process."""

    def __init__(self, spec: BackendSpec, whole: list[bool], out_dtypes: list[np.dtype]) -> None:
        self.spec, self.out_dtypes = spec, out_dtypes
        self.indices = [i for i, w in enumerate(whole) if w]
        self.asked = not self.indices  # their acquires sent (their loads started); nothing to ask without any
        self._mapped: dict[int, AttachedSegment] = {}  # by key index

    def request(self, index: int) -> Acquire:
        sel = self.spec.selection
        dtype = self.spec.dtypes[index]
        return Acquire(self.spec.path, self.spec.keys[index], sel.world_size, sel.rank, GLOBAL,
                       None if dtype is None else dtype.str, pin=self.spec.pin)

    def start(self, client: DaemonClient) -> None:
        """Ask for every whole key once, without waiting: their loads start now."""
        if self.asked:
            return
        self.asked = True
        for index in self.indices:
            try:
                client.request(self.request(index))
            except CapacityError:
                break  # asked again, waiting, at their first use

    def column(self, index: int, rows: np.ndarray, client: DaemonClient, wait_ready: WaitReady,
               wait_s: float) -> torch.Tensor | np.ndarray | RaggedColumn:
        """Key ``index``'s rows ``rows``, its segment mapped at its first use (``wait_ready``:
        waiting as a needed block waits) and held.

        Raised when there is no room in time: BudgetExceeded or ShmFull; as a load fails."""
        segment = self._mapped.get(index)
        if segment is None:
            request = self.request(index)
            result = wait_ready(client, request)
            segment = ShmBackend.attach_one(client, request, result,
                                            None if self.spec.timeout is None else time.monotonic() + wait_s)
            self._mapped[index] = segment
        taken = segment.data.take(rows, axis=0)
        wanted = self.out_dtypes[index]
        return as_column(taken if taken.dtype == wanted else taken.astype(wanted))

    def close(self) -> None:
        for segment in self._mapped.values():
            segment.close()
        self._mapped.clear()
