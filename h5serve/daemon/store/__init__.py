"""The daemon's segment registry: the store (store.py), its records and load index, reaping
finished loads, the load queue, eviction for prefetch, the stale sweep, leftovers of an
earlier daemon, the words of refusals, the status report.
"""

__all__: list[str] = []
