"""h5serve's benchmark suite: ``python -m bench`` (see bench/run.py and docs/benchmarks.md)."""
