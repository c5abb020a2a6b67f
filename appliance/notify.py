"""sd_notify, loudly: sdnotify swallows every error unless debug is on, so a missing or broken
NOTIFY_SOCKET would silently leave a Type=notify unit "activating" until its start timeout."""

from __future__ import annotations

import logging
import os

import sdnotify

log = logging.getLogger("llm-appliance.notify")


class Notifier:
    def __init__(self, enabled: bool = True) -> None:
        self.socket = os.environ.get("NOTIFY_SOCKET") if enabled else None
        self._notifier: sdnotify.SystemdNotifier | None = None
        self._broken = False
        if not self.socket:
            if enabled:
                log.info(
                    "NOTIFY_SOCKET is not set: not started by systemd as Type=notify, so READY/WATCHDOG go nowhere"
                )
            return
        try:
            self._notifier = sdnotify.SystemdNotifier(debug=True)  # connects at once
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        # Say so once: systemd will time the unit out, and the journal must say why.
        self._broken = True
        log.error("cannot notify systemd through NOTIFY_SOCKET=%s: %s", self.socket, exc)

    def send(self, *fields: str) -> bool:
        if self._notifier is None or self._broken:
            return False
        try:
            self._notifier.notify("\n".join(fields))
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
