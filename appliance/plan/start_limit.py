"""How llama-server is started again after it dies: the server unit's Restart=on-failure, RestartSec= and start
limit, and `llm-appliance up`'s launcher, which supervises as the unit does, read these numbers; neither has
its own."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StartLimit:
    """systemd's start rate limit: at most `burst` starts in a window of `interval_seconds` that opens at its
    first start (a start after the window closes opens a new one), each restart `delay_seconds` after the death."""

    interval_seconds: int
    burst: int
    delay_seconds: int


# A crash loop stops here; the health daemon's own restarts are counted separately (restart.max_per_hour).
SERVER_START_LIMIT = StartLimit(interval_seconds=900, burst=5, delay_seconds=5)


@dataclass
class StartWindow:
    """The starts counted against a StartLimit, as systemd counts them (its ratelimit_below): `allows` is
    asked before each start and counts it when it is allowed."""

    limit: StartLimit
    begin: float | None = None
    starts: int = field(default=0)

    def allows(self, now: float) -> bool:
        if self.begin is None or now > self.begin + self.limit.interval_seconds:
            self.begin, self.starts = now, 0
        if self.starts >= self.limit.burst:
            return False
        self.starts += 1
        return True
