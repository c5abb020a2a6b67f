#!/usr/bin/env python3
"""Benchmark the launcher on the demo pair: time to READY (model load vs launcher overhead), and decode
tok/s with and without the draft. Prints figures; asserts nothing.

    /opt/llm-appliance/venv/bin/python bench/launch.py [SPEC] [--runs 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from appliance.plan.resolved import Appliance, Endpoint, resolve
from appliance.plan.validate import validate
from appliance.render.apply import installed_spec_path
from appliance.runtime.server_api import ServerApi, ServerUnreachable

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start(appliance: Appliance, work: Path) -> tuple[subprocess.Popen[bytes], ServerApi, socket.socket, float]:
    port = free_port()
    argv = list(appliance.argv)
    argv[argv.index("--port") + 1] = str(port)
    plan = work / f"appliance-{port}.json"
    plan.write_text(replace(appliance, argv=tuple(argv), server=Endpoint("127.0.0.1", port)).to_json("bench"))
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(work / f"notify-{port}.sock"))
    env = {**os.environ, "NOTIFY_SOCKET": str(work / f"notify-{port}.sock")}
    t0 = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "appliance.cli.main", "launch", "--snapshot", str(plan)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return process, ServerApi(f"http://127.0.0.1:{port}"), notify, t0


def time_to_ready(
    process: subprocess.Popen[bytes], api: ServerApi, notify: socket.socket, t0: float
) -> tuple[float, float]:
    """(seconds until /health first answered 200, seconds until READY=1 arrived)."""
    healthy_at = None
    notify.settimeout(0.01)
    while True:
        if healthy_at is None:
            try:
                if api.health() == 200:
                    healthy_at = time.monotonic() - t0
            except ServerUnreachable:
                pass
        try:
            if b"READY=1" in notify.recv(4096):
                ready = time.monotonic() - t0
                return healthy_at if healthy_at is not None else ready, ready
        except TimeoutError:
            pass
        if process.poll() is not None:
            raise SystemExit(f"the launcher exited with {process.returncode} before READY")


def decode_rate(api: ServerApi, tokens: int, runs: int) -> tuple[float, float]:
    rates, accepted = [], []
    for _ in range(runs):
        answer = api.completion(PROMPT, n_predict=tokens, temperature=0, cache_prompt=False, ignore_eos=True)
        timings = answer["timings"]
        rates.append(timings["predicted_per_second"])
        if timings.get("draft_n"):
            accepted.append(timings["draft_n_accepted"] / timings["draft_n"])
    return statistics.median(rates), statistics.median(accepted) if accepted else 0.0


def without_draft(argv: list[str]) -> list[str]:
    kept, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
        elif arg.startswith("--spec-"):
            skip = 1
        else:
            kept.append(arg)
    return kept


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec", type=Path, nargs="?", default=Path("etc/llm-appliance/demo.toml"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    appliance = resolve(validate(args.spec).plan, installed_spec_path(args.spec))
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for label, argv in (("with draft", appliance.argv), ("no draft", tuple(without_draft(list(appliance.argv))))):
            process, api, notify, t0 = start(
                replace(appliance, argv=argv, draft_in_use=label == "with draft", speculation=label == "with draft"),
                Path(tmp),
            )
            try:
                healthy, ready = time_to_ready(process, api, notify, t0)
                rate, acceptance = decode_rate(api, args.tokens, args.runs)
            finally:
                process.terminate()
                process.wait(60)
            rows.append((label, healthy, ready, rate, acceptance))
    print(f"spec: {args.spec}  ({args.runs} runs x {args.tokens} tokens, greedy, median)")
    print(f"{'':12} {'to /health ok':>14} {'to READY':>9} {'launcher':>9} {'decode tok/s':>13} {'acceptance':>11}")
    for label, healthy, ready, rate, acceptance in rows:
        print(
            f"{label:12} {healthy:13.2f}s {ready:8.2f}s {1000 * (ready - healthy):7.0f}ms {rate:13.1f} {acceptance:11.2f}"
        )
    print("to /health ok: process start + model load; launcher: READY=1 after /health first answered 200")


if __name__ == "__main__":
    main()
