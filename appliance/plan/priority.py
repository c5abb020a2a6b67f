"""How much of the machine the server keeps when a neighbour wants it too (`server.priority`), in one place: the
server unit's Nice=, CPUWeight= and IOWeight=, and the nice value `up`, the engine's proof and bench's servers
start llama-server with.

Why it matters: llama.cpp's threads meet at a barrier after every layer and spin there, so one thread preempted by
a compile or a test run stalls all of them. Measured on a 2-core machine, the demo at --threads 2 beside two busy
loops at nice 0: 42 and 2.8 tok/s at nice 0, 68-71 tok/s at nice -10 (90 idle) (docs/measurements.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PriorityName = Literal["high", "normal", "low"]


@dataclass(frozen=True)
class Priority:
    nice: int  # setpriority(2); systemd's Nice=
    cpu_weight: int | None  # systemd's CPUWeight= (the default is 100); None: the default
    io_weight: int | None  # systemd's IOWeight=


PRIORITIES: dict[PriorityName, Priority] = {
    # The box is the model's: a neighbour gets what the server leaves.
    "high": Priority(nice=-10, cpu_weight=1000, io_weight=1000),
    "normal": Priority(nice=0, cpu_weight=None, io_weight=None),
    # The model is the background job: interactive work beside it comes first.
    "low": Priority(nice=10, cpu_weight=20, io_weight=20),
}
