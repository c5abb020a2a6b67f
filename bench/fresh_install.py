#!/usr/bin/env python3
"""Time the README's install command on a pristine Debian 12 (the fresh-machine test's container), from
nothing to the first drafted answer, step by step. Prints figures; asserts nothing.

    /opt/llm-appliance/venv/bin/python bench/fresh_install.py [--cold] [--json]

--cold gives the container an empty compiler cache (a first install anywhere); without it the host's
ccache is shared (what a second machine with a warm cache, or a rebuild, sees). Packages come from the
test's local Debian mirror and PyPI wheelhouse, so network speed is not in the figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from machines import TEST_CACHE, Machine, checkout, fresh_machine, host_ccache_dir

VENV_PIP = Path("/opt/llm-appliance/venv/bin/pip")
CHECKOUT = "/root/llm-appliance"
# The first line of each step in install.sh's output, in order.
STEPS = (
    ("OS packages", "== OS packages"),
    ("venv and pip install", "== virtualenv"),
    ("user, state directories", "== install"),
    ("engine: download and verify", "engine: downloading"),
    ("engine: unpack", "engine: unpacking"),
    ("engine: configure", "engine: configuring"),
    ("engine: compile", "engine: building"),
    ("engine: install", "engine: installed"),
    ("models", "models: fetching"),
    ("specs, apply, start to READY", "install: installed /etc/llm-appliance"),
)


def timed_install(machine: Machine) -> tuple[list[tuple[float, str]], float]:
    """install.sh's output lines with the time each appeared; the time it returned."""
    lines = []
    command = machine.argv(f"cd {CHECKOUT} && ./install.sh --demo 2>&1")
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, errors="replace") as install:
        assert install.stdout is not None
        for line in install.stdout:
            lines.append((time.time(), line.rstrip("\n")))
    if install.returncode != 0:
        tail = "\n".join(text for _, text in lines[-40:])
        raise SystemExit(f"install.sh exited {install.returncode}:\n{tail}")
    return lines, time.time()


def durations(lines: list[tuple[float, str]], started: float, returned: float) -> list[tuple[str, float]]:
    marks = []
    for name, prefix in STEPS:
        at = next((t for t, text in lines if text.startswith(prefix)), None)
        if at is not None:
            marks.append((name, at))
    ends = [t for _, t in marks[1:]] + [returned]
    return [(name, end - begin) for (name, begin), end in zip(marks, ends, strict=True)] + [
        ("before the first step", marks[0][1] - started if marks else 0.0)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cold", action="store_true", help="an empty compiler cache")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    ccache = TEST_CACHE / "bench-ccache" if args.cold else host_ccache_dir()
    if args.cold:
        shutil.rmtree(ccache, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="fresh-bench-") as work:
        root = Path(work) / "root"
        root.mkdir()
        with fresh_machine(root, VENV_PIP, ccache) as machine:
            checkout(root / CHECKOUT.lstrip("/"))
            started = time.time()
            lines, returned = timed_install(machine)
            answer = machine.chat("Say hello.", 16)
            answered = time.time()
    timings = answer.get("timings", {})
    figures = {
        "compiler_cache": "cold" if args.cold else "warm",
        "steps_seconds": dict(durations(lines, started, returned)),
        "install_seconds": returned - started,
        "first_answer_seconds": answered - returned,
        "total_seconds": answered - started,
        "draft_n": timings.get("draft_n") if isinstance(timings, dict) else None,
    }
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(
        f"fresh install, {figures['compiler_cache']} compiler cache (Debian 12, nspawn, {Path('/proc/cpuinfo').read_text().count('processor')} cores)"
    )
    for name, seconds in figures["steps_seconds"].items():  # type: ignore[attr-defined]
        print(f"  {name:32s} {seconds:7.1f} s")
    print(f"  {'install.sh returned':32s} {figures['install_seconds']:7.1f} s")
    print(f"  {'first answer':32s} {figures['first_answer_seconds']:7.1f} s (draft_n {figures['draft_n']})")
    total = float(figures["total_seconds"])  # type: ignore[arg-type]
    print(f"  {'from nothing to the first answer':32s} {total:7.1f} s ({total / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
