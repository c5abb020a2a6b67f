"""An OnCalendar= expression as systemd itself reads it: `systemd-analyze calendar`, the parser the timer uses."""

from __future__ import annotations

import functools
import shutil
from dataclasses import dataclass

from appliance.system.run import CommandFailed, run

TIMEOUT_SECONDS = 30


@dataclass(frozen=True)
class Calendar:
    normalized: str
    next_elapse: str  # "never" for a date in the past


class CalendarInvalid(Exception):
    """systemd rejects the expression; the message is systemd's own."""


class CalendarUnchecked(Exception):
    """No systemd-analyze on this machine (nor a systemd to run the timer)."""


@functools.lru_cache(maxsize=64)  # validate runs once per spec; tune and the tests, over and over
def read_calendar(expression: str) -> Calendar:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        raise CalendarUnchecked("systemd-analyze is not installed")
    try:
        # `--`: an expression that starts with "-" is not an option.
        result = run([tool, "calendar", "--iterations=1", "--", expression], quiet=True, timeout=TIMEOUT_SECONDS)
    except CommandFailed as exc:
        if exc.returncode is None:
            raise CalendarUnchecked(str(exc)) from None
        raise CalendarInvalid(exc.output_tail.splitlines()[-1] if exc.output_tail else str(exc)) from None
    fields = dict(line.strip().split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
    return Calendar(fields.get("Normalized form", expression), fields.get("Next elapse", ""))
