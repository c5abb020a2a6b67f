#!/usr/bin/env python3
"""The host budget against the real thing: run the spec's llama-server (CPU) at several context sizes and
print its resident memory beside the plan's host figures. Prints figures; asserts nothing.

    PYTHONPATH=. python bench/host_memory.py [SPEC] [--ctx 4096 32768]

RSS is read from /proc/PID/status once /health answers 200, and again (VmHWM, the peak) after one
completion of 64 tokens. RssFile counts a file mapped twice (the demo maps one model as target and draft)
twice, while the page cache holds it once.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from appliance.plan.validate import validate

MIB = 1 << 20
DEMO = Path(__file__).resolve().parent.parent / "etc" / "llm-appliance" / "demo.toml"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def status(pid: int) -> dict[str, int]:
    text = Path(f"/proc/{pid}/status").read_text()
    return {key: int(value) * 1024 for key, value in re.findall(r"^(Vm\w+|Rss\w+):\s+(\d+) kB$", text, re.M)}


def get(url: str, body: dict[str, object] | None = None) -> int:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()
            return int(response.status)
    except (urllib.error.URLError, ConnectionError):
        return 0


def measure(spec_text: str, ctx: int, work: Path) -> None:
    spec = work / f"ctx-{ctx}.toml"
    spec.write_text(re.sub(r"(?m)^ctx_size = \d+$", f"ctx_size = {ctx}", spec_text))
    plan = validate(spec).plan
    assert plan.host is not None, "the machine's RAM is unknown"
    lines = {line.label: line.bytes for line in plan.host.lines}
    buffers = sum(b for label, b in lines.items() if "KV cache" in label or "weights" in label)
    argv = list(plan.argv)
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        while get(f"{url}/health") != 200:
            if process.poll() is not None:
                raise SystemExit(f"llama-server exited {process.returncode} at ctx {ctx}")
            time.sleep(0.2)
        ready = status(process.pid)
        get(f"{url}/completion", {"prompt": "The capital of France is", "n_predict": 64})
        after = status(process.pid)
    finally:
        process.terminate()
        process.wait(30)
    print(
        f"ctx {ctx:>6}: planned {plan.host.used_bytes / MIB:8.1f} MiB "
        f"(weights+KV {buffers / MIB:7.1f}, the rest headroom and prompt cache cap) | "
        f"ready: VmRSS {ready['VmRSS'] / MIB:7.1f} RssAnon {ready['RssAnon'] / MIB:7.1f} RssFile {ready['RssFile'] / MIB:6.1f} | "
        f"after a completion: VmHWM {after['VmHWM'] / MIB:7.1f} RssAnon {after['RssAnon'] / MIB:7.1f} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", nargs="?", type=Path, default=DEMO)
    parser.add_argument("--ctx", type=int, nargs="+", default=[4096, 32768])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        for ctx in args.ctx:
            measure(args.spec.read_text(), ctx, Path(work))


if __name__ == "__main__":
    main()
