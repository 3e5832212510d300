"""Which rows, in which order: pure functions, no I/O, no torch at import. Every mode's rows as
one canonical ``RowRange`` and the selection vocabulary the wire, the segments and the loaders
share (sharding.py); equal batches on every rank (equalise.py); stream mode's block order
(stream_order.py) and the window a node's memory allows (stream_plan.py). The samplers in
h5serve.client draw from these; ``h5serve inspect`` plans with them.

May import: h5serve.util, h5serve.errors
"""

__all__: list[str] = []
