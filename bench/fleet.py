#!/usr/bin/env python3
"""The fleet under load, for the record: three demo appliances behind the real HAProxy in network namespaces
(tests/fleet_netns.py), a steady stream of streaming chat completions through it (tests/fleet_traffic.py),
and each scenario of the fleet test with more load: a rolling scheduled restart of all three hosts, an induced
decay on one, kill -9 of one llama-server. Prints each scenario's timeline, the requests lost (with HAProxy's
log line for each) and a table; asserts nothing.

    sudo /opt/llm-appliance/venv/bin/python bench/fleet.py [--workers 4] [--tokens 24] [--after 40]
        [--requests 2000] [--seconds 400] [--scenarios rolling,decay,kill] [--keep]

Needs root (network namespaces), iproute2, HAProxy, the engine and the demo model (`llm-appliance models
fetch`). Nothing is left behind: namespaces, links and processes go at the end (the work directory too,
unless --keep, which prints where the logs are).

- failed: no response began (a connection error, or HAProxy's 503 when its retries were spent);
- cut: a response began and ended before `data: [DONE]` (a generation lost mid-stream);
- retried: HAProxy's own retries (haproxy_backend_retry_warnings_total): requests a host refused or dropped
  before answering, sent again to another host.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from fleet_netns import Fleet, FleetError, missing_tools  # noqa: E402
from fleet_traffic import (  # noqa: E402
    Action,
    LoadShape,
    Outcome,
    induced_decay,
    kill_server,
    rolling_restart,
    run_scenario,
)

SCENARIOS: dict[str, tuple[str, Action]] = {
    "rolling": ("rolling scheduled restart", rolling_restart),
    "decay": ("induced decay", induced_decay),
    "kill": ("kill -9 llama-server", kill_server),
}
MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the demo's (appliance/ops/models.py)
COLUMNS = ("scenario", "sent", "ok", "failed", "cut", "retried", "min ready", "seconds")


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in [COLUMNS, *rows]) for i in range(len(COLUMNS))]

    def line(row: tuple[str, ...]) -> str:
        return "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )

    return "\n".join([line(COLUMNS), line(tuple("-" * w for w in widths)), *map(line, rows)])


def row(outcome: Outcome) -> tuple[str, ...]:
    counts = (outcome.sent, outcome.ok, outcome.failed, outcome.cut, outcome.retried, outcome.min_ready)
    return (outcome.scenario, *map(str, counts), f"{outcome.seconds:.0f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4, help="concurrent clients (the fleet has 3 slots)")
    parser.add_argument("--tokens", type=int, default=24, help="max_tokens of each chat completion")
    parser.add_argument("--before", type=int, default=20, help="requests completed before each scenario's event")
    parser.add_argument("--after", type=int, default=40, help="requests completed after it (the fleet serves again)")
    parser.add_argument("--requests", type=int, default=2000, help="at most this many requests per scenario")
    parser.add_argument("--seconds", type=float, default=400, help="at most this long per scenario")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"of {', '.join(SCENARIOS)}")
    parser.add_argument(
        "--models",
        type=Path,
        default=Path(os.environ.get("LLM_APPLIANCE_MODELS", "/var/lib/llm-appliance/models")),
        help="where the demo model is (default $LLM_APPLIANCE_MODELS or %(default)s)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory (rendered files, logs)")
    args = parser.parse_args()
    chosen = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in SCENARIOS]
    problems = [f"unknown scenario {name!r} (choose from {', '.join(SCENARIOS)})" for name in unknown]
    if os.geteuid() != 0:
        problems.append("network namespaces need root: sudo /opt/llm-appliance/venv/bin/python bench/fleet.py")
    problems += [
        f"{tool} is not installed (Debian: iproute2, haproxy)" for tool in missing_tools() if tool != "prometheus"
    ]
    if not (args.models / MODEL).exists():
        problems.append(f"{args.models / MODEL} is missing: llm-appliance models fetch --dest {args.models}")
    try:
        import appliance.cli.main  # noqa: F401  (each host's `up` runs with this interpreter)
    except ImportError as exc:
        problems.append(f"this Python cannot run llm-appliance ({exc}): use /opt/llm-appliance/venv/bin/python")
    if problems:
        print("\n".join(f"bench/fleet.py: {p}" for p in problems), file=sys.stderr)
        return 2

    shape = LoadShape(args.workers, args.requests, args.seconds, args.tokens, args.before, args.after)
    # In /var/lib: the service user must reach the API key file (validate checks it as the server reads it).
    work = Path(tempfile.mkdtemp(prefix="llm-appliance-fleet-bench-", dir="/var/lib"))
    work.chmod(0o755)
    rows: list[tuple[str, ...]] = []
    reports: list[str] = []
    try:
        with Fleet(work, args.models) as fleet:
            for name in chosen:
                title, action = SCENARIOS[name]
                try:
                    outcome = run_scenario(fleet, title, shape, action)
                except FleetError as exc:
                    rows.append((title, *["-"] * (len(COLUMNS) - 1)))
                    reports.append(f"{title}: did not complete: {exc}")
                    continue
                rows.append(row(outcome))
                reports.append(outcome.report(fleet))
    except FleetError as exc:
        print(f"bench/fleet.py: the fleet did not start: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"\nwork directory (rendered files, logs of every host, HAProxy and Prometheus): {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{args.workers} clients, {args.tokens} tokens per completion, {args.after} completed after each event\n")
    print("\n\n".join(reports))
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
