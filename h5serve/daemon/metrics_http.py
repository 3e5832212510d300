"""The metrics endpoint's HTTP server (``--metrics-port``): one thread, one selector, at most
``MAX_CONNECTIONS`` connections at once, each closed ``CONNECTION_TIMEOUT_S`` after it was
accepted whether or not it sent a request.

Why not prometheus_client's ``start_http_server``: it is a ``ThreadingHTTPServer``, a thread
and a descriptor for every connection for as long as the peer keeps it open; 2,000 idle TCP
connections from any local user took the daemon's descriptors and libzmq aborted the daemon.
Here the descriptors are bounded (the connections, the listener, a wake-up pair, the
selector's own), far below the ZeroMQ connection guard's reserve (server.py). A new
connection while all are taken replaces the oldest one that has not sent its request yet, so
a flood of idle connections cannot keep a scraper out for long; connections waiting in the
kernel's accept queue hold no descriptor of ours.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["MetricsHTTPServer", "MAX_CONNECTIONS", "CONNECTION_TIMEOUT_S", "MAX_REQUEST_BYTES"]

log = logging.getLogger("h5serve.daemon")
MAX_CONNECTIONS = 16  # a scraper or two, and room for a person's curl
CONNECTION_TIMEOUT_S = 5.0  # from accept to the last byte of the reply
MAX_REQUEST_BYTES = 8192  # a request line and headers; more is refused
_ACCEPT_BACKLOG = 64  # the kernel's queue of connections not yet accepted: no descriptor of ours
_IDLE_WAKE_S = 1.0


@dataclass
class _Connection:
    sock: socket.socket
    deadline: float
    request: bytearray = field(default_factory=bytearray)
    reply: memoryview | None = None  # set once the request is read


class MetricsHTTPServer:
    """Serve ``render()`` (the exposition text and its content type) at ``GET /metrics`` (and
    ``/``) on ``addr:port`` from a thread of its own until ``close``."""

    def __init__(self, addr: str, port: int, render: Callable[[], tuple[bytes, str]],
                 max_connections: int = MAX_CONNECTIONS, timeout: float = CONNECTION_TIMEOUT_S) -> None:
        self.render = render
        self.max_connections = max_connections
        self.timeout = timeout
        family, kind, proto, _, address = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        self.listener = socket.socket(family, kind, proto)
        try:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.listener.bind(address)
            self.listener.listen(_ACCEPT_BACKLOG)
            self.listener.setblocking(False)
            self._wake_r, self._wake_w = socket.socketpair()
        except BaseException:
            self.listener.close()
            raise
        self.server_port: int = self.listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._selector.register(self.listener, selectors.EVENT_READ)
        self._accepting = True
        self._connections: dict[socket.socket, _Connection] = {}
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="h5serve-metrics", daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        return len(self._connections)

    def close(self) -> None:
        self._closed.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=5)
        for sock in (self.listener, self._wake_r, self._wake_w):
            sock.close()

    def _serve(self) -> None:
        try:
            while not self._closed.is_set():
                now = time.monotonic()
                wait = min((c.deadline for c in self._connections.values()), default=now + _IDLE_WAKE_S) - now
                for key, mask in self._selector.select(max(0.0, min(wait, _IDLE_WAKE_S))):
                    sock = key.fileobj
                    if sock is self.listener:
                        self._accept()
                    elif sock is not self._wake_r and isinstance(sock, socket.socket) and sock in self._connections:
                        self._step(self._connections[sock], mask)
                self._expire(time.monotonic())
        except Exception:  # noqa: BLE001 - metrics never take the daemon down; they stop, and say so
            log.exception("the metrics endpoint stopped")
        finally:
            for conn in list(self._connections.values()):
                self._drop(conn)
            self._selector.close()

    def _accept(self) -> None:
        while True:
            if len(self._connections) >= self.max_connections and not self._evict_idle():
                self._pause_accepting()
                return
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors (EMFILE): what is queued waits in the kernel
                log.warning("metrics endpoint: cannot accept a connection: %s", exc)
                self._pause_accepting()
                return
            sock.setblocking(False)
            self._connections[sock] = _Connection(sock, time.monotonic() + self.timeout)
            self._selector.register(sock, selectors.EVENT_READ)

    def _evict_idle(self) -> bool:
        """Close the oldest connection that has not sent its request; False when all have."""
        waiting = [c for c in self._connections.values() if c.reply is None]
        if not waiting:
            return False
        self._drop(min(waiting, key=lambda c: c.deadline))
        return True

    def _pause_accepting(self) -> None:
        if self._accepting:
            self._selector.unregister(self.listener)
            self._accepting = False

    def _drop(self, conn: _Connection) -> None:
        self._connections.pop(conn.sock, None)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        if not self._accepting and len(self._connections) < self.max_connections:
            self._selector.register(self.listener, selectors.EVENT_READ)
            self._accepting = True

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._connections.values() if c.deadline <= now]:
            self._drop(conn)

    def _step(self, conn: _Connection, mask: int) -> None:
        try:
            if conn.reply is None and mask & selectors.EVENT_READ:
                chunk = conn.sock.recv(MAX_REQUEST_BYTES)
                if not chunk:
                    self._drop(conn)
                    return
                conn.request += chunk
                if b"\r\n\r\n" not in conn.request and b"\n\n" not in conn.request:
                    if len(conn.request) > MAX_REQUEST_BYTES:
                        self._respond(conn, 431, b"request header fields too large\n")
                    return
                self._respond(conn, *self._answer(bytes(conn.request)))
            elif conn.reply is not None and mask & selectors.EVENT_WRITE:
                self._send(conn)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:  # the peer went away
            self._drop(conn)

    def _answer(self, request: bytes) -> tuple[int, bytes, str]:
        method, _, rest = request.partition(b" ")
        target = rest.split(b" ", 1)[0].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return 405, b"only GET\n", "text/plain"
        if target not in (b"/metrics", b"/"):
            return 404, b"not found: try /metrics\n", "text/plain"
        body, content_type = self.render()
        return 200, b"" if method == b"HEAD" else body, content_type

    def _respond(self, conn: _Connection, status: int, body: bytes, content_type: str = "text/plain") -> None:
        reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 431: "Request Header Fields Too Large"}
        head = (f"HTTP/1.1 {status} {reason.get(status, '')}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        conn.reply = memoryview(head + body)
        self._selector.modify(conn.sock, selectors.EVENT_WRITE)
        self._send(conn)

    def _send(self, conn: _Connection) -> None:
        assert conn.reply is not None
        sent = conn.sock.send(conn.reply)
        conn.reply = conn.reply[sent:]
        if not conn.reply:
            self._drop(conn)
