"""The real llama-server's own account of the memory it allocated: started on a GGUF (CPU, -ngl 0) with given
context, slots, cache types and flash attention, read until it listens, its load log parsed.

The llama_kv_cache and llama_memory_recurrent size lines are info-level logs of libllama, which llama-server
prints only at verbosity 4 (-lv 4). They come from llama_kv_cache::llama_kv_cache and
llama_memory_recurrent::llama_memory_recurrent: sums of ggml_nbytes of the tensors, in MiB with 2 decimals.
"""

from __future__ import annotations

import re
import socket
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

# A safety net for a server that never listens, not a measure: a start takes 1-3 s here.
KILL_AFTER_S = 180.0

KV_LINE = re.compile(
    r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers, +(\d+)/(\d+) seqs\), "
    r"K \((\w+)\): +([\d.]+) MiB, V \((\w+)\): +([\d.]+) MiB"
)
RS_LINE = re.compile(
    r"llama_memory_recurrent: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers, +(\d+) seqs +(\d+) rs_seq\), "
    r"R \((\w+)\): +([\d.]+) MiB, S \((\w+)\): +([\d.]+) MiB"
)
COMPUTE_LINE = re.compile(r"(\w+) compute buffer size = +([\d.]+) MiB")


@dataclass(frozen=True)
class LoggedCache:
    kind: str  # "kv" or "recurrent"
    cells: int
    layers: int
    seqs: int
    first_mib: float  # K or R
    second_mib: float  # V or S
    types: tuple[str, str]


@dataclass(frozen=True)
class LoadLog:
    caches: tuple[LoggedCache, ...]
    compute_mib: tuple[tuple[str, float], ...]
    text: str


def parse(text: str) -> LoadLog:
    caches = []
    for line in text.splitlines():
        if kv := KV_LINE.search(line):
            _, cells, layers, seqs, _, tk, k, tv, v = kv.groups()
            caches.append(LoggedCache("kv", int(cells), int(layers), int(seqs), float(k), float(v), (tk, tv)))
        elif rs := RS_LINE.search(line):
            _, cells, layers, seqs, _, tr, r, ts, s = rs.groups()
            caches.append(LoggedCache("recurrent", int(cells), int(layers), int(seqs), float(r), float(s), (tr, ts)))
    compute = tuple((m.group(1), float(m.group(2))) for m in COMPUTE_LINE.finditer(text))
    return LoadLog(tuple(caches), compute, text)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def load_log(
    binary: Path,
    model: Path,
    *,
    ctx: int,
    parallel: int = 1,
    cache_k: str = "f16",
    cache_v: str = "f16",
    flash_attn: str = "off",
    extra: tuple[str, ...] = (),
) -> LoadLog:
    """Start llama-server, read its log until it listens (or exits), stop it; the log parsed."""
    flags = (
        *("-c", str(ctx), "-np", str(parallel), "-ngl", "0", "-fit", "off"),
        *("-ctk", cache_k, "-ctv", cache_v, "-fa", flash_attn, "--no-warmup", *extra),
    )
    return parse(server_log(binary, model, *flags))


def server_log(binary: Path, model: Path, *flags: str) -> str:
    """llama-server's output for `-m model flags` at verbosity 4 (one thread, loopback, a free port), from its
    start until it listens; then it is stopped. The size lines come before it listens."""
    argv = [
        str(binary),
        *("-m", str(model), "-lv", "4", "-t", "1", "--host", "127.0.0.1", "--port", str(_free_port()), *flags),
    ]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    guard = threading.Timer(KILL_AFTER_S, process.kill)
    guard.start()
    lines = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if "listening on" in line:
                break
    finally:
        guard.cancel()
        process.kill()
        process.wait()
    text = "".join(lines)
    if "listening on" not in text:
        raise AssertionError(f"llama-server did not start: {' '.join(argv)}\n{text[-3000:]}")
    return text
