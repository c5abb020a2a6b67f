"""Validation end to end: load the spec, read the model files, check vocabularies, plan.

This is the one place that reads model files and probes the machine; `plan.py` stays pure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from appliance.facts.calendar import CalendarInvalid, CalendarUnchecked, read_calendar
from appliance.facts.gguf import GGUFError, ModelInfo, read_model
from appliance.facts.machine import MachineFacts, gather
from appliance.facts.vocab import Vocab, VocabUnavailable, incompatibilities, read_vocab
from appliance.plan.plan import Plan, plan
from appliance.plan.sandbox import sandbox
from appliance.plan.secrets import key_problems
from appliance.spec.base import line_breaks
from appliance.spec.checks import spec_problems
from appliance.spec.load import LoadedSpec, load_spec
from appliance.spec.model import Spec
from appliance.spec.problems import Problem, Severity, SpecInvalid, error, warning

VocabReader = Callable[[Path, Path | None], Vocab]


@dataclass(frozen=True)
class Validated:
    loaded: LoadedSpec
    facts: MachineFacts
    plan: Plan

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.plan.problems if p.severity is Severity.WARNING]


def validate(path: Path, facts: MachineFacts | None = None, vocab_reader: VocabReader = read_vocab) -> Validated:
    """Everything `validate` checks; raises SpecInvalid (errors and warnings, located) on any error."""
    return validate_loaded(load_spec(path), facts, vocab_reader)


def validate_loaded(
    loaded: LoadedSpec,
    facts: MachineFacts | None = None,
    vocab_reader: VocabReader = read_vocab,
    key_files: bool = True,
) -> Validated:
    """`validate` of a spec already read (a fleet derives each host's spec from text of its own). Without
    `key_files`, the key files are not read here: on a cluster they come from a Secret this machine never holds
    (the pod's `up` checks them where they are)."""
    spec = loaded.spec
    keys = key_problems(spec) if key_files else []
    found = _name_problems(loaded.path) + spec_problems(loaded) + keys + _schedule_problems(spec)
    facts = facts or gather(spec)
    box, sandbox_problems = sandbox(spec, str(facts.binary) if facts.binary else spec.server.binary, key_files)
    found += sandbox_problems
    if spec.fallback is not None and facts.router_missing:
        found.append(
            error(
                "fallback",
                f"the router's unit would not start: this machine lacks {facts.router_missing}",
                "run `llm-appliance router-install` (install.sh does, for a spec with [fallback])",
            )
        )
    if facts.binary_untrusted:
        found.append(
            error(
                "server.binary",
                f"{facts.binary} is not run, not even its --help: {facts.binary_untrusted}, so it could run "
                f"anything as the server (and, for its probes, as root)",
                "install the engine where only root can write (`llm-appliance engine install` puts it in "
                "/opt/llm-appliance/engine), or make the binary, its libraries and every directory above them "
                "root's and not writable by others (chown root:root; chmod go-w)",
            )
        )
    if facts.dialect_note:
        found.append(
            warning("server.binary", facts.dialect_note, "run `llm-appliance engine install`, or set server.binary")
        )
    infos: dict[str, ModelInfo] = {}
    for role, model in (("target", spec.models.target), ("draft", spec.models.draft)):
        if model is None:
            continue
        if not model.path.is_absolute():
            continue  # sandbox.py says so, for every file the units open; read from here it would mislead
        try:
            infos[role] = read_model(model.path)
        except GGUFError as exc:
            found.append(
                error(
                    f"models.{role}.path",
                    f"{model.path}: {exc}",
                    "point it at a whole .gguf file; re-download or re-copy it if it was cut short",
                )
            )
    target, draft = infos.get("target"), infos.get("draft")
    # An engine that is not trusted lends no library to the vocabulary check, and a model the service user cannot
    # read cannot be compared by it (the check runs as that user): their errors above say so.
    unreadable = any(
        p.field in ("models.target.path", "models.draft.path") and p.severity is Severity.ERROR for p in found
    )
    if (
        target is not None
        and draft is not None
        and spec.speculative.draft_types
        and not facts.binary_untrusted
        and not unreadable
    ):
        found += _vocab_problems(
            spec.models.target.path, spec.models.draft.path if spec.models.draft else Path(), facts, vocab_reader
        )
    result = None
    if target is not None and (spec.models.draft is None or draft is not None):
        result = plan(spec, facts, target, draft)
        found += result.problems
    located = [loaded.locate(p) for p in found]
    if result is None or any(p.severity is Severity.ERROR for p in located):
        raise SpecInvalid(located)
    return Validated(loaded, facts, replace(result, problems=tuple(located), sandbox=box))


def _name_problems(path: Path) -> list[Problem]:
    """apply installs the spec as /etc/llm-appliance/NAME, and the rendered files name it in their headers."""
    found = line_breaks(path.name)
    if not found:
        return []
    return [
        error(
            "(the spec file's name)",
            f"{path.name!r} holds {', '.join(found)}: the rendered units, ruleset and rules name the installed spec "
            "in a comment line, which this would break",
            "rename the file, e.g. appliance.toml",
        )
    ]


def _schedule_problems(spec: Spec) -> list[Problem]:
    """The restart timer's OnCalendar=, read by the parser the timer will use."""
    schedule = spec.restart.schedule
    try:
        calendar = read_calendar(schedule)
    except CalendarInvalid as exc:
        return [
            error(
                "restart.schedule",
                f"systemd cannot read {schedule!r} as a calendar: {exc}",
                "write an OnCalendar expression, e.g. '*-*-* 04:00:00', 'daily' or 'Sun 03:00' "
                "(try it: systemd-analyze calendar 'EXPRESSION'; see man systemd.time)",
            )
        ]
    except CalendarUnchecked as exc:
        return [
            warning(
                "restart.schedule",
                f"cannot check {schedule!r} with systemd's own parser: {exc}",
                "validate on the machine that runs the units",
            )
        ]
    if calendar.next_elapse == "never":
        return [
            warning(
                "restart.schedule",
                f"{schedule!r} ({calendar.normalized}) never comes again: the scheduled restart will not run",
                "write a recurring expression, e.g. 'daily' or '*-*-* 04:00:00'",
            )
        ]
    return []


def _vocab_problems(target: Path, draft: Path, facts: MachineFacts, reader: VocabReader) -> list[Problem]:
    try:
        reasons = incompatibilities(reader(target, facts.binary), reader(draft, facts.binary))
    except VocabUnavailable as exc:
        return [
            error(
                "models.draft.path",
                f"cannot compare the draft's vocabulary with the target's: {exc}",
                "run `llm-appliance engine install` (it provides llama.cpp's library), or set LLAMA_CPP_LIB_PATH",
            )
        ]
    if not reasons:
        return []
    return [
        error(
            "models.draft.path",
            f"the draft's vocabulary is incompatible with the target's ({'; '.join(reasons)}): llama-server would free the draft and serve without speculation",
            "use a draft from the target's model family (same tokenizer), e.g. the family's 0.5-1B model",
        )
    ]
