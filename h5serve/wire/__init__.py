"""The wire between a client and its node's daemon, and how each finds the other: every
message and its checks (protocol.py), the client end of the socket (connection.py: request ids,
deadlines, untrusted daemons refused), waking a waiting client when its segment is published
(arrival.py), and the runtime dir: where a daemon's socket, pidfile and shm dir are and whom a
client trusts (runtime.py, the only reader of ``H5SERVE_*``). Torch-free: the command line
uses it.

May import: h5serve.order, h5serve.util, h5serve.errors
"""

__all__: list[str] = []
