"""The restart history, kept on disk: a server restart restarts the health daemon bound to it, and the
hourly budget and the restart counters must survive that."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.system.files import write_atomically

log = logging.getLogger("llm-appliance.health")
KEEP_SECONDS = 7 * 86400


@dataclass(frozen=True)
class RestartLog:
    """Recent restarts (for the hourly budget) and running totals by reason (for the counters, which
    must never go backwards when old entries are pruned)."""

    path: Path

    def _load(self) -> dict[str, Any]:
        try:
            state = json.loads(self.path.read_text())
            return state if isinstance(state, dict) else {}
        except (OSError, ValueError):
            return {}

    def read(self) -> list[tuple[float, str]]:
        try:
            return [(float(t), str(r)) for t, r in self._load().get("restarts", [])]
        except (ValueError, TypeError):
            return []

    def totals(self) -> dict[str, int]:
        try:
            return {str(k): int(v) for k, v in self._load().get("totals", {}).items()}
        except (ValueError, TypeError, AttributeError):
            return {}

    def append(self, when: float, reason: str) -> None:
        kept = [[t, r] for t, r in self.read() if when - t < KEEP_SECONDS] + [[when, reason]]
        totals = self.totals()
        totals[reason] = totals.get(reason, 0) + 1
        try:
            # Not a fixed temporary name: the state directory belongs to the service user, who could plant one.
            write_atomically(self.path, json.dumps({"restarts": kept, "totals": totals}))
        except OSError as exc:
            log.warning("cannot save the restart history to %s: %s", self.path, exc)
