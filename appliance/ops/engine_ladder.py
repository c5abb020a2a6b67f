"""The engine ladder: when the engine as built fails its proof (ops/engine_proof.py), find the fastest that
works, by measurement, and record it; and the one call everything that serves makes first (`ensure_proven`).

The rungs, top down (facts/engine_record.py RUNGS): the engine as built; the same binary with `--no-repack`;
a rebuild for this CPU's instruction sets less AMX (only where the CPU reports AMX); a portable build (only
when neither of the two above answered). The fastest rung that answers is kept and, when it is a rebuild,
installed as the engine. A spec can pin a rung (`engine.rung`): then that rung alone is proven.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from appliance.facts.cpu import read_cpu
from appliance.facts.engine_manifest import Manifest
from appliance.facts.engine_record import (
    RUNG_ARGS,
    RUNG_BUILD,
    RUNG_MEANING,
    RUNGS,
    EngineRecord,
    Measured,
    Trial,
    current_fingerprint,
    record_file,
    stale_reason,
)
from appliance.facts.gpu import Nvml
from appliance.ops.engine_build import EngineBuilds
from appliance.ops.engine_proof import (
    LOAD_TIMEOUT,
    EngineUnproven,
    proof_plan,
    proof_user,
    run_proof,
)
from appliance.plan.priority import PRIORITIES
from appliance.plan.resolved import Appliance
from appliance.plan.validate import Validated, validate, validate_loaded
from appliance.render.apply import Change, changes, write
from appliance.render.render import render
from appliance.runtime.server_process import free_port, temporary_key
from appliance.spec.load import KeyLines, LoadedSpec
from appliance.system import paths


class Builds(Protocol):
    """The engine builds the ladder can ask for: a variant's binary (built when needed) and making one the engine."""

    def binary(self, variant: str) -> Path | None:
        """The variant's llama-server, built if it is not yet; None when rebuilding is not ours to do."""

    def install(self, variant: str) -> Manifest:
        """Make the variant the installed engine."""


Say = Callable[[str], None]


def climb(
    validated: Validated,
    builds: Builds,
    manifest: Manifest | None,
    pin: str = "auto",
    say: Say = print,
    load_timeout: float = LOAD_TIMEOUT,
    nvml: Nvml | None = None,
) -> EngineRecord:
    """The proof, and when it fails the ladder; the record of the rung kept (written by the caller)."""
    cpu = read_cpu()
    who = proof_user()
    binary = Path(validated.plan.argv[0])
    ours = manifest is not None and manifest.origin == "built"
    installed = manifest.variant if manifest is not None else "installed"
    rungs = tuple(r for r in RUNGS if r == pin) or RUNGS
    trials: list[Trial] = []
    passed: list[tuple[Trial, Path]] = []
    for rung in rungs:
        if pin == "auto" and rung != "as-built":
            if trials and trials[0].passed:
                break  # the engine as built works: the ladder is for engines that do not
            if rung == "portable" and passed:
                break  # a faster rung works; the portable build is the last resort
            if rung == "no-amx" and not cpu.amx:
                trials.append(
                    Trial(rung, False, failure="skipped: this CPU reports no AMX, so the native build has none")
                )
                continue
        variant = RUNG_BUILD[rung]
        if variant == installed or (not ours and variant == "native"):
            rung_binary: Path | None = binary
        else:
            rung_binary = builds.binary(variant) if ours else None
        if rung_binary is None:
            trials.append(
                Trial(rung, False, failure=f"skipped: {binary} is not built by llm-appliance, so no {variant} build")
            )
            continue
        sets = tuple(manifest.instruction_sets) if manifest and rung_binary == binary else _built_sets(rung_binary)
        say(f"proving {RUNG_MEANING[rung]} ({rung_binary})")
        with temporary_key(who) as (key_file, key):
            port = free_port()
            proof = proof_plan(validated, port, key_file)
            argv = [str(rung_binary), *proof[1:], *RUNG_ARGS.get(rung, ())]
            nice = PRIORITIES[validated.plan.spec.server.priority].nice
            trial = run_proof(argv, who, key, port, sets, cpu, rung, load_timeout, nice)
        say(trial.summary())
        trials.append(trial)
        if trial.passed:
            passed.append((trial, rung_binary))
    if not passed:
        story = "; ".join(t.summary() for t in trials)
        raise EngineUnproven(
            f"no engine works on this machine ({cpu.model}): {story}. Nothing will serve from it; "
            "see `llm-appliance engine info`"
        )
    best = fastest([trial for trial, _ in passed], lambda t: not ours or RUNG_BUILD[t.rung] == installed)
    if ours and RUNG_BUILD[best.rung] != installed:
        manifest = builds.install(RUNG_BUILD[best.rung])
    return EngineRecord(
        fingerprint=current_fingerprint(binary, manifest, cpu, nvml),
        rung=best.rung,
        reason=_reason(best, trials, pin),
        trials=tuple(trials),
        proof_argv=(str(binary), *validated.plan.argv[1:]),
        proven_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        pinned=pin != "auto",
        cpu_instruction_sets=cpu.instruction_sets,
    )


# A rung that needs another build installed replaces the one installed only when it decodes faster by more than
# this: within it, two samples on a busy machine cannot tell them apart, and the choice would flap proof by proof.
SWITCH_MARGIN = 0.1


def fastest(passed: list[Trial], installed: Callable[[Trial], bool]) -> Trial:
    """The rung kept: the fastest that answered, unless one that runs the installed build is within the margin."""
    best = max(passed, key=lambda t: t.decode_tps)
    at_hand = [t for t in passed if installed(t)]
    if not installed(best) and at_hand:
        near = max(at_hand, key=lambda t: t.decode_tps)
        if near.decode_tps >= (1 - SWITCH_MARGIN) * best.decode_tps:
            return near
    return best


def _built_sets(binary: Path) -> tuple[str, ...]:
    """The instruction sets of a build in the cache: its options say (facts/cpu.py INSTRUCTION_SETS)."""
    options = binary.parent.parent / "llm-appliance-options.txt"
    try:
        words = options.read_text().split()
    except OSError:
        return ()
    return tuple(
        w.removeprefix("-D").removesuffix("=ON")
        for w in words
        if w.startswith("-DGGML_") and w.endswith("=ON") and "NATIVE" not in w
    )


def _reason(best: Trial, trials: list[Trial], pin: str) -> str:
    if pin != "auto":
        return f"pinned by the spec (engine.rung = {pin!r}): {best.summary()}"
    if best.rung == "as-built" and len(trials) == 1:
        return f"proven as built: {best.summary()}"
    # The story in one line; each rung's whole figures or failure are the record's trials.
    answered = [f"{t.rung} {t.decode_tps:.1f}" for t in trials if t.passed and t is not best]
    failed = [f"{t.rung} {t.failure.split(';')[0].removeprefix('llama-server ')}" for t in trials if not t.passed]
    story = f"kept {RUNG_MEANING[best.rung]}, the fastest that answered ({best.decode_tps:.1f} tok/s decode"
    story += f"; also answered: {', '.join(answered)} tok/s)" if answered else ")"
    return story + (f"; {'; '.join(failed)}" if failed else "")


def ensure_proven(
    validated: Validated,
    say: Say,
    force: bool = False,
    engine_dir: Path = paths.ENGINE_DIR,
    builds: Builds | None = None,
    load_timeout: float = LOAD_TIMEOUT,
    nvml: Nvml | None = None,
) -> tuple[EngineRecord, bool]:
    """The record of the engine the validated spec would run, proven first when it is not (or when `force`),
    and whether a proof ran: what install, apply, up, bench, tune and the server unit's start call before
    anything serves. Only root proves (it writes the record beside the engine); anyone else is told to."""
    binary = Path(validated.plan.argv[0])
    pin = validated.plan.spec.engine.rung
    where = record_file(binary, engine_dir)
    record = EngineRecord.read(where)
    manifest = Manifest.read(engine_dir)
    manifest = manifest if manifest is not None and Path(manifest.binary) == binary else None
    why = "asked to prove it again" if force else stale_reason(binary, record, manifest, pin, nvml)
    if why is None and record is not None:
        return record, False
    if os.geteuid() != 0:
        raise EngineUnproven(
            f"{binary} serves nothing before its proof on this machine: {why}; "
            f"run `sudo llm-appliance engine prove {validated.loaded.path}`"
        )
    say(f"{binary} is proven before it serves: {why}")
    record = since(record, climb(validated, builds or EngineBuilds(engine_dir), manifest, pin, say, load_timeout, nvml))
    record.write(where)
    say(f"serving from rung {record.rung}: {record.reason}")
    if record.previous is not None:
        say(f"measured against the engine before: {record.change_summary()}")
    return record, True


def since(old: EngineRecord | None, new: EngineRecord) -> EngineRecord:
    """The new proof with what it is judged against: when the fingerprint changed, the old proof's figures and
    what changed; when it did not (a proof asked for again), whatever the old one was judged against."""
    if old is None:
        return new
    changed = tuple(new.fingerprint.changes_from(old.fingerprint))
    if not changed:
        return replace(new, previous=old.previous, changed=old.changed)
    kept = old.kept
    before = Measured(old.fingerprint, kept.decode_tps, kept.prompt_tps, kept.output_sha256, old.proven_at)
    return replace(new, previous=before, changed=changed)


def proven_validated(spec_path: Path, say: Say, force: bool = False) -> Validated:
    """The spec validated once its engine is proven: planned with the rung's flags (a proof that chose another
    rung changes the argv, so the spec is planned again)."""
    validated = validate(spec_path)
    _, proved = ensure_proven(validated, say, force)
    return validate(spec_path) if proved else validated


def applied_validated(appliance: Appliance) -> Validated:
    """The applied appliance's own spec, validated as it was applied (not the spec file as it is now)."""
    return validate_loaded(LoadedSpec(appliance.spec, appliance.spec_file, KeyLines()))


def rung_args_of(argv: Sequence[str]) -> tuple[str, ...]:
    """The rung flags an argv carries (the last words, as plan/argv.py puts them before extra_args)."""
    every = {arg for args in RUNG_ARGS.values() for arg in args}
    return tuple(arg for arg in argv if arg in every)


def reapply_rung(applied: Appliance, record: EngineRecord, root: Path = Path("/")) -> list[Change]:
    """The applied files again with the argv carrying `record`'s rung flags instead of another rung's: what a
    proof at the server's start does when the ladder chose another rung. Nothing else of the snapshot changes
    (the spec file on disk may have changed since: that is for `apply` to take, not a start)."""
    if rung_args_of(applied.argv) == record.extra_args:
        return []
    extra = applied.spec.server.extra_args
    every = {arg for args in RUNG_ARGS.values() for arg in args}
    planned = [arg for arg in applied.argv[: len(applied.argv) - len(extra)] if arg not in every]
    argv = (*planned, *record.extra_args, *extra)
    found = changes(render(replace(applied, argv=argv)), root)
    write(found, root)
    return found
