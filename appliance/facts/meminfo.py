"""How much memory the machine itself has: MemTotal and MemAvailable from /proc/meminfo.

The host budget is planned against MemTotal, not MemAvailable: the server is started at boot and again on
every restart, so what happens to be free while `validate` runs says little about what it will find then.
MemAvailable is kept for `explain` and the error that shows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MEMINFO = Path("/proc/meminfo")
KIB = 1024


class MeminfoError(Exception):
    """/proc/meminfo cannot be read or lacks MemTotal; the message says which."""


@dataclass(frozen=True)
class HostMemory:
    total_bytes: int
    available_bytes: int | None  # absent before Linux 3.14


def parse_meminfo(text: str) -> HostMemory:
    """`Name:   value kB` lines, as proc(5) describes them (its kB are KiB); lines without a number are skipped."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            values[name.strip()] = int(fields[0]) * KIB
    if not values.get("MemTotal"):
        raise MeminfoError("no MemTotal line")
    return HostMemory(values["MemTotal"], values.get("MemAvailable"))


def read_meminfo(path: Path = MEMINFO) -> HostMemory:
    try:
        return parse_meminfo(path.read_text())
    except OSError as exc:
        raise MeminfoError(f"cannot read {path}: {exc.strerror or exc}") from None
    except MeminfoError as exc:
        raise MeminfoError(f"{path}: {exc}") from None
