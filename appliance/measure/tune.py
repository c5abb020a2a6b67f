"""`llm-appliance tune`: how to speculate, chosen by measurement: the type (none, the draft, n-gram lookup, both),
then that type's parameters one at a time, measured with bench, the best kept.

llama-server applies one set of speculative values to every request (its per-request fields sit under
`#if 0`), so each configuration is a server start, and the values written are the best for the workload
mix the user names; each workload's own best is kept as a profile, with what it loses by sharing. Where
nothing beats no speculation, the answer is `type = "none"`.

This module glues the others together: the options parsed (their bounds are the spec model's), the search
(search.py) run on real servers (`ServerMeasure`: server.py and measure.py), the report and the rewritten
spec (tune_report.py), the baseline (bench_report.py).
"""

from __future__ import annotations

import difflib
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from appliance.measure.bench_report import now, write_baseline
from appliance.measure.config import NGRAM_PARAMS, NO_SPECULATION, BenchError, BenchUsage, Config, bounds
from appliance.measure.measure import WorkloadResult, measure
from appliance.measure.progress import Progress
from appliance.measure.search import CACHE_ORDER, Params, Rates, TuneResult, Value, default_params, ngram_params, tune
from appliance.measure.server import TempServer
from appliance.measure.suite import CANARY, Prepared, canary_workload, load_suite
from appliance.measure.tune_report import format_report, profile_values, updated_spec, write_spec
from appliance.plan.budget import KV_CELL_PAD
from appliance.plan.fit import ctx_cap, largest_fits
from appliance.plan.plan import plan
from appliance.plan.validate import Validated
from appliance.system import paths


class ServerMeasure:
    """A Measure that starts llama-server with the configuration and benches the workloads on it."""

    def __init__(
        self,
        validated: Validated,
        workloads: Sequence[str],
        reps: int,
        tokens: int | None,
        suite_file: Path | None = None,
        progress: Progress | None = None,
    ) -> None:
        spec = validated.plan.spec
        self.validated = validated
        self.suite = load_suite(suite_file).select(workloads)
        self.reps = reps
        self.progress = progress or Progress(enabled=False)
        self.prepared = Prepared(list(self.suite.workloads), tokens, spec.server.slot_ctx, self.suite.stop_at_eos)
        self.results: dict[Config, dict[str, WorkloadResult]] = {}
        self.starts = 0

    def __call__(self, config: Config) -> Rates:
        self.starts += 1
        self.progress.plan(dict.fromkeys(self.suite.names, self.reps))
        self.progress.phase(f"server {self.starts}, {config.label()}")
        with TempServer(self.validated, config) as server:
            found = measure(
                server.api,
                self.prepared.get(server.api),
                self.reps,
                server.pid,
                self.progress,
                n_max=config.n_max if config.draft else None,
            )
        self.results[config] = found
        return {name: r.decode.median for name, r in found.items() if r.decode}

    def canary(self, config: Config) -> WorkloadResult:
        self.starts += 1
        self.progress.plan({CANARY: self.reps})
        self.progress.phase(f"server {self.starts}, the health canary with {config.label()}")
        prepared = Prepared([canary_workload()], None, self.prepared.slot_ctx)
        with TempServer(self.validated, config) as server:
            return measure(server.api, prepared.get(server.api), self.reps, server.pid, self.progress)[CANARY]


# Options ------------------------------------------------------------------------------------------


def parse_workloads(text: str | None, default: Mapping[str, float], names: Sequence[str]) -> dict[str, float]:
    """`code=2,chat` -> {code: 2, chat: 1}; without it, the spec's [tuning].workloads or every workload."""
    if not text:
        return dict(default) if default else dict.fromkeys(names, 1.0)
    weights: dict[str, float] = {}
    for item in text.split(","):
        name, _, weight = item.strip().partition("=")
        if not name:
            continue
        try:
            weights[name] = float(weight) if weight else 1.0
        except ValueError:
            raise BenchUsage(f"--workload {item!r}: the weight must be a number, e.g. code=2") from None
        if weights[name] <= 0:
            raise BenchUsage(f"--workload {item!r}: the weight must be above 0")
    unknown = [n for n in weights if n not in names]
    if unknown:
        raise BenchUsage(f"no workload {', '.join(unknown)} in the suite; it has {', '.join(names)}")
    return weights


NGRAM_GRID_NAMES = [f"{kind}.{name}" for kind, names in NGRAM_PARAMS.items() for name in names]


def parse_grid(items: Sequence[str]) -> dict[str, list[Value]]:
    """`--grid n_max=2,4,8 --grid p_min=0,0.5 --grid ngram-mod.n_match=8,16`; each value within the spec's
    bounds for its field (an n-gram size is at least 1)."""
    grids: dict[str, list[Value]] = {}
    for item in items:
        name, _, values = item.partition("=")
        if name not in ("n_max", "n_min", "p_min", *NGRAM_GRID_NAMES) or not values:
            raise BenchUsage(
                f"--grid {item!r}: write n_max=2,4,8 (n_max, n_min, p_min, or an n-gram type's: "
                f"{', '.join(NGRAM_GRID_NAMES)})"
            )
        try:
            parsed: list[Value] = [float(v) if name == "p_min" else int(v) for v in values.split(",")]
        except ValueError:
            raise BenchUsage(f"--grid {item!r}: the values must be numbers") from None
        low, high = bounds(name) if "." not in name else (1, 1024)
        if any(not low <= float(v) <= high for v in parsed):
            raise BenchUsage(f"--grid {item!r}: {name} must lie in {low}..{high}")
        grids[name] = parsed
    return grids


def candidate_types(validated: Validated, text: str | None) -> list[tuple[str, ...]]:
    """The types the search tries: `--types none,ngram-mod,draft-simple+ngram-mod`, or by default none, the
    n-gram lookups, and with a draft model the draft alone and with ngram-mod; only what the binary lists."""
    has_draft = validated.plan.spec.models.draft is not None
    if text:
        found = [tuple(t for t in item.strip().split("+") if t != "none") for item in text.split(",") if item.strip()]
    else:
        found = [(), ("ngram-mod",), ("ngram-simple",)]
        if has_draft:
            found[1:1] = [("draft-simple",), ("draft-simple", "ngram-mod")]
    listed = validated.facts.dialect.spec_types  # empty: the binary's --help lists none to check against
    for types in found:
        unknown = [t for t in types if listed and t not in listed]
        if unknown:
            raise BenchUsage(f"--types: {', '.join(unknown)} is not a --spec-type of {validated.facts.dialect.source}")
        if any(t.startswith("draft-") for t in types) and not has_draft:
            raise BenchUsage(f"--types: {'+'.join(types)} needs a draft model; add [models.draft] to the spec")
    return list(dict.fromkeys(found))


def parse_layers(text: str | None) -> list[Value]:
    if not text:
        return []
    values: list[Value] = []
    for v in text.split(","):
        v = v.strip()
        if v in ("all", "auto"):
            values.append(v)
        elif v.isdigit():
            values.append(int(v))
        else:
            raise BenchUsage(f"--draft-gpu-layers {v!r}: a number, all or auto")
    return values


def parse_cache_types(text: str | None) -> list[str]:
    cache_types = [c.strip() for c in (text or "").split(",") if c.strip()]
    bad = [c for c in cache_types if c not in CACHE_ORDER]
    if bad:
        raise BenchUsage(f"--draft-cache-type {', '.join(bad)}: use {', '.join(CACHE_ORDER)}")
    return cache_types


def _check_options(validated: Validated, reps: int, tokens: int | None, tolerance: float) -> None:
    if reps < 1 or (tokens is not None and tokens < 1):
        raise BenchUsage("--reps and --tokens must be at least 1")
    if not 0.0 <= tolerance < 0.5:
        raise BenchUsage("--tolerance is a share of the best rate: 0 to 0.5, e.g. 0.02")


def _start(validated: Validated, params: Params) -> Config:
    """The spec's own setting, with the draft's gpu layers and cache type when those are tuned too."""
    names = {p.name for p in params.draft}
    return Config.of(validated.plan.spec, "draft_gpu_layers" in names, "draft_cache_type" in names)


def with_longest_context(validated: Validated) -> Validated:
    """The validated spec re-planned at the largest ctx_size every budgeted device holds at once (the smallest
    of each device's own largest: each only grows with ctx_size), capped at the target's trained context."""
    found = validated.plan
    fits = largest_fits(found.spec, validated.facts, found.target, found.draft)
    ctx = min((fit.ctx_size for fit in fits), default=ctx_cap(found.target))
    if ctx < KV_CELL_PAD:
        raise BenchError("no ctx_size fits the memory budget; see `llm-appliance explain`")
    spec = found.spec.model_copy(update={"server": found.spec.server.model_copy(update={"ctx_size": ctx})})
    return replace(validated, plan=plan(spec, validated.facts, found.target, found.draft))


# The command --------------------------------------------------------------------------------------


def main_tune(
    spec_path: Path,
    validated: Validated,
    *,
    workloads: str | None,
    grids: Sequence[str],
    types: str | None = None,
    draft_gpu_layers: str | None,
    draft_cache_types: str | None,
    reps: int,
    tokens: int | None,
    tolerance: float,
    suite_file: Path | None,
    write: bool,
    as_json: bool,
    baseline: Path | None,
    out: TextIO | None = None,
    longest_context: bool = False,
) -> int:
    """The `tune` command; returns its exit code (3 when the baseline file cannot be written).
    `longest_context`: tune at the largest ctx_size that fits (with_longest_context), and write it too."""
    out = out or sys.stdout
    _check_options(validated, reps, tokens, tolerance)
    ctx_size = None
    if longest_context:
        validated = with_longest_context(validated)
        ctx_size = validated.plan.spec.server.ctx_size
        print(f"tune: server.ctx_size {ctx_size}, the largest that fits", file=sys.stderr if as_json else out)
    suite = load_suite(suite_file)
    weights = parse_workloads(workloads, validated.plan.spec.tuning.workloads, suite.names)
    cache_types = parse_cache_types(draft_cache_types)
    grid = parse_grid(grids)
    params = Params(default_params(grid, parse_layers(draft_gpu_layers), cache_types), ngram_params(grid))
    candidates = candidate_types(validated, types)
    # How many servers the search starts is known only at its end: the count and the time left are per server.
    progress = Progress(name="tune", scope="on this server")
    server_measure = ServerMeasure(validated, list(weights), reps, tokens, suite_file, progress)
    result = tune(_start(validated, params), weights, params, server_measure, tolerance, candidates)
    measured_at = now()
    kept = result.choice if write else result.start
    canary = server_measure.canary(kept) if baseline is not None else None
    canary_none = server_measure.canary(NO_SPECULATION) if baseline is not None and kept.speculates else canary
    progress.close()
    document = result.to_json()
    if not as_json:
        print(format_report(result, spec_path, suite.version, reps, tokens), file=out)
    if write:
        _write(spec_path, result, suite.version, measured_at, as_json, out, ctx_size)
        document["written"] = str(spec_path)
    elif not as_json:
        print("\nrun again with --write to put the choice and the profiles into the spec", file=out)
    code = 0
    if baseline is not None:
        details = {"suite": suite.version, "workloads": result.weights, "tokens": tokens, "reps": reps}
        if _write_baseline(baseline, result, kept, (canary, canary_none), details, as_json, out):
            document["baseline_file"] = str(baseline)
        else:
            code = 3
    if as_json:
        print(json.dumps(document, indent=2), file=out)
    return code


def _write(
    spec_path: Path,
    result: TuneResult,
    suite: str,
    measured_at: str,
    as_json: bool,
    out: TextIO,
    ctx_size: int | None = None,
) -> None:
    """The choice into the spec, after showing the diff; nothing is written if the result would not load."""
    old = spec_path.read_text()
    new = updated_spec(old, result, suite, measured_at, ctx_size)
    from appliance.spec.load import parse_spec

    parse_spec(new, spec_path)  # raises SpecInvalid (nothing written) if the result would not load
    diff = "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True), str(spec_path), f"{spec_path} (tuned)"
        )
    )
    print("\n" + (diff or f"{spec_path}: no change"), file=sys.stderr if as_json else out)
    if new != old:
        write_spec(spec_path, new)
    if not as_json:
        print(
            f"wrote {spec_path}: [speculative] {result.choice.label()}; [tuning] profiles for {', '.join(result.profiles)}"
            f"\nthe server uses it after `llm-appliance apply {spec_path}` and a restart of {paths.SERVER_UNIT}",
            file=out,
        )


def _write_baseline(
    path: Path,
    result: TuneResult,
    kept: Config,
    canaries: tuple[WorkloadResult | None, WorkloadResult | None],
    details: Mapping[str, Any],
    as_json: bool,
    out: TextIO,
) -> bool:
    """The rates of the configuration the server keeps as the health daemon's baseline, and those of no
    speculation (the canary's of both measured again); whether it was written."""
    from appliance.health.detectors import CANARY_BUCKET

    sides = {}
    for config, canary in zip((kept, NO_SPECULATION), canaries, strict=True):
        rates = {f"workload:{name}": rate for name, rate in result.table[config].items()}
        if canary is not None and canary.decode:
            rates[CANARY_BUCKET] = canary.decode.median
        sides[config] = rates
    profiles = {name: profile_values(result, name) for name in result.profiles}
    document = {"measured_by": "llm-appliance tune", "speculative": kept.to_json(), "profiles": profiles, **details}
    try:
        write_baseline(path, sides[kept], document, no_speculation=sides[NO_SPECULATION])
    except OSError as exc:
        print(f"tune: cannot write the baseline {path}: {exc}; run as root, or pass --baseline PATH", file=sys.stderr)
        return False
    if not as_json:
        print(f"baseline: {path} (measured under {kept.label()})", file=out)
    return True
