"""The daemon's energy readings: a counter of joules per source, and joules per generated token over the
recent decode windows (the windows between two checks in which tokens were generated, as the decay detector
sees them). A source that cannot be read is said once in the log and exported not at all.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence

from appliance.facts.energy_meters import EnergyMeter, EnergyUnreadable
from appliance.health.exporter import Metrics

log = logging.getLogger("llm-appliance.health")
# Joules per token is the energy of the last few decode windows over their tokens: one short request in a
# window of idle draw is one high window, and a sum over several weighs it by its tokens.
RECENT_WINDOWS = 5


class EnergyProbe:
    def __init__(self, meters: Sequence[EnergyMeter], metrics: Metrics, recent: int = RECENT_WINDOWS) -> None:
        self.meters = list(meters)
        self.metrics = metrics
        self.recent = recent
        self.last: dict[str, float] = {}  # the last reading of each readable source
        self.start: dict[str, float] = {}  # the readings where the current window began
        self.windows: dict[str, deque[tuple[float, float]]] = {}  # source -> (joules, tokens) of recent windows
        self.said: dict[str, str] = {}  # why a source cannot be read, once said

    def read(self) -> dict[str, float]:
        """Read every meter; the counters grow by what was drawn since the last reading."""
        readings = {}
        for meter in self.meters:
            source = meter.source
            try:
                joules = meter.joules()
            except EnergyUnreadable as exc:
                self._unreadable(source, str(exc))
                continue
            except Exception as exc:  # a side reading: no surprise in it may cost the health check its probes
                self._unreadable(source, f"{type(exc).__name__}: {exc}")
                continue
            if self.said.pop(source, None) is not None:
                log.info("energy (%s) readable again", source)
            previous = self.last.get(source)
            counter = self.metrics.energy.labels(source)  # exists from the first reading on: 0 J drawn so far
            if previous is not None:
                counter.inc(max(joules - previous, 0.0))
            self.last[source] = readings[source] = joules
        return readings

    def _unreadable(self, source: str, why: str) -> None:
        if self.said.get(source) != why:
            log.info("energy (%s) not measured, no metric exported for it: %s", source, why)
            self.said[source] = why
        self.last.pop(source, None)

    def mark(self) -> None:
        """A window begins here: the first sample, after a restart, after the canary's or the warm-up's tokens."""
        self.start = self.read()

    def window(self, tokens: float) -> None:
        """The window since the mark generated `tokens` tokens: its energy per token joins the recent ones, and
        the next window begins."""
        readings = self.read()
        for source, joules in readings.items():
            if tokens <= 0 or source not in self.start:
                continue
            recent = self.windows.setdefault(source, deque(maxlen=self.recent))
            recent.append((joules - self.start[source], tokens))
            spent, made = sum(j for j, _ in recent), sum(t for _, t in recent)
            self.metrics.energy_per_token.labels(source).set(spent / made)
        self.start = readings
