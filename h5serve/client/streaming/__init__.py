"""Stream mode: the backend and its block layout and window (backend.py), the sampler and
its batches, the blocks from a daemon (daemon_blocks.py, stitched.py) or read here
(blockcache.py), automatic stream mode.
"""

__all__: list[str] = []
