"""`llm-appliance tune`: one speculative parameter at a time, measured with bench, the best kept.

llama-server applies one set of speculative values to every request (its per-request fields sit under
`#if 0`), so each configuration is a server start, and the values written are the best for the workload
mix the user names; each workload's own best is kept as a profile, with what it loses by sharing.

The search is coordinate descent: for n_max, then n_min, then p_min (then the draft's gpu layers and cache
type when asked), start at the current value, walk the grid upwards while it is not slower, downwards only
when upwards did not help, stop a direction at the first slower value; every configuration is measured
once (all workloads at each start) and remembered, and the best measured configuration wins.
"""

from __future__ import annotations

import difflib
import itertools
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TextIO

from appliance.measure.bench import (
    CANARY,
    NO_DRAFT,
    BenchError,
    BenchUsage,
    Config,
    Prepared,
    Progress,
    TempServer,
    WorkloadResult,
    canary_workload,
    load_suite,
    measure,
    now,
    write_baseline,
)
from appliance.plan.validate import Validated
from appliance.spec.model import CACHE_BYTES
from appliance.system import paths

Value = int | float | str
ParamName = Literal["n_max", "n_min", "p_min", "draft_gpu_layers", "draft_cache_type"]
Rates = Mapping[str, float]  # workload -> decode tok/s (median)
Measure = Callable[[Config], Rates]
Objective = Callable[[Rates], float]

N_MAX_GRID: tuple[Value, ...] = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
N_MIN_GRID: tuple[Value, ...] = (0, 1, 2, 3, 4, 6, 8)
P_MIN_GRID: tuple[Value, ...] = (0.0, 0.2, 0.4, 0.6, 0.8)
# Largest to smallest, so a walk along the grid goes one way in size.
CACHE_ORDER = tuple(CACHE_BYTES)
TOLERANCE = 0.02  # a value within 2% of the best is not "slower": the walk goes on across a plateau


def _order(name: ParamName, value: Value) -> tuple[int, float]:
    if name == "draft_cache_type":
        return (0, float(CACHE_ORDER.index(str(value)))) if value in CACHE_ORDER else (1, 0.0)
    if isinstance(value, str):  # gpu layers: numbers, then all, then auto
        return (1, 0.0) if value == "all" else (2, 0.0)
    return (0, float(value))


@dataclass(frozen=True)
class Param:
    name: ParamName
    grid: tuple[Value, ...]

    def value(self, config: Config) -> Value:
        value: Value | None = getattr(config, self.name)
        if value is None:
            raise BenchError(f"the start configuration has no {self.name}")
        return value

    def apply(self, config: Config, value: Value) -> Config:
        if self.name == "n_max":
            return replace(config, n_max=int(value))
        if self.name == "n_min":
            return replace(config, n_min=int(value))
        if self.name == "p_min":
            return replace(config, p_min=float(value))
        if self.name == "draft_gpu_layers":
            return replace(config, draft_gpu_layers=value if isinstance(value, str) else int(value))
        return replace(config, draft_cache_type=str(value))

    def axis(self, config: Config) -> list[Value]:
        """The grid with the configuration's value, in order."""
        return sorted(dict.fromkeys([*self.grid, self.value(config)]), key=lambda v: _order(self.name, v))

    def candidates(self, config: Config) -> list[Value]:
        """The axis without values that make no valid configuration (n_min above n_max)."""
        return [v for v in self.axis(config) if valid(self.apply(config, v))]


def valid(config: Config) -> bool:
    return config.n_min <= config.n_max


def default_params(
    grids: Mapping[str, Sequence[Value]] | None = None,
    draft_gpu_layers: Sequence[Value] = (),
    draft_cache_types: Sequence[str] = (),
) -> list[Param]:
    grids = grids or {}
    params = [
        Param("n_max", tuple(grids.get("n_max", N_MAX_GRID))),
        Param("n_min", tuple(grids.get("n_min", N_MIN_GRID))),
        Param("p_min", tuple(float(v) for v in grids.get("p_min", P_MIN_GRID))),
    ]
    if draft_gpu_layers:
        params.append(Param("draft_gpu_layers", tuple(draft_gpu_layers)))
    if draft_cache_types:
        params.append(Param("draft_cache_type", tuple(draft_cache_types)))
    return params


class Memo:
    """Each configuration measured once; `count` is the number of measurements (server starts) made."""

    def __init__(self, measure: Measure) -> None:
        self.measure = measure
        self.table: dict[Config, Rates] = {}

    def __call__(self, config: Config) -> Rates:
        if config not in self.table:
            self.table[config] = dict(self.measure(config))
        return self.table[config]

    @property
    def count(self) -> int:
        return len(self.table)


def harmonic_mix(weights: Mapping[str, float]) -> Objective:
    """Tokens per second over a mix in which workload w produces weight_w of the tokens: the weighted harmonic
    mean (total tokens / total time), so a slow workload weighs as much time as it takes."""
    total = sum(weights.values())

    def value(rates: Rates) -> float:
        if any(rates.get(name, 0.0) <= 0 for name in weights):
            return 0.0
        return total / sum(weight / rates[name] for name, weight in weights.items())

    return value


def single(name: str) -> Objective:
    return lambda rates: rates.get(name, 0.0)


@dataclass(frozen=True)
class Step:
    param: str
    config: Config
    score: float
    verdict: Literal["start", "better", "not slower", "slower"]


@dataclass
class Search:
    best: Config
    score: float
    steps: list[Step] = field(default_factory=list)


def descend(objective: Objective, start: Config, params: Sequence[Param], memo: Memo, tolerance: float) -> Search:
    """Coordinate descent, one parameter at a time, from `start`."""
    score = objective(memo(start))
    search = Search(start, score, [Step("", start, score, "start")])
    for param in params:
        base = search.best
        values = param.candidates(base)
        here = values.index(param.value(base))
        moved_up = False
        for direction in (1, -1):
            if direction == -1 and moved_up:
                break  # it got faster upwards: the other side of the start is not where the top is
            index = here + direction
            while 0 <= index < len(values):
                candidate = param.apply(base, values[index])
                score = objective(memo(candidate))
                if score > search.score:
                    search.best, search.score = candidate, score
                    moved_up = moved_up or direction == 1
                    verdict: Literal["better", "not slower", "slower"] = "better"
                elif score >= search.score * (1 - tolerance):
                    verdict = "not slower"
                else:
                    verdict = "slower"
                search.steps.append(Step(param.name, candidate, score, verdict))
                if verdict == "slower":
                    break
                index += direction
    return search


def grid_configs(start: Config, params: Sequence[Param]) -> list[Config]:
    """Every configuration of the grids (the start's values included): what an exhaustive sweep measures."""
    configs = []
    for combination in itertools.product(*(param.axis(start) for param in params)):
        config = start
        for param, value in zip(params, combination, strict=True):
            config = param.apply(config, value)
        if valid(config):
            configs.append(config)
    return configs


def exhaustive(start: Config, params: Sequence[Param], measure: Measure) -> dict[Config, Rates]:
    return {config: dict(measure(config)) for config in grid_configs(start, params)}


def best_of(table: Mapping[Config, Rates], objective: Objective) -> tuple[Config, float]:
    config = max(table, key=lambda c: objective(table[c]))
    return config, objective(table[config])


@dataclass
class TuneResult:
    start: Config
    weights: dict[str, float]
    params: list[Param]
    table: dict[Config, Rates]  # every configuration measured, in order
    searches: dict[str, Search]  # "mix" and each workload
    choice: Config
    profiles: dict[str, Config]
    grid_size: int
    no_draft: Rates | None = None

    @property
    def measurements(self) -> int:
        return len(self.table)

    def rate(self, config: Config, workload: str) -> float:
        return self.table[config].get(workload, 0.0)

    def mix(self, config: Config) -> float:
        return harmonic_mix(self.weights)(self.table[config])

    def to_json(self) -> dict[str, Any]:
        mix = harmonic_mix(self.weights)
        return {
            "weights": self.weights,
            "objective": "weighted harmonic mean of decode tok/s (total tokens / total time)",
            "grids": {p.name: list(p.grid) for p in self.params},
            "measurements": self.measurements,
            "exhaustive_size": self.grid_size,
            "start": {**self.start.to_json(), "mix_tps": round(mix(self.table[self.start]), 3)},
            "choice": {
                **self.choice.to_json(),
                "mix_tps": round(self.mix(self.choice), 3),
                "gain": round(self.mix(self.choice) / self.mix(self.start) - 1, 4) if self.mix(self.start) else None,
            },
            "profiles": {
                name: {
                    **config.to_json(),
                    "decode_tps": round(self.rate(config, name), 3),
                    "spec_tps": round(self.rate(self.start, name), 3),
                    "shared_tps": round(self.rate(self.choice, name), 3),
                }
                for name, config in self.profiles.items()
            },
            "measured": [
                {
                    **config.to_json(),
                    "decode_tps": {k: round(v, 3) for k, v in rates.items()},
                    "mix_tps": round(mix(rates), 3),
                }
                for config, rates in self.table.items()
            ],
            "no_draft": {k: round(v, 3) for k, v in self.no_draft.items()} if self.no_draft else None,
        }


def tune(
    start: Config,
    weights: Mapping[str, float],
    params: Sequence[Param],
    measure: Measure,
    tolerance: float = TOLERANCE,
    no_draft: Rates | None = None,
) -> TuneResult:
    """The search for the mix, then for each workload, sharing one memo; the best measured configuration
    for the mix is the choice, each workload's best measured one its profile."""
    memo = Memo(measure)
    searches = {"mix": descend(harmonic_mix(weights), start, params, memo, tolerance)}
    for name in weights:
        searches[name] = descend(single(name), start, params, memo, tolerance)
    choice, _ = best_of(memo.table, harmonic_mix(weights))
    profiles = {name: best_of(memo.table, single(name))[0] for name in weights}
    return TuneResult(
        start,
        dict(weights),
        list(params),
        memo.table,
        searches,
        choice,
        profiles,
        len(grid_configs(start, params)),
        no_draft,
    )


# The real measurement -----------------------------------------------------------------------------


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
        self.prepared = Prepared(list(self.suite.workloads), tokens, spec.server.slot_ctx)
        self.results: dict[Config, dict[str, WorkloadResult]] = {}
        self.starts = 0

    def __call__(self, config: Config) -> Rates:
        self.starts += 1
        self.progress.phase(f"server {self.starts}: {config.label()}")
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
        self.progress.phase(f"server {self.starts}: the health canary with {config.label()}")
        prepared = Prepared([canary_workload()], None, self.prepared.slot_ctx)
        with TempServer(self.validated, config) as server:
            return measure(server.api, prepared.get(server.api), self.reps, server.pid, self.progress)[CANARY]


# Report and --write -------------------------------------------------------------------------------


def _pct(value: float) -> str:
    return f"{100 * value:+.1f}%"


def format_report(result: TuneResult, spec_path: Path, suite: str, reps: int, tokens: int | None) -> str:
    names = list(result.weights)
    weights = ", ".join(f"{n}={w:g}" for n, w in result.weights.items())
    lines = [
        f"{spec_path}: {suite}, median of {reps} rep{'s' if reps != 1 else ''}"
        + (f" x up to {tokens} tokens" if tokens else "")
        + f"; mix {weights} (weighted harmonic mean of decode tok/s)",
        "grids: "
        + "; ".join(
            f"{p.name} {', '.join(f'{v:g}' if isinstance(v, float) else str(v) for v in p.grid)}" for p in result.params
        ),
        f"{result.measurements} configurations measured (one server start each); an exhaustive sweep of these grids: {result.grid_size}",
        "",
        f"{'configuration':<48}" + "".join(f"{n:>11}" for n in names) + f"{'mix':>11}",
    ]
    for config, rates in result.table.items():
        marks = " (spec)" if config == result.start else ""
        marks += " (choice)" if config == result.choice else ""
        lines.append(
            f"{config.label() + marks:<48}"
            + "".join(f"{rates.get(n, 0.0):>11.1f}" for n in names)
            + f"{harmonic_mix(result.weights)(rates):>11.1f}"
        )
    if result.no_draft:
        lines.append(
            f"{'no draft':<48}"
            + "".join(f"{result.no_draft.get(n, 0.0):>11.1f}" for n in names)
            + f"{harmonic_mix(result.weights)(result.no_draft):>11.1f}"
        )
    lines += [
        "",
        f"{'workload':<10} {'spec now':>9}  {'its own best':<34} {'tok/s':>7} {'gain':>7}  {'shared':>7} {'loss by sharing':>15}",
    ]
    for name, config in result.profiles.items():
        own, spec_now, shared = (
            result.rate(config, name),
            result.rate(result.start, name),
            result.rate(result.choice, name),
        )
        lines.append(
            f"{name:<10} {spec_now:>9.1f}  {config.label():<34} {own:>7.1f} {_pct(own / spec_now - 1) if spec_now else '-':>7}"
            f"  {shared:>7.1f} {_pct(shared / own - 1) if own else '-':>15}"
        )
    choice_mix, start_mix = result.mix(result.choice), result.mix(result.start)
    lines += [
        "",
        "llama-server applies one set of speculative values to all requests (its per-request fields are compiled out),",
        f"so the mix gets: {result.choice.label()} -> {choice_mix:.1f} tok/s, "
        + (f"{_pct(choice_mix / start_mix - 1)} over the spec's current values" if start_mix else "")
        + (
            f"; no draft: {harmonic_mix(result.weights)(result.no_draft):.1f} tok/s "
            f"({choice_mix / harmonic_mix(result.weights)(result.no_draft):.2f}x with the draft)"
            if result.no_draft and harmonic_mix(result.weights)(result.no_draft)
            else ""
        ),
    ]
    return "\n".join(lines)


def profile_values(result: TuneResult, name: str) -> dict[str, Any]:
    config = result.profiles[name]
    values: dict[str, Any] = {"n_max": config.n_max, "n_min": config.n_min, "p_min": float(config.p_min)}
    if config.draft_gpu_layers is not None:
        values["draft_gpu_layers"] = config.draft_gpu_layers
    if config.draft_cache_type is not None:
        values["draft_cache_type"] = config.draft_cache_type
    values["decode_tps"] = round(result.rate(config, name), 2)
    return values


def updated_spec(text: str, result: TuneResult, suite: str, measured_at: str) -> str:
    """The spec with the choice in [speculative] (and [models.draft]) and a fresh [tuning] section; every other
    line, comment and blank kept as written."""
    import tomlkit

    document = tomlkit.parse(text)
    choice = result.choice
    if "speculative" not in document:
        document.add("speculative", tomlkit.table())
    speculative: Any = document["speculative"]
    speculative["n_max"] = choice.n_max
    speculative["n_min"] = choice.n_min
    speculative["p_min"] = float(choice.p_min)
    if choice.draft_gpu_layers is not None or choice.draft_cache_type is not None:
        models: Any = document["models"]
        draft: Any = models["draft"]
        if choice.draft_gpu_layers is not None:
            draft["gpu_layers"] = choice.draft_gpu_layers
        if choice.draft_cache_type is not None:
            draft["cache_type_k"] = draft["cache_type_v"] = choice.draft_cache_type
    tuning = tomlkit.table()
    tuning.add(tomlkit.comment("written by `llm-appliance tune --write`: [speculative] is the best measured for this"))
    tuning.add(
        tomlkit.comment("mix (workload = weight); each profile is one workload's own best, with its decode tok/s")
    )
    workloads = tomlkit.inline_table()
    workloads.update({name: float(weight) for name, weight in result.weights.items()})
    tuning["workloads"] = workloads
    tuning["suite"] = suite
    tuning["measured_at"] = measured_at
    profiles = tomlkit.table(is_super_table=True)
    for name in result.profiles:
        profile = tomlkit.table()
        profile.update(profile_values(result, name))
        profiles[name] = profile
    tuning["profiles"] = profiles
    if "tuning" in document:
        document["tuning"] = tuning
    else:
        document.add(tomlkit.nl())
        document.add("tuning", tuning)
    return str(tomlkit.dumps(document))


def write_spec(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tune")
    temporary.write_text(text)
    os.chmod(temporary, path.stat().st_mode & 0o7777)
    os.replace(temporary, path)


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


def parse_grid(items: Sequence[str]) -> dict[str, list[Value]]:
    """`--grid n_max=2,4,8 --grid p_min=0,0.5`."""
    grids: dict[str, list[Value]] = {}
    for item in items:
        name, _, values = item.partition("=")
        if name not in ("n_max", "n_min", "p_min") or not values:
            raise BenchUsage(f"--grid {item!r}: write n_max=2,4,8 (n_max, n_min or p_min)")
        try:
            parsed: list[Value] = [float(v) if name == "p_min" else int(v) for v in values.split(",")]
        except ValueError:
            raise BenchUsage(f"--grid {item!r}: the values must be numbers") from None
        limits = {"n_max": (1, 64), "n_min": (0, 64), "p_min": (0.0, 1.0)}[name]
        if any(not limits[0] <= float(v) <= limits[1] for v in parsed):
            raise BenchUsage(f"--grid {item!r}: {name} must lie in {limits[0]}..{limits[1]}")
        grids[name] = parsed
    return grids


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


def main_tune(
    spec_path: Path,
    validated: Validated,
    *,
    workloads: str | None,
    grids: Sequence[str],
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
) -> int:
    out = out or sys.stdout
    spec = validated.plan.spec
    if not validated.plan.speculation or spec.models.draft is None:
        raise BenchError("the spec has no draft model to tune; add [models.draft] (see `llm-appliance explain`)")
    if reps < 1 or (tokens is not None and tokens < 1):
        raise BenchUsage("--reps and --tokens must be at least 1")
    if not 0.0 <= tolerance < 0.5:
        raise BenchUsage("--tolerance is a share of the best rate: 0 to 0.5, e.g. 0.02")
    suite = load_suite(suite_file)
    weights = parse_workloads(workloads, spec.tuning.workloads, suite.names)
    cache_types = [c.strip() for c in (draft_cache_types or "").split(",") if c.strip()]
    bad = [c for c in cache_types if c not in CACHE_ORDER]
    if bad:
        raise BenchUsage(f"--draft-cache-type {', '.join(bad)}: use {', '.join(CACHE_ORDER)}")
    params = default_params(parse_grid(grids), parse_layers(draft_gpu_layers), cache_types)
    start = Config.of(spec)
    if any(p.name == "draft_gpu_layers" for p in params):
        start = replace(start, draft_gpu_layers=spec.models.draft.gpu_layers)
    if any(p.name == "draft_cache_type" for p in params):
        start = replace(start, draft_cache_type=spec.models.draft.cache_type_k)
    progress = Progress()
    server_measure = ServerMeasure(validated, list(weights), reps, tokens, suite_file, progress)
    no_draft = server_measure(NO_DRAFT)
    server_measure.results.pop(NO_DRAFT)
    result = tune(start, weights, params, server_measure, tolerance, no_draft)
    measured_at = now()
    kept = result.choice if write else result.start
    canary = server_measure.canary(kept) if baseline is not None else None
    progress.close()
    document = result.to_json()
    if not as_json:
        print(format_report(result, spec_path, suite.version, reps, tokens), file=out)
    code = 0
    if write:
        old = spec_path.read_text()
        new = updated_spec(old, result, suite.version, measured_at)
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
        document["written"] = str(spec_path)
        if not as_json:
            print(
                f"wrote {spec_path}: [speculative] {result.choice.label()}; [tuning] profiles for {', '.join(result.profiles)}"
                f"\nthe server uses it after `llm-appliance apply {spec_path}` and a restart of {paths.SERVER_UNIT}",
                file=out,
            )
    elif not as_json:
        print("\nrun again with --write to put the choice and the profiles into the spec", file=out)
    if baseline is not None:
        rates = {f"workload:{name}": rate for name, rate in result.table[kept].items()}
        if canary is not None and canary.decode:
            from appliance.health.detectors import CANARY_BUCKET

            rates[CANARY_BUCKET] = canary.decode.median
        details = {
            "measured_by": "llm-appliance tune",
            "suite": suite.version,
            "speculative": kept.to_json(),
            "profiles": {name: profile_values(result, name) for name in result.profiles},
            "workloads": result.weights,
            "tokens": tokens,
            "reps": reps,
        }
        try:
            write_baseline(baseline, rates, details)
            document["baseline_file"] = str(baseline)
            if not as_json:
                print(f"baseline: {baseline} (measured under {kept.label()})", file=out)
        except OSError as exc:
            print(
                f"tune: cannot write the baseline {baseline}: {exc}; run as root, or pass --baseline PATH",
                file=sys.stderr,
            )
            code = 3
    if as_json:
        print(json.dumps(document, indent=2), file=out)
    return code
