"""The crc of a segment's rows (h5serve/util/crc.py's LOAD_CRC), computed as the rows are written.

Each loader process hashes the rows of its own part as they pass on their way into the
segment (``read_shard_into(hashed=...)``): rows copied file to file go through a small buffer
(pread, hash, pwrite: rawcopy.HASHED_COPY_BYTES; a load read by one process writes in a
second thread, rawcopy.WriteBehind, while it reads and hashes the next buffer), rows read
through h5py are hashed in the staging buffer before they are written. The parts' crcs are
joined in row order with ``LOAD_CRC.combine``.

History: a load first copied every row and then read the whole segment again for its crc
(~0.15 s for 293 MiB on 2 cores); then a thread hashed the rows through the segment's mapping
a block behind the copy. Both read every byte from memory a second time and fault in every
page of the mapping (and unmapping those pages cost 10-20 ms after the last row); where
copies are bound by memory bandwidth, as on the bench's VM, the thread made a 307 MB copy
1.6x slower. Hashing the bytes while they are in the CPU's cache costs the hash alone.
"""

from __future__ import annotations

from ...util.crc import LOAD_CRC

__all__ = ["RunningCrc"]


class RunningCrc:
    """The LOAD_CRC of every byte given to ``update``, in order."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: memoryview) -> None:
        self.value = LOAD_CRC.update(data, self.value)
