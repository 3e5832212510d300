"""Where a dataset's rows come from: the Backend protocol, shared memory, h5py (one file or
many), private memory, h5py until the daemon is ready (progressive.py), mapping a
segment and asking again (attach.py), the caches the lazy reads use.
"""

__all__: list[str] = []
