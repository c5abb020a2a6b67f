"""Pure detectors: samples in, verdicts out. No clock, no I/O; the daemon feeds them and acts.

Decode rates are compared like with like: each rate carries a context bucket (the canary has its own,
fixed one), and a bucket is judged only against its own baseline, so a long conversation, which decodes
slower because its context is longer, never reads as decay.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

CANARY_BUCKET = "canary"

# What the restart policy says of a wanted restart.
PolicyAction = Literal["restart", "cooldown", "exhausted", "none"]


def context_bucket(context_tokens: int | None) -> str:
    """Powers of two from 1K up: 'ctx<=1K', 'ctx<=2K', ... ; unknown context is its own bucket."""
    if context_tokens is None:
        return "ctx=unknown"
    limit = 1024
    while context_tokens > limit:
        limit *= 2
    return f"ctx<={limit // 1024}K"


@dataclass(frozen=True)
class CounterSample:
    """llama-server's cumulative counters at one instant (they only grow, except across a restart)."""

    tokens_predicted: float
    tokens_predicted_seconds: float
    drafted: float
    accepted: float


@dataclass(frozen=True)
class Window:
    """What happened between two samples."""

    tokens: float
    seconds: float
    drafted: float
    accepted: float

    @property
    def decode_tps(self) -> float | None:
        return self.tokens / self.seconds if self.tokens > 0 and self.seconds > 0 else None

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted > 0 else None


def window(previous: CounterSample | None, current: CounterSample) -> Window | None:
    """The delta of two samples; None on the first sample or after a restart reset the counters."""
    if previous is None or current.tokens_predicted < previous.tokens_predicted:
        return None
    return Window(
        current.tokens_predicted - previous.tokens_predicted,
        current.tokens_predicted_seconds - previous.tokens_predicted_seconds,
        current.drafted - previous.drafted,
        current.accepted - previous.accepted,
    )


@dataclass
class DecayDetector:
    """A breach is the median of a bucket's recent windows below ratio x its baseline, `consecutive` times.

    One slow request is one low window: the median of several ignores it. A real drop moves the median
    within a few windows and then counts `consecutive` breaches.
    """

    ratio: float
    consecutive: int
    baseline_windows: int
    median_of: int = 5
    raise_above: float = 1.25
    baselines: dict[str, float] = field(default_factory=dict)
    _learning: dict[str, list[float]] = field(default_factory=dict)
    _recent: dict[str, deque[float]] = field(default_factory=dict)
    _sustained: dict[str, deque[float]] = field(default_factory=dict)
    breaches: dict[str, int] = field(default_factory=dict)

    def add(self, bucket: str, decode_tps: float) -> bool:
        """Record one window's rate; True when this bucket has now breached `consecutive` times in a row."""
        if bucket not in self.baselines:
            learning = self._learning.setdefault(bucket, [])
            learning.append(decode_tps)
            if len(learning) >= self.baseline_windows:
                self.baselines[bucket] = statistics.median(learning)
            return False
        sustained = self._sustained.setdefault(bucket, deque(maxlen=4 * self.median_of))
        sustained.append(decode_tps)
        if (
            len(sustained) == sustained.maxlen
            and statistics.median(sustained) > self.raise_above * self.baselines[bucket]
        ):
            # A baseline learned while the box was busy (or from a cold server) is too low to ever see decay.
            # Only a long run of faster windows raises it: noise in a median of 20 never moves it by 25%.
            self.baselines[bucket] = statistics.median(sustained)
        recent = self._recent.setdefault(bucket, deque(maxlen=self.median_of))
        recent.append(decode_tps)
        if len(recent) < self.median_of:  # the median of one or two windows is one slow request
            return False
        median = statistics.median(recent)
        if median < self.ratio * self.baselines[bucket]:
            self.breaches[bucket] = self.breaches.get(bucket, 0) + 1
        else:
            self.breaches[bucket] = 0
        return self.breaches[bucket] >= self.consecutive

    def breached(self) -> bool:
        """Some bucket is in breach: the verdict stands between windows until a window clears it."""
        return any(count >= self.consecutive for count in self.breaches.values())

    def current(self, bucket: str) -> float | None:
        recent = self._recent.get(bucket)
        return statistics.median(recent) if recent else None

    def after_restart(self) -> None:
        """A restart cures fragmentation: judge the fresh server on fresh windows, keep the baselines."""
        self._recent.clear()
        self._sustained.clear()
        self.breaches.clear()


@dataclass
class CreepDetector:
    """Server VRAM against its post-warm-up baseline: creep = current / baseline - 1."""

    ratio: float
    consecutive: int
    baseline: float | None = None
    breaches: int = 0

    def add(self, used_bytes: float, warmed_up: bool) -> bool:
        if not warmed_up or used_bytes <= 0:
            return False
        if self.baseline is None:
            self.baseline = used_bytes
            return False
        self.breaches = self.breaches + 1 if self.creep(used_bytes) > self.ratio else 0
        return self.breaches >= self.consecutive

    def creep(self, used_bytes: float) -> float:
        return used_bytes / self.baseline - 1 if self.baseline else 0.0

    def after_restart(self) -> None:
        self.baseline = None
        self.breaches = 0


@dataclass(frozen=True)
class SpeculationVerdict:
    engaged: bool | None  # None: nothing generated yet, no verdict
    acceptance: float | None
    low: bool


def speculation(
    speculation_configured: bool, draft_in_use: bool, w: Window, acceptance_min: float
) -> SpeculationVerdict:
    """Whether configured speculation drafts, judged here once (the launcher's start check and the alert agree):
    a draft model that generated tokens and drafted none is not engaged; n-gram types draft only once the
    output repeats earlier text, so a window without drafts is no verdict on them."""
    if not speculation_configured or w.tokens <= 0:
        return SpeculationVerdict(None, None, False)
    if w.drafted <= 0:
        return SpeculationVerdict(False if draft_in_use else None, None, False)
    acceptance = w.acceptance
    return SpeculationVerdict(True, acceptance, acceptance is not None and acceptance < acceptance_min)


def speedup(current_tps: float | None, no_speculation_tps: float | None) -> float | None:
    """What speculation gains in a bucket: its recent decode rate over the same bucket's rate without it."""
    if current_tps is None or not no_speculation_tps or no_speculation_tps <= 0:
        return None
    return current_tps / no_speculation_tps


@dataclass
class PayingTracker:
    """Which buckets decode slower than without speculation; `update` says when a bucket turns or recovers,
    so the daemon logs each change once and not every window."""

    min_speedup: float
    slower: set[str] = field(default_factory=set)

    def update(self, bucket: str, gain: float) -> str | None:
        """ "slower" when the bucket has just fallen below min_speedup, "recovered" when it just rose again."""
        if gain < self.min_speedup and bucket not in self.slower:
            self.slower.add(bucket)
            return "slower"
        if gain >= self.min_speedup and bucket in self.slower:
            self.slower.discard(bucket)
            return "recovered"
        return None


@dataclass(frozen=True)
class RestartDecision:
    action: PolicyAction
    reason: str
    detail: str = ""


@dataclass
class RestartPolicy:
    """Whether a wanted restart may happen now: outside the cooldown, at most max_per_hour; past the budget it
    stops restarting and says so instead of looping. Waiting for the requests in flight is the drain's
    (appliance.health.drain), which every restart takes."""

    cooldown_seconds: float
    max_per_hour: int
    history: list[float] = field(default_factory=list)
    exhausted: bool = False

    def decide(self, now: float, reason: str | None) -> RestartDecision:
        if reason is None:
            return RestartDecision("none", "")
        recent = [t for t in self.history if now - t < 3600]
        if len(recent) >= self.max_per_hour:
            self.exhausted = True
            return RestartDecision(
                "exhausted", reason, f"{len(recent)} restarts in the last hour (max_per_hour {self.max_per_hour})"
            )
        self.exhausted = False
        if self.history and now - self.history[-1] < self.cooldown_seconds:
            return RestartDecision(
                "cooldown", reason, f"{self.cooldown_seconds - (now - self.history[-1]):.0f} s of cooldown left"
            )
        return RestartDecision("restart", reason, "idle")

    def restarted(self, now: float) -> None:
        self.history = [t for t in self.history if now - t < 3600] + [now]
