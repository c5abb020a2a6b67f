"""No engine serves before it is proven on the machine it runs on.

The proof: the real llama-server with the spec's own command line (its model, threads, devices, KV types,
speculation) on a free loopback port of its own, as the service user, with a key of its own, decodes a fixed
greedy prompt to its natural stop. It passes when it answers with text; its decode and prompt tok/s are the
engine's figures on this machine.

When the engine as built fails, the ladder finds the fastest that works, by measurement: the same binary with
`--no-repack`, a rebuild for this CPU's instruction sets less AMX, a portable build. Each rung is proven the
same way; the fastest that passes is kept, installed as the engine, and recorded with the story of the climb
(facts/engine_record.py). A spec can pin a rung (`engine.rung`): then that rung alone is proven.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from appliance.facts.cpu import Cpu, read_cpu
from appliance.facts.engine_manifest import Manifest
from appliance.facts.engine_record import (
    RUNG_ARGS,
    RUNG_BUILD,
    RUNG_MEANING,
    RUNGS,
    EngineRecord,
    Rung,
    Trial,
    current_fingerprint,
    record_file,
    stale_reason,
)
from appliance.facts.gpu import Nvml
from appliance.plan.plan import plan
from appliance.plan.resolved import Appliance
from appliance.plan.validate import Validated, validate, validate_loaded
from appliance.render.apply import Change, changes, write
from appliance.render.render import render
from appliance.runtime.server_api import ServerApi, ServerUnreachable
from appliance.runtime.server_death import describe_exit
from appliance.runtime.server_process import die_with_parent, free_port, stop, temporary_key, wait_until_ready
from appliance.spec.load import KeyLines, LoadedSpec
from appliance.spec.problems import Severity
from appliance.system import paths
from appliance.system.run import DEVNULL, PIPE, STDOUT, Popen, spawn
from appliance.system.users import Account, NoServiceUser, runs_as

LOAD_TIMEOUT = 900.0  # a 27B model takes minutes to load from a cold disk
ANSWER_TIMEOUT = 600.0
# A question with one short answer: the natural stop comes within a sentence on any instruction-tuned model.
PROOF_MESSAGES = [
    {"role": "system", "content": "You are a concise coding assistant."},
    {
        "role": "user",
        "content": "In one sentence: what does this Python function return for [3, 1, 2]?\n\n"
        "def largest(xs):\n    return sorted(xs)[-1]\n",
    },
]
PROOF_MAX_TOKENS = 160
PROOF_ANSWERS = 2
GREEDY = {"temperature": 0.0, "top_k": 1, "seed": 0, "cache_prompt": False}


class EngineUnproven(Exception):
    """No rung of the ladder works on this machine, or the proof cannot run here; the message says what to do."""


class Builds(Protocol):
    """The engine builds the ladder can ask for: a variant's binary (built when needed) and making one the engine."""

    def binary(self, variant: str) -> Path | None:
        """The variant's llama-server, built if it is not yet; None when rebuilding is not ours to do."""

    def install(self, variant: str) -> Manifest:
        """Make the variant the installed engine."""


def proof_plan(validated: Validated, port: int, key_file: Path) -> tuple[str, ...]:
    """The spec's argv planned again on 127.0.0.1:port with `key_file` as its key, as the server unit would run
    it but for that, and without the flags of any rung (the ladder adds each rung's own)."""
    spec = validated.plan.spec
    server = spec.server.model_copy(update={"host": "127.0.0.1", "port": port, "api_key_file": key_file})
    spec = spec.model_copy(update={"server": server})
    planned = plan(spec, replace(validated.facts, engine=None), validated.plan.target, validated.plan.draft)
    errors = [p for p in planned.problems if p.severity is Severity.ERROR]
    if errors:
        raise EngineUnproven("cannot plan the proof: " + "; ".join(f"{p.field}: {p.message}" for p in errors))
    return planned.argv


def run_proof(
    argv: Sequence[str],
    who: Account | None,
    key: str,
    port: int,
    build_sets: tuple[str, ...],
    cpu: Cpu,
    rung: Rung,
    load_timeout: float = LOAD_TIMEOUT,
) -> Trial:
    """One rung's proof: start, wait for /health, one greedy chat completion, stop. Never raises for the
    engine's own failure: that is the Trial's."""
    tail: deque[str] = deque(maxlen=400)
    process = spawn(
        argv,
        stdin=DEVNULL,
        stdout=PIPE,
        stderr=STDOUT,
        errors="replace",
        bufsize=1,
        preexec_fn=die_with_parent,
        user=who.uid if who else None,
        group=who.gid if who else None,
        extra_groups=list(who.groups) if who else None,
    )
    reader = threading.Thread(
        target=lambda: tail.extend(line.rstrip("\n") for line in process.stdout or ()), daemon=True
    )
    reader.start()
    api = ServerApi(f"http://127.0.0.1:{port}", key, timeout=5.0)
    try:
        if not wait_until_ready(process, api, load_timeout):
            return _failed(rung, process, tail, reader, build_sets, cpu, f"did not load within {load_timeout:.0f} s")
        answers = []
        # Twice: the first answer warms the caches; the better of the two is the figure (a neighbour's burst
        # on a small machine can halve one sample).
        for _ in range(PROOF_ANSWERS):
            try:
                answers.append(api.chat(PROOF_MESSAGES, PROOF_MAX_TOKENS, timeout=ANSWER_TIMEOUT, **GREEDY))
            except ServerUnreachable as exc:
                return _failed(rung, process, tail, reader, build_sets, cpu, f"did not answer: {exc}")
        return _judged(rung, answers)
    finally:
        stop(process, timeout=30)


def _judged(rung: Rung, answers: list[dict[str, Any]]) -> Trial:
    """The proof's verdict on its answers: text, and the best figures of them."""
    choice = (answers[0].get("choices") or [{}])[0]
    text = str((choice.get("message") or {}).get("content") or "").strip()
    if not text:
        reason = choice.get("finish_reason")
        return Trial(rung, False, failure=f"answered with no text (finish_reason {reason!r}): no usable answer")
    timings = [answer.get("timings") or {} for answer in answers]
    return Trial(
        rung,
        True,
        decode_tps=round(max(float(t.get("predicted_per_second") or 0.0) for t in timings), 2),
        prompt_tps=round(max(float(t.get("prompt_per_second") or 0.0) for t in timings), 2),
        output_sha256=hashlib.sha256(text.encode()).hexdigest(),
    )


def _failed(
    rung: Rung,
    process: Popen[str],
    tail: deque[str],
    reader: threading.Thread,
    build_sets: tuple[str, ...],
    cpu: Cpu,
    otherwise: str,
) -> Trial:
    """A failed proof, described by how the server ended when it did (a signal, an exit), else by `otherwise`."""
    with contextlib.suppress(Exception):
        process.wait(timeout=5)
    code = process.poll()
    if code is None:
        return Trial(rung, False, failure=f"llama-server {otherwise}")
    reader.join(timeout=5)
    return Trial(rung, False, failure="llama-server " + describe_exit(code, list(tail), build_sets, cpu))


def proof_user() -> Account | None:
    """Whom the proof runs as: the service user when root runs it (root runs nothing of the appliance's),
    else whoever runs it."""
    try:
        return runs_as()
    except NoServiceUser as exc:
        raise EngineUnproven(str(exc)) from None


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
            trial = run_proof(argv, who, key, port, sets, cpu, rung, load_timeout)
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
    best, _ = max(passed, key=lambda found: found[0].decode_tps)
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
    others = [t for t in trials if t is not best]
    return f"kept {RUNG_MEANING[best.rung]}, the fastest that answered ({best.decode_tps:.1f} tok/s); " + "; ".join(
        t.summary() for t in others
    )


def ensure_proven(
    validated: Validated,
    say: Say,
    force: bool = False,
    engine_dir: Path = paths.ENGINE_DIR,
    builds: Builds | None = None,
    load_timeout: float = LOAD_TIMEOUT,
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
    why = "asked to prove it again" if force else stale_reason(binary, record, manifest, pin)
    if why is None and record is not None:
        return record, False
    if os.geteuid() != 0:
        raise EngineUnproven(
            f"{binary} serves nothing before its proof on this machine: {why}; "
            f"run `sudo llm-appliance engine prove {validated.loaded.path}`"
        )
    say(f"{binary} is proven before it serves: {why}")
    from appliance.ops.engine_build import EngineBuilds  # the builds of this machine: only a proof needs them

    record = climb(validated, builds or EngineBuilds(engine_dir), manifest, pin, say, load_timeout)
    record.write(where)
    say(f"serving from rung {record.rung}: {record.reason}")
    return record, True


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
