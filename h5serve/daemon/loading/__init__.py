"""The daemon's loads: loader processes (loader.py, run_load; parts.py for a load split across
processes), where they come from (loaderpool.py, spare.py, streamloader.py), the reservation,
variable-length and multi-file loads, the running checksum, stopping a load.
"""

__all__: list[str] = []
