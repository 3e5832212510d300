"""The samplers of global, contiguous, interleave and node mode, and refusing a second
sharding (resharding.py). Stream mode's sampler is in streaming/.
"""

__all__: list[str] = []
