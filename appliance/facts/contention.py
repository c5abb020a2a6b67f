"""What else used the machine: the CPU time of every process from /proc, and from two readings the share of
all CPUs that processes outside a set (the appliance's own) took in between, with the one that took most;
and how long the appliance's own threads waited for a CPU meanwhile (their run-queue delay, schedstat).

A slow sample taken while a neighbour ate the CPUs says nothing about the server: bench measures it again,
the health daemon does not count it toward decay. A neighbour that only fills CPU time the server leaves idle
(a batch job at nice 19 beside a server held back by something else) does not make the server wait: that
sample is the server's own, and still counts.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")
# Other processes used more than this share of all CPUs while a sample was taken: it is contended.
CONTENDED_SHARE = 0.2


@dataclass(frozen=True)
class CpuUse:
    """CPU seconds at one instant: the whole machine's (all CPUs, idle included), its busy part, and each
    process's (all its threads, user and system), with the process's name."""

    total: float
    busy: float
    processes: dict[int, tuple[str, float]]
    # The threads of the processes asked for: seconds on a CPU and seconds waiting on a run queue, by thread id.
    threads: dict[int, tuple[float, float]] = field(default_factory=dict)

    @classmethod
    def read(cls, ours: Collection[int] = (), proc: Path = PROC) -> CpuUse | None:
        tick = os.sysconf("SC_CLK_TCK")
        try:
            values = [int(v) for v in (proc / "stat").read_text().split("\n", 1)[0].split()[1:9]]
        except (OSError, ValueError):
            return None
        processes = {}
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
                processes[int(entry.name)] = (name, (int(rest[11]) + int(rest[12])) / tick)
            except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
                continue
        threads = {}
        for pid in ours:
            for task in _entries(proc / str(pid) / "task"):
                try:
                    run, wait = (int(v) / 1e9 for v in (task / "schedstat").read_text().split()[:2])
                except (OSError, ValueError):
                    continue
                threads[int(task.name)] = (run, wait)
        idle = values[3] + values[4]  # idle and iowait
        return cls(sum(values) / tick, (sum(values) - idle) / tick, processes, threads)


def _entries(folder: Path) -> list[Path]:
    try:
        return [entry for entry in folder.iterdir() if entry.name.isdigit()]
    except OSError:  # the process is gone
        return []


@dataclass(frozen=True)
class Contention:
    """Between two readings: the share of all CPUs processes outside `ours` used, and the one that used most."""

    share: float
    top: str  # "name[pid] 63%", or "" when no single process stands out (short-lived ones, the kernel)
    top_share: float = 0.0
    # Of the time our threads were runnable, the share they spent waiting for a CPU; None: they never ran.
    waited: float | None = None

    def describe(self) -> str:
        waited = f", the server waited for a CPU {self.waited:.0%} of its time" if self.waited is not None else ""
        return f"other processes used {self.share:.0%} of the CPUs{waited}" + (
            f" (most: {self.top})" if self.top else ""
        )


def contention(before: CpuUse | None, after: CpuUse | None, ours: set[int]) -> Contention | None:
    """None when either reading is missing or no time passed. A process new in `after` (or whose pid was
    reused) counts with all its time: it started in between."""
    if before is None or after is None or after.total <= before.total:
        return None
    elapsed = after.total - before.total
    used: dict[int, float] = {}
    for pid, (_, seconds) in after.processes.items():
        previous = before.processes.get(pid)
        used[pid] = seconds - previous[1] if previous is not None and previous[1] <= seconds else seconds
    own = sum(seconds for pid, seconds in used.items() if pid in ours)
    share = min(1.0, max(0.0, (after.busy - before.busy) - own) / elapsed)
    waited = _waited(before.threads, after.threads)
    others = {pid: seconds for pid, seconds in used.items() if pid not in ours and seconds > 0}
    if not others:
        return Contention(share, "", waited=waited)
    pid = max(others, key=lambda p: others[p])
    top_share = others[pid] / elapsed
    return Contention(share, f"{after.processes[pid][0]}[{pid}] {top_share:.0%}", top_share, waited)


def _waited(before: dict[int, tuple[float, float]], after: dict[int, tuple[float, float]]) -> float | None:
    ran = waited = 0.0
    for tid, (run, wait) in after.items():
        start = before.get(tid, (0.0, 0.0))
        if start[0] > run or start[1] > wait:  # a reused thread id
            start = (0.0, 0.0)
        ran, waited = ran + run - start[0], waited + wait - start[1]
    return waited / (ran + waited) if ran + waited > 0 else None
