"""Start the real llama-server with given flags, read its load log, stop it: the compute buffers it reserved.

`sched_reserve:        CPU compute buffer size =    17.51 MiB` is logged at llama.cpp's INFO level, which the
server shows from `-lv 4` on; the line comes once per llama context (the target's, then a draft's) before
the server listens, so the server is stopped as soon as it says it is listening.
"""

from __future__ import annotations

import re
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

COMPUTE = re.compile(r"sched_reserve:\s+(\S+) compute buffer size =\s+([\d.]+) MiB")
READY = ("listening on", "model loaded")
LOAD_TIMEOUT_S = 60


@dataclass(frozen=True)
class ComputeLog:
    """Per llama context, in load order (target first), the compute buffer of each backend in MiB."""

    contexts: list[dict[str, float]]
    text: str


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def compute_log(binary: Path, model: Path, *flags: str) -> ComputeLog:
    """The server's compute buffers for `-m model flags` (one thread: the sizes do not depend on it)."""
    argv = [str(binary), "-m", str(model), "--port", str(_free_port()), "-t", "1", "-lv", "4", *flags]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if any(mark in line for mark in READY):
                break
    finally:
        process.terminate()
        try:
            process.wait(LOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    text = "".join(lines)
    contexts: list[dict[str, float]] = []
    for line in lines:
        if "sched_reserve: reserving" in line:
            contexts.append({})
        elif found := COMPUTE.search(line):
            if not contexts:
                contexts.append({})
            contexts[-1][found.group(1)] = float(found.group(2))
    if not contexts:
        raise AssertionError(f"no compute buffer in llama-server's log for {argv}:\n{text[-3000:]}")
    return ComputeLog(contexts, text)
