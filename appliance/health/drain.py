"""The drain before a restart, as a state machine on an injected clock: not-ready first, then the balancer's
time to notice (drain_seconds), then the requests in flight (idle_timeout at the latest), then the restart.

Pure: the daemon steps it once per check with the time and whether llama-server is busy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# "drain": the balancer may still send new requests; "wait": requests in flight; "restart": nothing left to cut.
Step = Literal["drain", "wait", "restart"]


@dataclass
class Drain:
    drain_seconds: float
    idle_timeout_seconds: float
    started: float | None = None

    @property
    def active(self) -> bool:
        return self.started is not None

    def step(self, now: float, busy: bool) -> Step:
        if self.started is None:
            self.started = now
        elapsed = now - self.started
        if elapsed < self.drain_seconds:
            return "drain"
        # The idle timeout counts from the end of the drain: only then no new request can arrive.
        if busy and elapsed < self.drain_seconds + self.idle_timeout_seconds:
            return "wait"
        return "restart"

    def remaining(self, now: float) -> float:
        """Seconds until the balancer has stopped sending (0 once it has, or when not draining)."""
        return 0.0 if self.started is None else max(0.0, self.started + self.drain_seconds - now)

    def cancel(self) -> None:
        self.started = None
