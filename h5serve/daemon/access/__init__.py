"""Who may read what: the requesting peer and its right to read a file (peer.py), root's
privileges, the naming secret, the descriptor hand-out's server (fdserver.py), the resolver
(resolver.py: a request's file opened and checked) and its answer (resolved.py), the
metadata inspection in a child process (inspector.py, inspection.py).
"""

__all__: list[str] = []
