"""sd_notify, loudly: a missing or broken NOTIFY_SOCKET would silently leave a Type=notify unit
"activating" until its start timeout, so every failure is logged (the sdnotify package swallows them).

The protocol is one datagram of newline-separated KEY=VALUE fields on a Unix socket; a name that starts
with "@" is in the abstract namespace (sd_notify(3)). The standard library is enough, which also spares a
fresh machine a source-only dependency."""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("llm-appliance.notify")


class Notifier:
    def __init__(self, enabled: bool = True) -> None:
        self.address = os.environ.get("NOTIFY_SOCKET") if enabled else None
        self._socket: socket.socket | None = None
        self._broken = False
        if not self.address:
            if enabled:
                log.info(
                    "NOTIFY_SOCKET is not set: not started by systemd as Type=notify, so READY/WATCHDOG go nowhere"
                )
            return
        address = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._socket.connect(address)  # connects at once, so a wrong path is said at start
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        # Say so once: systemd will time the unit out, and the journal must say why.
        self._broken = True
        log.error("cannot notify systemd through NOTIFY_SOCKET=%s: %s", self.address, exc)

    def send(self, *fields: str) -> bool:
        if self._socket is None or self._broken:
            return False
        try:
            self._socket.sendall("\n".join(fields).encode())
        except OSError as exc:
            self._fail(exc)
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> bool:
        return self.send(f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self, status: str) -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")


def watchdog_interval(default_seconds: float) -> float | None:
    """Half of systemd's WatchdogSec (WATCHDOG_USEC), as sd_watchdog_enabled() advises; else the plan's."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if usec and (not pid or pid == str(os.getpid())):
        return int(usec) / 2_000_000
    return default_seconds / 2 if default_seconds else None
