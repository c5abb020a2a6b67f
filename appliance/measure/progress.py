"""What bench and tune show while they measure: a line per finished measurement (workload, repetition,
configuration, its decode rate) with the count and the time left, the way a test runner does. On a
terminal the line is redrawn in place; on a pipe or a journal each is its own line, so a log shows the
run advancing. The time left is the pace measured so far applied to what is still to come, workload by
workload: a long-context request takes longer than a short chat, and one side's pace predicts the other's.
Server starts and warm-ups are not counted: the figure is the measurements' own, hence "about".
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO


def time_left(seconds: Mapping[str, Sequence[float]], remaining: Mapping[str, int]) -> float | None:
    """Seconds the remaining measurements take at the pace measured so far: each workload at the mean of its
    own measurements, one not measured yet at the mean of all; None before anything was measured."""
    measured = [s for values in seconds.values() for s in values]
    if not measured:
        return None
    overall = sum(measured) / len(measured)
    total = 0.0
    for key, count in remaining.items():
        own = seconds.get(key)
        total += max(count, 0) * (sum(own) / len(own) if own else overall)
    return total


def duration(seconds: float) -> str:
    """A time as a person says it: 40 s, 3 min, 1 h 05 min (rounded up: "about 0 s" would be a promise)."""
    if seconds < 10:
        return f"{max(1, math.ceil(seconds))} s"
    if seconds <= 55:
        return f"{math.ceil(seconds / 5) * 5} s"
    minutes = math.ceil(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


class Progress:
    """The count of measurements done against those planned (`plan`), and the time left.

    `name` heads each line ("bench", "tune"); `scope` says what the count covers when it is not the whole
    run (tune cannot know how many servers its search starts, so it plans one server at a time)."""

    def __init__(
        self,
        stream: TextIO | None = None,
        enabled: bool = True,
        name: str = "bench",
        scope: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.enabled = enabled
        self.name = name
        self.scope = scope
        self.clock = clock
        self.phase_text = ""
        self.planned: Counter[str] = Counter()
        self.done: Counter[str] = Counter()
        # Kept across plans: what one server's measurements took predicts the next server's.
        self.seconds: dict[str, list[float]] = {}
        self.began = self.last = clock()

    @property
    def total(self) -> int:
        return sum(self.planned.values())

    @property
    def count(self) -> int:
        return sum(self.done.values())

    def plan(self, measurements: Mapping[str, int]) -> None:
        """What is to come, by workload; the count starts again from 0."""
        self.planned = Counter(measurements)
        self.done = Counter()
        self.began = self.last = self.clock()

    def resume(self) -> None:
        """What came before (a server's start, a warm-up) is no measurement's: the next is timed from here."""
        self.last = self.clock()

    def phase(self, text: str) -> None:
        """A new configuration (a server starting, or started): a line of its own on a log."""
        self.phase_text = text
        self.resume()
        if not self.enabled:
            return
        if self.tty:
            self._draw(f"{self.phase_text}: starting")
        else:
            print(f"{self.name}: {text}", file=self.stream, flush=True)

    def advance(self, workload: str, detail: str, decode_tps: float | None = None) -> None:
        """One measurement of `workload` finished; `detail` says which ("code, rep 2/3")."""
        now = self.clock()
        self.seconds.setdefault(workload, []).append(now - self.last)
        self.last = now
        self.done[workload] += 1
        if not self.enabled:
            return
        rate = f": {decode_tps:.1f} tok/s" if decode_tps is not None else ""
        line = f"{detail}, {self.phase_text}{rate} ({self.left()})"
        if self.tty:
            self._draw(line)
        else:
            print(f"{self.name}: {self._count()} {line}", file=self.stream, flush=True)

    def left(self) -> str:
        """ "about 3 min left", or once all planned is done, how long it took."""
        scope = f" {self.scope}" if self.scope else ""
        remaining = {key: planned - self.done[key] for key, planned in self.planned.items()}
        if sum(max(n, 0) for n in remaining.values()) == 0:
            return f"done in {duration(self.clock() - self.began)}{scope}"
        seconds = time_left(self.seconds, remaining)
        return f"about {duration(seconds)} left{scope}" if seconds is not None else "time left not known yet"

    def _count(self) -> str:
        total = str(self.total) if self.total else "?"
        return f"[{self.count:>{len(total)}}/{total}]"

    def _draw(self, text: str) -> None:
        if self.total:
            filled = int(24 * min(self.count, self.total) / self.total)
            bar = f"[{'#' * filled}{'.' * (24 - filled)}] {self.count}/{self.total}"
        else:
            bar = f"[{self.count}]"
        width = shutil.get_terminal_size((160, 24)).columns - 1  # a wrapped line would not be redrawn in place
        self.stream.write(f"\r\x1b[K{bar}  {text}"[: width + 4])  # + the 4 characters of \r\x1b[K
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
