"""The search of `tune`, pure: no server, no file, no clock. A `Measure` (a configuration -> decode tok/s per
workload) is handed in, so the search runs as well on a made-up landscape or a recorded sweep as on the
real server.

First the type: each candidate (none, the draft, ngram-mod, ngram-simple, the draft with ngram-mod) is
measured at its current values. Then that type's own parameters, by coordinate descent: for each (the
draft's n_max, n_min, p_min, gpu layers and cache type; an n-gram type's sizes), start at the current value,
walk the grid upwards while it is not slower, downwards only when upwards did not help, stop a direction at
the first slower value. Every configuration is measured once (all workloads at each start) and remembered,
and the best measured configuration wins, "none" included: where nothing pays, the answer is none. The
descent runs for the workload mix (the weighted harmonic mean of the rates) and for each workload alone,
each from its own best type, sharing what was measured. A configuration is a candidate only when the
spec would accept it (`config.valid`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from appliance.measure.config import NO_SPECULATION, BenchError, Config, valid
from appliance.spec.base import CACHE_BLOCKS

Value = int | float | str
# The draft's values by name; an n-gram type's as "ngram-mod.n_match".
ParamName = str
Rates = Mapping[str, float]  # workload -> decode tok/s (median)
Measure = Callable[[Config], Rates]
Objective = Callable[[Rates], float]

N_MAX_GRID: tuple[Value, ...] = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
N_MIN_GRID: tuple[Value, ...] = (0, 1, 2, 3, 4, 6, 8)
P_MIN_GRID: tuple[Value, ...] = (0.0, 0.2, 0.4, 0.6, 0.8)
# Largest to smallest, so a walk along the grid goes one way in size.
CACHE_ORDER = tuple(CACHE_BLOCKS)
# Around llama-server's defaults (ngram-mod 24/48/64, the others 12/48/1), shorter matches included: a
# small model's answers repeat short spans of the request.
NGRAM_GRIDS: dict[str, dict[str, tuple[Value, ...]]] = {
    "ngram-mod": {"n_match": (8, 12, 16, 24, 32), "n_min": (4, 8, 16, 32, 48), "n_max": (16, 32, 48, 64)},
    **{
        kind: {"size_n": (2, 3, 4, 6, 8, 12), "size_m": (8, 16, 32, 48), "min_hits": (1, 2, 3)}
        for kind in ("ngram-simple", "ngram-map-k", "ngram-map-k4v")
    },
}
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

    @property
    def ngram(self) -> bool:
        return "." in self.name

    def value(self, config: Config) -> Value:
        if self.ngram:
            return config.ngram_value(self.name)
        value: Value | None = getattr(config, self.name)
        if value is None:
            raise BenchError(f"the start configuration has no {self.name}")
        return value

    def apply(self, config: Config, value: Value) -> Config:
        if self.ngram:
            return config.with_ngram(self.name, int(value))
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
        """The axis without values that make a configuration the spec refuses (n_min above n_max)."""
        return [v for v in self.axis(config) if valid(self.apply(config, v))]


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


def ngram_params(grids: Mapping[str, Sequence[Value]] | None = None) -> dict[str, list[Param]]:
    """Each n-gram type's parameters with their grids ("ngram-mod.n_match" in `grids` replaces one)."""
    grids = grids or {}
    return {
        kind: [Param(f"{kind}.{name}", tuple(grids.get(f"{kind}.{name}", grid))) for name, grid in own.items()]
        for kind, own in NGRAM_GRIDS.items()
    }


@dataclass(frozen=True)
class Params:
    """Which parameters the descent walks for a configuration: the draft's when it drafts, and each n-gram
    type's that it runs."""

    draft: list[Param]
    ngram: dict[str, list[Param]]

    def of(self, config: Config) -> list[Param]:
        found = list(self.draft) if config.draft else []
        for kind in config.types:
            found += self.ngram.get(kind, [])
        return found

    def all(self) -> list[Param]:
        return [*self.draft, *(p for params in self.ngram.values() for p in params)]


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
    candidates: list[Config] = field(default_factory=list)  # the type phase: each type at its current values

    @property
    def measurements(self) -> int:
        return len(self.table)

    @property
    def no_speculation(self) -> Rates | None:
        return self.table.get(NO_SPECULATION)

    def rate(self, config: Config, workload: str) -> float:
        return self.table[config].get(workload, 0.0)

    def mix(self, config: Config) -> float:
        return harmonic_mix(self.weights)(self.table[config])

    def speedup(self, config: Config, workload: str | None = None) -> float | None:
        """A configuration's rate over no speculation's, for a workload or (None) the mix."""
        none = self.no_speculation
        if none is None:
            return None
        base = harmonic_mix(self.weights)(none) if workload is None else none.get(workload, 0.0)
        now = self.mix(config) if workload is None else self.rate(config, workload)
        return now / base if base else None

    def to_json(self) -> dict[str, Any]:
        mix = harmonic_mix(self.weights)

        def gain(config: Config, workload: str | None = None) -> float | None:
            speedup = self.speedup(config, workload)
            return round(speedup, 4) if speedup is not None else None

        return {
            "weights": self.weights,
            "objective": "weighted harmonic mean of decode tok/s (total tokens / total time)",
            "types": [c.type_label() for c in self.candidates],
            "grids": {p.name: list(p.grid) for p in self.params},
            "measurements": self.measurements,
            "exhaustive_size": self.grid_size,
            "start": {**self.start.to_json(), "mix_tps": round(mix(self.table[self.start]), 3)},
            "choice": {
                **self.choice.to_json(),
                "mix_tps": round(self.mix(self.choice), 3),
                "gain": round(self.mix(self.choice) / self.mix(self.start) - 1, 4) if self.mix(self.start) else None,
                "speedup": gain(self.choice),
            },
            "profiles": {
                name: {
                    **config.to_json(),
                    "decode_tps": round(self.rate(config, name), 3),
                    "speedup": gain(config, name),
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
            "no_speculation": {k: round(v, 3) for k, v in self.no_speculation.items()} if self.no_speculation else None,
        }


def tune(
    start: Config,
    weights: Mapping[str, float],
    params: Params | Sequence[Param],
    measure: Measure,
    tolerance: float = TOLERANCE,
    types: Sequence[tuple[str, ...]] = (),
) -> TuneResult:
    """The type phase (the start's types, `types`, and none, each at the start's values), then the descent
    of the best type's parameters for the mix and for each workload, sharing one memo; the best measured configuration for the mix is the choice, each workload's best measured one its
    profile. Without `types`, only the start's own type is searched (and none measured beside it)."""
    walk = params if isinstance(params, Params) else Params(list(params), {})
    memo = Memo(measure)
    candidates = [start.with_types(t) for t in dict.fromkeys([start.types, *types, ()])]
    for candidate in candidates:
        memo(candidate)
    objectives = {"mix": harmonic_mix(weights), **{name: single(name) for name in weights}}
    searches: dict[str, Search] = {}
    for name, objective in objectives.items():
        base, _ = best_of({c: memo.table[c] for c in candidates}, objective)
        searches[name] = descend(objective, base, walk.of(base), memo, tolerance)
    choice, _ = best_of(memo.table, harmonic_mix(weights))
    profiles = {name: best_of(memo.table, single(name))[0] for name in weights}
    grid_size = sum(len(grid_configs(c, walk.of(c))) for c in candidates)
    return TuneResult(start, dict(weights), walk.all(), memo.table, searches, choice, profiles, grid_size, candidates)
