#!/usr/bin/env python3
"""Benchmark the health daemon's own cost on the demo pair: CPU ms per check, its RSS, and the server's
decode tok/s with the daemon checking every second vs not running. Prints figures; asserts nothing.

    /opt/llm-appliance/venv/bin/python bench/daemon_cost.py [SPEC] [--checks 30] [--runs 5] [--tokens 96]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from prometheus_client import CollectorRegistry

from appliance.facts.gpu import Pynvml
from appliance.health.daemon import DaemonConfig, HealthDaemon
from appliance.health.exporter import Metrics
from appliance.plan.resolved import resolve
from appliance.plan.validate import validate
from appliance.render.apply import installed_spec_path
from appliance.runtime.server_api import ServerApi, ServerUnreachable

PROMPT = "def fibonacci(n):\n"


class Direct:
    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    def main_pid(self) -> int | None:
        return self.process.pid

    def active(self) -> bool:
        return self.process.poll() is None

    def restart(self, reason: str) -> None:
        print(f"(the daemon wanted a restart: {reason}; ignored by the benchmark)")


def decode(api: ServerApi, runs: int, tokens: int) -> float:
    rates = [
        api.completion(PROMPT, tokens, temperature=0, ignore_eos=True, cache_prompt=False)["timings"][
            "predicted_per_second"
        ]
        for _ in range(runs)
    ]
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec", type=Path, nargs="?", default=Path("etc/llm-appliance/demo.toml"))
    parser.add_argument("--checks", type=int, default=30)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    appliance = replace(
        resolve(validate(args.spec).plan, installed_spec_path(args.spec)),
        state_file=Path("/tmp/llm-appliance-bench-state.json"),
    )
    spec, argv = appliance.spec, appliance.argv
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = ServerApi(f"http://127.0.0.1:{spec.server.port}", timeout=30)
    try:
        while True:
            try:
                if api.health() == 200:
                    break
            except ServerUnreachable:
                pass
            time.sleep(0.2)
        daemon = HealthDaemon(
            DaemonConfig(appliance),
            Direct(server),
            Pynvml(),
            Metrics(CollectorRegistry()),
        )
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        cpu, wall = [], []
        for _ in range(args.checks):
            c0, w0 = time.process_time(), time.perf_counter()
            daemon.check()
            cpu.append(1000 * (time.process_time() - c0))
            wall.append(1000 * (time.perf_counter() - w0))
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        decode(api, 1, 16)  # warm
        quiet = decode(api, args.runs, args.tokens)
        stop = threading.Event()

        def poll() -> None:
            while not stop.wait(1.0):
                daemon.check()

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        polled = decode(api, args.runs, args.tokens)
        stop.set()
        poller.join()
    finally:
        server.terminate()
        server.wait(30)
    print(f"spec: {args.spec}; {args.checks} checks, decode median of {args.runs} x {args.tokens} tokens")
    print(
        f"daemon CPU per check: median {statistics.median(cpu):.1f} ms, max {max(cpu):.1f} ms (wall median {statistics.median(wall):.1f} ms)"
    )
    print(f"daemon process max RSS: {rss / 1024:.1f} MiB (before checks {rss_before / 1024:.1f} MiB)")
    print(
        f"decode tok/s: daemon not running {quiet:.1f}, daemon checking every 1 s {polled:.1f} ({100 * (polled / quiet - 1):+.1f}%)"
    )


if __name__ == "__main__":
    sys.exit(main())
