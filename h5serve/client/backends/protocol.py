"""``Backend``: what a dataset asks of whatever serves its rows (client/backends/sources.py: shared
memory, h5py, private memory; client/backends/files.py: h5py over many files; client/backends/progressive.py:
h5py until the daemon's segments are ready; client/streaming/backend.py: stream mode's blocks).

The dataset calls these and nothing else, so it never asks which backend it holds: a backend
with nothing to do for a hook takes ``NoHooks``'s, which do nothing (``check``, ``retain``,
``finish``) or answer at once (``wait``).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from ..ragged import RaggedColumn
from ..streaming.batch import StreamBatch

__all__ = ["Backend", "Column", "NoHooks"]

Column = torch.Tensor | np.ndarray | RaggedColumn  # one key's rows of a batch


class Backend(Protocol):
    """Rows by position in this rank's shard, in the output dtypes."""

    @property
    def name(self) -> str:
        """``"shm"``, ``"lazy"``, ``"lazy (loading)"`` or ``"memory"``: what ``SharedH5Dataset.backend`` says."""
        ...

    @property
    def out_dtypes(self) -> list[np.dtype]: ...

    @property
    def total_rows(self) -> int: ...

    @property
    def vlen_kinds(self) -> list[str]:
        """Per key: "" (fixed-size rows), else how its variable-length rows read."""
        ...

    def gather(self, positions: torch.Tensor) -> list[Column]:
        """Fresh, writable columns (one per key) of the rows at ``positions`` (int64, valid)."""
        ...

    def close(self) -> None: ...

    def check(self) -> None:
        """Settle what is pending without waiting (a load finished: switch to it)."""
        ...

    def wait(self, timeout: float | None = None) -> str:
        """Wait, at most ``timeout`` s, until nothing is pending; the name then."""
        ...

    def retain(self, batch: StreamBatch) -> None:
        """Before a stream batch is gathered: the blocks it says the window holds kept, the others freed."""
        ...

    def finish(self, batch: StreamBatch) -> None:
        """After a stream batch was gathered: the blocks it used for the last time closed."""
        ...


class NoHooks:
    """The hooks of a backend that has nothing pending and no stream window: ``check``,
    ``retain`` and ``finish`` do nothing, ``wait`` answers at once."""

    name: str

    def check(self) -> None:
        return None

    def wait(self, timeout: float | None = None) -> str:
        return self.name

    def retain(self, batch: StreamBatch) -> None:
        return None

    def finish(self, batch: StreamBatch) -> None:
        return None
