#!/usr/bin/env python3
"""Benchmark decode beside a busy neighbour, per server.priority: the spec's llama-server (its rung's flags, on a
free loopback port) answers the same greedy request idle and with N busy loops at nice 0 beside it, in one run,
interleaved. Prints tok/s and the busy/idle ratio per priority; asserts nothing.

    /opt/llm-appliance/venv/bin/python bench/neighbour.py [SPEC] [--neighbours 2] [--reps 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from appliance.ops.engine_proof import niced
from appliance.plan.plan import plan
from appliance.plan.priority import PRIORITIES, PriorityName
from appliance.plan.validate import validate
from appliance.runtime.server_api import ServerApi
from appliance.runtime.server_process import die_with_parent, free_port, stop, wait_until_ready
from appliance.system.run import DEVNULL, spawn

MESSAGES = [{"role": "user", "content": "Write a Python function that parses an ISO 8601 date. Explain it briefly."}]


@contextlib.contextmanager
def neighbours(count: int) -> Iterator[None]:
    """`count` busy loops at nice 0, as a compile or a test run beside the model would be."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


@contextlib.contextmanager
def server(spec: Path, priority: PriorityName) -> Iterator[ServerApi]:
    validated = validate(spec)
    port = free_port()
    wanted = validated.plan.spec
    wanted = wanted.model_copy(
        update={"server": wanted.server.model_copy(update={"host": "127.0.0.1", "port": port, "api_key_file": None})}
    )
    argv = plan(wanted, validated.facts, validated.plan.target, validated.plan.draft).argv
    with niced(PRIORITIES[priority].nice):
        process = spawn(argv, stdin=DEVNULL, stdout=DEVNULL, stderr=DEVNULL, preexec_fn=die_with_parent, quiet=True)
    api = ServerApi(f"http://127.0.0.1:{port}", timeout=600)
    try:
        if not wait_until_ready(process, api, 600):
            raise SystemExit(f"llama-server at priority {priority} did not start")
        yield api
    finally:
        stop(process)


def decode(api: ServerApi, tokens: int) -> float:
    answer = api.chat(MESSAGES, tokens, timeout=600, temperature=0.0, cache_prompt=False)
    return float(answer["timings"]["predicted_per_second"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", type=Path, nargs="?", default=Path("etc/llm-appliance/demo.toml"))
    parser.add_argument("--neighbours", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--priorities", default="normal,high")
    args = parser.parse_args()
    print(f"{args.spec}: {args.tokens} greedy tokens, {args.neighbours} busy loops at nice 0, median of {args.reps}")
    print(f"{'priority':<9} {'nice':>5} {'idle tok/s':>11} {'busy tok/s':>11} {'busy/idle':>10}")
    for priority in args.priorities.split(","):
        name: PriorityName = priority  # type: ignore[assignment]
        idle, busy = [], []
        with server(args.spec, name) as api:
            decode(api, 8)  # warm-up
            for _ in range(args.reps):  # interleaved: a drift of the machine shows in both columns
                idle.append(decode(api, args.tokens))
                with neighbours(args.neighbours):
                    busy.append(decode(api, args.tokens))
        i, b = statistics.median(idle), statistics.median(busy)
        print(f"{priority:<9} {PRIORITIES[name].nice:>5} {i:>11.1f} {b:>11.1f} {b / i:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
