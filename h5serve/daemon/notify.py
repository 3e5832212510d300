"""systemd's notify protocol, written by hand (no libsystemd): one datagram per message to
the AF_UNIX socket named by $NOTIFY_SOCKET.

READY=1 once the socket answers, STATUS= with what the daemon holds, WATCHDOG=1 at half the
$WATCHDOG_USEC interval (only when $WATCHDOG_PID is unset or ours), EXTEND_TIMEOUT_USEC= while
loads run, STOPPING=1 on shutdown. Without $NOTIFY_SOCKET every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

__all__ = ["Notifier"]

log = logging.getLogger("h5serve.daemon")
EXTEND_EVERY_S = 5.0
EXTEND_BY_S = 30.0


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        address = env.get("NOTIFY_SOCKET", "")
        self._address = "\0" + address[1:] if address.startswith("@") else address
        self._sock: socket.socket | None = None
        if self._address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        self.watchdog_interval = int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 and mine else 0.0
        self._last_watchdog = 0.0
        self._last_extend = 0.0
        self._loading = False
        self._last_status = ""
        # Children (loader processes) must not speak for the daemon.
        if env is os.environ:
            for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                os.environ.pop(name, None)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, **fields: object) -> None:
        if self._sock is None:
            return
        message = "\n".join(f"{key.upper()}={value}" for key, value in fields.items())
        try:
            self._sock.sendto(message.encode(), self._address)
        except OSError as exc:  # the manager went away: keep serving
            log.debug("sd_notify failed: %s", exc)

    def ready(self, status: str) -> None:
        self._last_status = status
        self.send(ready=1, status=status)

    def status(self, status: str) -> None:
        if status != self._last_status:
            self._last_status = status
            self.send(status=status)

    def tick(self, loading: bool) -> None:
        """Call from the control loop: pets the watchdog when due; while loads run, asks for
        EXTEND_BY_S more of any pending timeout as a load starts and every EXTEND_EVERY_S."""
        now = time.monotonic()
        if self.watchdog_interval and now - self._last_watchdog >= self.watchdog_interval:
            self._last_watchdog = now
            self.send(watchdog=1)
        if loading and (not self._loading or now - self._last_extend >= EXTEND_EVERY_S):
            self._last_extend = now
            self.send(extend_timeout_usec=int(EXTEND_BY_S * 1e6))
        self._loading = loading

    def stopping(self, why: str = "") -> None:
        self.send(stopping=1, status=f"stopping{f' ({why})' if why else ''}: unlinking segments")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
