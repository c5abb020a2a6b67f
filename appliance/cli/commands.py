"""The commands of `llm-appliance`, one function each: arguments in, an exit code out.

Exit codes: 0 ok, 1 invalid spec or snapshot (or rendered files their own checkers reject), 2 usage, 3 apply
or a system command failed, 4 engine or model provisioning failed, 130 interrupted. `status` has its own, a
monitoring plugin's: 0 healthy, 1 degraded, 2 down, 3 unknown.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from appliance.facts.dialect import builtin_dialect, read_binary_dialect
from appliance.facts.engine_manifest import Manifest
from appliance.facts.engine_record import EngineRecord, engine_lines, record_file, stale_reason
from appliance.ops import engine_build, models
from appliance.plan.budget import GIB, lines
from appliance.plan.explain import plan_json, speculation_lines
from appliance.plan.fit import fit_lines, largest_fits
from appliance.plan.resolved import SNAPSHOT, Appliance, SnapshotError, changed_fields, resolve
from appliance.plan.validate import Validated, validate
from appliance.render.apply import changes, installed_spec_path, reload_system, write
from appliance.render.check import require_accepted
from appliance.render.render import render
from appliance.runtime.launch import Launcher, LaunchPlan
from appliance.spec.base import DEFAULT_BINARY
from appliance.spec.load import load_spec
from appliance.spec.model import Spec
from appliance.spec.problems import SpecInvalid, format_problems
from appliance.system import paths
from appliance.system.run import CommandFailed
from appliance.system.users import NoServiceUser, runs_as

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_APPLY, EXIT_ENGINE = 0, 1, 2, 3, 4


def _validated(spec: Path) -> Validated:
    result = validate(spec)
    if result.warnings:
        print(format_problems(result.warnings), file=sys.stderr)
    return result


def cmd_validate(args: argparse.Namespace) -> int:
    result = _validated(args.spec)
    print(f"{args.spec}: valid ({len(result.warnings)} warning{'s' if len(result.warnings) != 1 else ''})")
    return EXIT_OK


def cmd_explain(args: argparse.Namespace) -> int:
    result = validate(args.spec) if args.json else _validated(args.spec)
    plan = result.plan
    fits = largest_fits(plan.spec, result.facts, plan.target, plan.draft)
    if args.json:
        print(json.dumps(plan_json(plan, fits, result.warnings), indent=2))
        return EXIT_OK
    print(
        f"target: {plan.target.path} ({plan.target.architecture}, {plan.target.file_type}, {plan.target.block_count} layers, trained ctx {plan.target.context_length})"
    )
    if plan.draft:
        print(
            f"draft:  {plan.draft.path} ({plan.draft.architecture}, {plan.draft.file_type}, {plan.draft.block_count} layers)"
        )
    print(f"dialect: {result.facts.dialect.source}")
    print("\n".join(engine_lines(result.facts.engine, result.facts.engine_stale)))
    print(f"model name in the API (clients send it as `model`): {plan.alias}")
    print("\n".join(speculation_lines(plan)))
    print("\nllama-server argv:")
    print("  " + " \\\n    ".join(_pairs(plan.argv)))
    print("\nmemory budget:")
    budget = list(lines(plan.budgets))
    print("\n".join(budget) if budget else "  no GPU device in the plan (CPU only)")
    print("\n".join(lines((plan.host,))) if plan.host else "  host RAM unknown: not budgeted")
    available = result.facts.host_memory.available_bytes if result.facts.host_memory else None
    if plan.host and available is not None:
        print(f"  (available now, MemAvailable: {available / GIB:.2f} GiB)")
    print("\nlargest that fits, per device (each alone):")
    print("\n".join(fit_lines(fits, plan.spec)) if fits else "  no device is budgeted")
    print("\nwarnings:")
    print(format_problems(result.warnings) if result.warnings else "  none")
    return EXIT_OK


def _pairs(argv: Sequence[str]) -> list[str]:
    """Group each flag with its value for a readable listing, quoted as a shell would need (an empty value shows)."""
    grouped: list[str] = []
    for arg in map(shlex.quote, argv):
        if grouped and not arg.startswith("-") and grouped[-1].startswith("-") and " " not in grouped[-1]:
            grouped[-1] += f" {arg}"
        else:
            grouped.append(arg)
    return grouped


def _appliance(spec_path: Path, state_dir: Path = paths.STATE) -> Appliance:
    """The spec validated and resolved, as apply would install it (at /etc/llm-appliance/NAME)."""
    return resolve(_validated(spec_path).plan, installed_spec_path(spec_path), state_dir)


def _proven(spec_path: Path) -> Validated:
    """The spec validated once the engine it runs is proven on this machine (apply, up, bench, tune): no
    engine serves before its proof."""
    from appliance.ops.engine_proof import proven_validated

    result = proven_validated(spec_path, say_engine)
    if result.warnings:
        print(format_problems(result.warnings), file=sys.stderr)
    return result


def _files(spec_path: Path) -> dict[str, str]:
    files = render(_appliance(spec_path))
    files[str(installed_spec_path(spec_path)).lstrip("/")] = spec_path.read_text()
    return files


def checked_files(files: dict[str, str]) -> dict[str, str]:
    """`files` once their checkers accept them (RenderRejected otherwise); skipped checkers are said on stderr."""
    require_accepted(files, lambda note: print(f"check: {note}", file=sys.stderr))
    return files


def cmd_render(args: argparse.Namespace) -> int:
    files = _files(args.spec)
    if args.out is None:
        for relative, text in files.items():
            print(f"---{relative}---\n{text}", end="" if text.endswith("\n") else "\n")
        return EXIT_OK
    found = changes(checked_files(files), args.out)
    write(found, args.out)
    print(f"rendered {len(files)} files into {args.out} ({len(found)} changed)")
    return EXIT_OK


def cmd_apply(args: argparse.Namespace) -> int:
    if args.root == Path("/") and not args.dry_run:
        _proven(args.spec)  # the argv it renders carries the rung the proof chose
    found = changes(checked_files(_files(args.spec)), args.root)
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
    manifest = engine_build.install(dest=args.dest, binary=binary, jobs=args.jobs)
    if args.spec is not None and args.dest == paths.ENGINE_DIR:
        from appliance.ops.engine_proof import ensure_proven

        ensure_proven(validate(args.spec), say_engine)  # after every install: proven before anything serves
    print(manifest.binary)
    return EXIT_OK


def say_engine(line: str) -> None:
    print(f"engine: {line}", file=sys.stderr, flush=True)


def cmd_engine_prove(args: argparse.Namespace) -> int:
    from appliance.ops.engine_proof import applied_validated, ensure_proven, reapply_rung

    if args.snapshot is None:
        record, _ = ensure_proven(validate(args.spec), say_engine, force=not args.if_needed)
    else:
        applied = Appliance.read(args.snapshot)
        record, _ = ensure_proven(applied_validated(applied), say_engine, force=not args.if_needed)
        # A proof that chose another rung: the applied argv takes its flags, the rest of the snapshot as it was.
        for change in reapply_rung(applied, record):
            say_engine(f"{change.kind}d /{change.path}: the applied argv takes rung {record.rung}'s flags")
    print("\n".join(engine_lines(record)))
    return EXIT_OK


def cmd_engine_info(args: argparse.Namespace) -> int:
    manifest = Manifest.read(args.dest)
    if manifest is None:
        print(f"no engine manifest in {args.dest}; run `llm-appliance engine install`", file=sys.stderr)
        return EXIT_ENGINE
    print(json.dumps(manifest.__dict__, indent=2, sort_keys=True))
    binary = Path(manifest.binary)
    record = EngineRecord.read(record_file(binary, args.dest))
    print("\n".join(engine_lines(record, stale_reason(binary, record, manifest))))
    try:
        dialect = read_binary_dialect(Path(manifest.binary), runs_as())
    except (OSError, CommandFailed, NoServiceUser) as exc:
        print(f"cannot read the flag dialect of {manifest.binary}: {exc}", file=sys.stderr)
        return EXIT_ENGINE
    spec_flags = sorted(f for f in dialect.flags if f.startswith("--spec-") or f in ("-md", "--draft-max"))
    print(
        f"dialect: {len(dialect.flags)} flags; built-in dialect {'matches' if dialect.flags == builtin_dialect().flags else 'differs'}"
    )
    print(f"speculative flags: {' '.join(spec_flags)}")
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    """How the appliance is doing, and whether the spec on disk is what runs; the exit code of a monitoring plugin
    (0 healthy, 1 degraded, 2 down, 3 unknown). Under `up` (nothing applied): name the spec `up` runs."""
    from appliance.ops.status import EXIT, EXIT_UNKNOWN, format_status, gather

    snapshot = args.root / SNAPSHOT.relative_to("/")
    try:
        # --state-dir, or a spec and nothing applied: the appliance `up` runs from that spec. Which of systemd
        # and `up` runs it (if either does) gather finds out.
        if args.state_dir is None and (snapshot.exists() or args.spec is None):
            running = Appliance.read(snapshot)
            spec_path = args.spec or args.root / running.spec_file.relative_to("/")
            differences = _spec_differences(running, spec_path, args.root)
        else:
            running, differences = _appliance(args.spec, args.state_dir or paths.STATE), []
    except (SnapshotError, SpecInvalid) as exc:
        print(f"status: {exc}", file=sys.stderr)
        return EXIT_UNKNOWN
    if args.root != Path("/"):
        # A staged tree: nothing of it runs here; only the spec comparison means anything.
        if not differences:
            print(f"spec: {spec_path} is what is applied")
            return 0
        print(f"spec: {spec_path} differs from what is applied; the running appliance still uses the applied one")
        print("\n".join(f"  {line}" for line in differences))
        return 1
    seen = gather(running, differences)
    print(json.dumps(seen.document(), indent=2) if args.json else format_status(seen))
    return EXIT[seen.health]


def _spec_differences(applied: Appliance, spec_path: Path, root: Path) -> list[str]:
    """What `apply` of the spec on disk would change: its fields against the applied ones, then the files."""
    try:
        proposed = _appliance(spec_path)
    except SpecInvalid as exc:
        return [f"{spec_path} does not validate ({len(exc.errors)} errors): `llm-appliance validate {spec_path}`"]
    found = [f"{change.kind} {root / change.path}" for change in changes(_files(spec_path), root)]
    return changed_fields(applied, proposed) + found


def cmd_launch(args: argparse.Namespace) -> int:
    appliance = _appliance(args.spec) if args.spec else Appliance.read(args.snapshot)
    return Launcher(LaunchPlan.of(appliance), stop_timeout=args.stop_timeout).run()


def cmd_up(args: argparse.Namespace) -> int:
    """What the units do, in the foreground, for machines where systemd is not PID 1."""
    from appliance.health.service import up

    validated = _proven(args.spec)
    appliance = resolve(validated.plan, installed_spec_path(args.spec), args.state_dir or paths.STATE)
    print(
        f"llm-appliance up: serving {args.spec} at {appliance.server.url} in the foreground; Ctrl-C stops it",
        file=sys.stderr,
    )
    return up(appliance, args.stop_timeout, as_current_user=args.as_current_user)


def cmd_health(args: argparse.Namespace) -> int:
    from appliance.health.service import run_daemon

    return run_daemon(Appliance.read(args.snapshot))


def cmd_router(args: argparse.Namespace) -> int:
    from appliance.health.router import run_router

    return run_router(args.config_dir, as_current_user=args.as_current_user)


def cmd_router_install(args: argparse.Namespace) -> int:
    from appliance.ops.router_env import ensure_router

    ensure_router(lambda done: print(f"router-install: {done}", file=sys.stderr))
    return 0


def cmd_check_versions(args: argparse.Namespace) -> int:
    from appliance.health.service import check_versions

    return check_versions(Appliance.read(args.snapshot))


def cmd_restart(args: argparse.Namespace) -> int:
    from appliance.health.privileges import become_owner
    from appliance.health.service import request_restart

    # With --state-dir (a daemon of `up`), there is no applied snapshot to fall back on.
    applied = None if args.state_dir else Appliance.read(args.snapshot)
    state_dir = args.state_dir or applied.state_file.parent  # type: ignore[union-attr]
    if os.geteuid() == 0:
        # As the timer runs it: the state directory is the service user's (or root's, under `up` as root).
        become_owner(state_dir)
    return request_restart(state_dir, args.reason, applied)


def cmd_drain(args: argparse.Namespace) -> int:
    from appliance.health.privileges import become_owner
    from appliance.health.service import request_drain

    state_dir = args.state_dir or Appliance.read(args.snapshot).state_file.parent
    if os.geteuid() == 0:
        become_owner(state_dir)  # as for `restart`: the daemon's state directory is the service user's
    return request_drain(state_dir, args.timeout)


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
    from appliance.measure.bench import main_bench

    result = _proven(args.spec)
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


def cmd_tune(args: argparse.Namespace) -> int:
    from appliance.measure.tune import main_tune

    result = _proven(args.spec)
    return main_tune(
        args.spec,
        result,
        workloads=args.workload,
        grids=args.grid,
        types=args.types,
        draft_gpu_layers=args.draft_gpu_layers,
        draft_cache_types=args.draft_cache_type,
        reps=args.reps,
        tokens=args.tokens,
        tolerance=args.tolerance,
        suite_file=args.suite,
        write=args.write,
        as_json=args.json,
        baseline=_baseline_path(args, result),
        longest_context=args.ctx == "max",
    )


def cmd_models_fetch(args: argparse.Namespace) -> int:
    for name, path in models.fetch(args.dest).items():
        print(f"{name}: {path}")
    return EXIT_OK
