"""The engine's commands: install (build or adopt llama-server), prove it on this machine, show what it is."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from appliance.cli.commands import EXIT_ENGINE, EXIT_OK, say_engine
from appliance.facts.dialect import builtin_dialect, read_binary_dialect
from appliance.facts.engine_manifest import Manifest
from appliance.facts.engine_record import EngineRecord, engine_lines, record_file, stale_reason
from appliance.ops import engine_build
from appliance.ops.engine_ladder import applied_validated, ensure_proven, reapply_rung
from appliance.plan.resolved import Appliance
from appliance.plan.validate import validate
from appliance.spec.base import DEFAULT_BINARY
from appliance.spec.load import load_spec
from appliance.system import paths
from appliance.system.run import CommandFailed
from appliance.system.users import NoServiceUser, runs_as


def cmd_engine_install(args: argparse.Namespace) -> int:
    binary = args.binary
    if binary is None and args.spec is not None:
        named = load_spec(args.spec).spec.server.binary
        binary = named if named != DEFAULT_BINARY else None
    manifest = engine_build.install(dest=args.dest, binary=binary, jobs=args.jobs)
    if args.spec is not None and args.dest == paths.ENGINE_DIR:
        ensure_proven(validate(args.spec), say_engine)  # after every install: proven before anything serves
    print(manifest.binary)
    return EXIT_OK


def cmd_engine_prove(args: argparse.Namespace) -> int:
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
