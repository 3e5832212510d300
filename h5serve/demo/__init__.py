"""``h5serve demo``: a real torchrun job served by a real daemon, the same job again, and the
predecessor's way without a daemon, measured side by side (``run.py``; each rank runs
``train.py``). ``DaemonProcess`` (daemon.py) starts and stops a daemon through the command line,
for the demo, the tests and the benchmarks.

May import: h5serve.client, h5serve.segments, h5serve.wire, h5serve.util, h5serve.errors
"""

from .run import DEFAULT_ROWS, DemoResult, make_sample_file, run_demo

__all__ = ["run_demo", "make_sample_file", "DemoResult", "DEFAULT_ROWS"]
