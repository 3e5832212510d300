"""A real S3 API server on loopback for the ``remote`` group: moto's server app (what its
``moto_server`` command runs) in a subprocess of its own, wrapped in a WSGI layer that counts
what it answers, so that bytes fetched are counted at the server with no proxy in the path.

    python -m bench.s3server PORT [--as-is]    # serves http://127.0.0.1:PORT until killed

``GET /__bench__/counts`` answers the counters as JSON: ``get_bytes`` (body bytes of every 2xx
GET, ranged or not), ``gets`` and ``requests`` by method. ``S3Server`` starts it on a free
port, waits until it answers, and kills it by its pid on the way out. Objects are kept in memory
(``keep_objects_in_memory``: why there); ``--as-is`` serves them as moto does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
COUNTS_PATH = "/__bench__/counts"
START_TIMEOUT_S = 60


class Counting:
    """WSGI middleware: the body bytes of every successful GET, and requests by method."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.get_bytes = 0
        self.requests: dict[str, int] = {}

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "")
        if environ.get("PATH_INFO") == COUNTS_PATH:
            with self.lock:
                body = json.dumps({"get_bytes": self.get_bytes, "requests": dict(self.requests)}).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        status: list[int] = [0]

        def started(code: str, headers: list, exc_info: Any = None) -> Any:
            status[0] = int(code.split()[0])
            return start_response(code, headers, exc_info) if exc_info else start_response(code, headers)

        with self.lock:
            self.requests[method] = self.requests.get(method, 0) + 1
        return self._counted(self.app(environ, started), method, status)

    def _counted(self, body: Iterable[bytes], method: str, status: list[int]) -> Iterator[bytes]:
        sent = 0
        try:
            for piece in body:
                sent += len(piece)
                yield piece
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()
            if method == "GET" and 200 <= status[0] < 300:
                with self.lock:
                    self.get_bytes += sent


def keep_objects_in_memory() -> None:
    """Every GET of moto's, ranged or not, reads the whole object from its spooled temporary file
    under the object's lock (``FakeKey.value``) before slicing the range: a 16 KiB GET of a 256 MiB
    object cost ~0.2 s, and the GETs of one object ran one at a time, so a reader was charged per
    request, not per byte (the bare download of 256 MiB in 8 MiB ranges: 7.0 s, 33 requests; 71 s
    in 768 KiB ranges). A store's cost is per byte plus a first-byte latency; here each object's
    bytes are read once and kept (dropped when the object is written), so a range costs its own
    bytes (the slice and the send)."""
    from moto.s3.models import FakeKey

    read, write = FakeKey.value.fget, FakeKey.value.fset

    def value(self: Any) -> bytes:
        held = self.__dict__.get("_bench_bytes")
        if held is None:
            held = self.__dict__["_bench_bytes"] = read(self)
        return held

    def set_value(self: Any, new: bytes) -> None:
        self.__dict__.pop("_bench_bytes", None)
        write(self, new)

    FakeKey.value = property(value, set_value)  # type: ignore[method-assign,assignment]


def serve(port: int, as_is: bool = False) -> None:
    import logging

    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import run_simple

    if not as_is:
        keep_objects_in_memory()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    run_simple("127.0.0.1", port, Counting(DomainDispatcherApplication(create_backend_app)), threaded=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """``python -m bench.s3server`` on a free loopback port; ``with S3Server() as s3: s3.endpoint``."""

    def __init__(self, as_is: bool = False) -> None:
        self.as_is = as_is  # moto exactly as it comes: every GET reads the whole object (keep_objects_in_memory)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> S3Server:
        env = {**os.environ, "MOTO_PORT": str(self.port), "NO_PROXY": "127.0.0.1,localhost"}
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.s3server", str(self.port),
                                      *(["--as-is"] if self.as_is else [])], cwd=ROOT, env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                self.counts()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError(f"the S3 server on port {self.port} did not start") from None
                time.sleep(0.1)

    def counts(self) -> dict:
        with urllib.request.urlopen(self.endpoint + COUNTS_PATH, timeout=30) as reply:
            return dict(json.loads(reply.read()))

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()


def aws_env(endpoint: str, home: Path) -> dict[str, str]:
    """The environment every reader of the server needs: dummy credentials, the endpoint under
    the names boto3/s3fs (AWS_ENDPOINT_URL) and Streaming (S3_ENDPOINT_URL) read, no ~/.aws."""
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint, "S3_ENDPOINT_URL": endpoint, "AWS_CONFIG_FILE": str(home / "none"),
            "AWS_SHARED_CREDENTIALS_FILE": str(home / "none"), "NO_PROXY": "127.0.0.1,localhost"}


if __name__ == "__main__":
    serve(int(sys.argv[1]), as_is="--as-is" in sys.argv[2:])
