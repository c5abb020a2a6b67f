"""Start the real llama-server with given flags, read its load log, stop it: the compute buffers it reserved.

`sched_reserve:        CPU compute buffer size =    17.51 MiB` is logged at llama.cpp's INFO level, which the
server shows from `-lv 4` on; the line comes once per llama context (the target's, then a draft's) before
the server listens, so the server is stopped as soon as it says it is listening.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from llama_log import server_log

COMPUTE = re.compile(r"sched_reserve:\s+(\S+) compute buffer size =\s+([\d.]+) MiB")


@dataclass(frozen=True)
class ComputeLog:
    """Per llama context, in load order (target first), the compute buffer of each backend in MiB."""

    contexts: list[dict[str, float]]
    text: str


def compute_log(binary: Path, model: Path, *flags: str) -> ComputeLog:
    """The server's compute buffers for `-m model flags` (one thread: the sizes do not depend on it)."""
    text = server_log(binary, model, *flags)
    contexts: list[dict[str, float]] = []
    for line in text.splitlines():
        if "sched_reserve: reserving" in line:
            contexts.append({})
        elif found := COMPUTE.search(line):
            if not contexts:
                contexts.append({})
            contexts[-1][found.group(1)] = float(found.group(2))
    if not contexts:
        raise AssertionError(f"no compute buffer in llama-server's log for {model} {flags}:\n{text[-3000:]}")
    return ComputeLog(contexts, text)
