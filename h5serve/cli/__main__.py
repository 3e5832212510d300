"""``python -m h5serve.cli`` is ``python -m h5serve``: the ``h5serve`` command."""

import runpy

runpy.run_module("h5serve", run_name="__main__", alter_sys=True)
