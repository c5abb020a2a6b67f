"""What bench and tune tell and write: the bench result (`BenchResult`) as a table and as JSON, the tune
report, the health daemon's baseline file, and `tune --write`'s rewrite of the spec (the choice in the
sections the configuration maps onto, a fresh [tuning]; every other line kept as written). Files are
written through the appliance's one writer.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from appliance.measure.config import Config, spec_values
from appliance.measure.cost import PerMillion, Usage, cost_lines, energy_lines
from appliance.measure.measure import CONTENDED_SHARE, Stats, WorkloadResult
from appliance.measure.search import TuneResult, harmonic_mix
from appliance.spec.model import Cost
from appliance.system import paths
from appliance.system.files import write_atomically


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# bench --------------------------------------------------------------------------------------------


@dataclass
class Side:
    """One server configuration's results."""

    label: str
    config: Config
    url: str | None  # the running appliance's; None for a server started by bench
    results: dict[str, WorkloadResult]


@dataclass
class BenchResult:
    spec: Path
    suite: str
    mode: Literal["standalone", "appliance"]
    reps: int
    tokens: int | None
    draft: Side
    baseline: Side
    canary: WorkloadResult | None
    measured_at: str
    chart: Path | None = None
    energy_sources: tuple[str, ...] = ()  # the meters read around every request
    energy_unreadable: dict[str, str] = field(default_factory=dict)  # source -> why it was not read
    cost: Cost | None = None  # the spec's [cost]

    @property
    def workloads(self) -> list[str]:
        return list(self.draft.results)

    def speedup(self, name: str) -> float | None:
        with_draft, without = self.draft.results[name].decode, self.baseline.results[name].decode
        return with_draft.median / without.median if with_draft and without and without.median else None

    def usages(self) -> dict[str, Usage]:
        """Energy, time and tokens of each side's requests, by the words the table uses."""
        return {
            "with the draft": Usage.of(self.draft.results.values()),
            "no draft": Usage.of(self.baseline.results.values()),
        }

    def decode_rates(self) -> dict[str, float]:
        """The with-draft decode rates as the health daemon's buckets: workload:<name> and the canary's."""
        rates = {f"workload:{n}": r.decode.median for n, r in self.draft.results.items() if r.decode}
        if self.canary is not None and self.canary.decode:
            from appliance.health.detectors import CANARY_BUCKET

            rates[CANARY_BUCKET] = self.canary.decode.median
        return rates

    def no_speculation_rates(self, canary: WorkloadResult | None = None) -> dict[str, float]:
        """The no-speculation side's decode rates as the health daemon's buckets (write_baseline's
        `no_speculation`): workload:<name>, each workload's context bucket (the median of the workloads in it:
        live traffic is judged by context, not by workload), and the canary's when one was measured without
        the draft."""
        from appliance.health.detectors import CANARY_BUCKET, context_bucket

        rates: dict[str, float] = {}
        by_context: dict[str, list[float]] = {}
        for name, r in self.baseline.results.items():
            if not r.decode:
                continue
            rates[f"workload:{name}"] = r.decode.median
            by_context.setdefault(context_bucket((r.prompt_tokens or 0) + r.max_tokens), []).append(r.decode.median)
        rates.update({bucket: statistics.median(values) for bucket, values in by_context.items()})
        if canary is not None and canary.decode:
            rates[CANARY_BUCKET] = canary.decode.median
        return rates

    def to_json(self) -> dict[str, Any]:
        rows = []
        for name in self.workloads:
            d, b = self.draft.results[name], self.baseline.results[name]
            speedup = self.speedup(name)
            rows.append(
                {
                    "name": name,
                    "title": d.title,
                    "max_tokens": d.max_tokens,
                    "draft": d.to_json(),
                    "no_draft": b.to_json(),
                    "speedup": round(speedup, 4) if speedup is not None else None,
                }
            )
        return {
            "spec": str(self.spec),
            "suite": self.suite,
            "mode": self.mode,
            "reps": self.reps,
            "tokens": self.tokens,
            "measured_at": self.measured_at,
            "configs": {
                "draft": {**self.draft.config.to_json(), "label": self.draft.label, "url": self.draft.url},
                "no_draft": {**self.baseline.config.to_json(), "label": self.baseline.label},
            },
            "workloads": rows,
            "canary": self.canary.to_json() if self.canary else None,
            "energy": self._energy_json(),
            "cost": self._cost_json(),
            "chart": str(self.chart) if self.chart else None,
            "ttft": "wall time from sending the streamed request to the first chunk with content, measured by the client",
        }

    def _energy_json(self) -> dict[str, Any]:
        draft, no_draft = self.usages().values()
        return {
            "sources": list(self.energy_sources),
            "not_measured": dict(self.energy_unreadable),
            "draft": draft.to_json(),
            "no_draft": no_draft.to_json(),
        }

    def _cost_json(self) -> dict[str, Any] | None:
        if self.cost is None:
            return None
        draft, no_draft = (PerMillion.of(self.cost, usage) for usage in self.usages().values())
        return {
            **self.cost.model_dump(mode="json"),
            "per_million_tokens": {"draft": draft.to_json(self.cost), "no_draft": no_draft.to_json(self.cost)},
        }


def _rate(stats: Stats | None, contended: int = 0) -> str:
    if stats is None:
        return "-"
    return f"{stats.median:.1f} ±{100 * stats.spread:.0f}%{'*' if contended else ''}"


def _ms(stats: Stats | None) -> str:
    return f"{stats.median:.0f}" if stats else "-"


def format_table(result: BenchResult) -> str:
    head = (
        f"{result.spec}: {result.suite}, {result.reps} rep{'s' if result.reps != 1 else ''} per workload, "
        f"median ± half-range; with draft: {result.draft.label}"
        + (f" (the appliance at {result.draft.url})" if result.draft.url else "")
    )
    columns = (
        f"{'workload':<10} {'tokens':>6} {'prompt':>6}  {'decode tok/s draft':>18} {'no draft':>14} {'speedup':>7}"
        f"  {'TTFT ms':>15}  {'prompt tok/s':>12}  {'accept':>6} {'mean len':>8}"
    )
    lines = [head, "", columns, "-" * len(columns)]
    contended = 0
    for name in result.workloads:
        d, b = result.draft.results[name], result.baseline.results[name]
        contended += d.contended + b.contended
        speedup = result.speedup(name)
        prompt_n = d.samples[0].prompt_n if d.samples else 0
        acceptance, mean_len = d.acceptance, d.mean_accepted_length
        lines.append(
            f"{name:<10} {d.samples[0].predicted_n if d.samples else 0:>6} {prompt_n:>6}  "
            f"{_rate(d.decode, d.contended):>18} {_rate(b.decode, b.contended):>14} "
            f"{f'{speedup:.2f}x' if speedup else '-':>7}  "
            f"{_ms(d.ttft) + ' / ' + _ms(b.ttft):>15}  "
            f"{(f'{d.prompt.median:.0f}' if d.prompt else '-') + ' / ' + (f'{b.prompt.median:.0f}' if b.prompt else '-'):>12}  "
            f"{f'{acceptance:.2f}' if acceptance is not None else '-':>6} {f'{mean_len:.2f}' if mean_len else '-':>8}"
        )
    if result.canary is not None and result.canary.decode:
        lines.append(f"{'canary':<10} {result.canary.max_tokens:>6} {'':>6}  {_rate(result.canary.decode):>18}")
    lines += [
        "",
        "decode and prompt tok/s: the server's own timings; TTFT (draft / none): wall time to the first streamed",
        "content chunk; accept: accepted / drafted tokens; mean len: 1 + accepted / drafts (tokens per target pass).",
    ]
    if contended:
        lines.append(
            f"* {contended} sample(s) ran while other processes took more than {CONTENDED_SHARE:.0%} of the CPUs"
        )
    usages = result.usages()
    lines += ["", *energy_lines(result.energy_sources, result.energy_unreadable, usages)]
    if result.cost is not None:
        lines += cost_lines(result.cost, usages)
    return "\n".join(lines)


def chart_rows(result: BenchResult) -> list[tuple[str, float | None, float | None]]:
    rows = []
    for name in result.workloads:
        d, b = result.draft.results[name].decode, result.baseline.results[name].decode
        rows.append((name, d.median if d else None, b.median if b else None))
    return rows


def write_baseline(
    path: Path,
    rates: Mapping[str, float],
    details: Mapping[str, Any],
    no_speculation: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The health daemon's baseline file: decode tok/s per bucket, the same buckets without speculation, and
    the versions they were measured under."""
    from appliance.facts.gpu import Pynvml
    from appliance.health.versions import Baseline, detect

    found = detect(Pynvml(), paths.ENGINE_DIR)
    baseline = Baseline(
        {k: round(v, 3) for k, v in rates.items()},
        found.comparable(),
        now(),
        {k: round(v, 3) for k, v in (no_speculation or {}).items()},
    )
    document = {**json.loads(baseline.to_json()), **details}
    write_atomically(path, json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    return document


# tune ---------------------------------------------------------------------------------------------


def _pct(value: float) -> str:
    return f"{100 * value:+.1f}%"


def format_report(result: TuneResult, spec_path: Path, suite: str, reps: int, tokens: int | None) -> str:
    """Every configuration measured, each workload's own best against the shared choice, and the choice."""
    weights = ", ".join(f"{n}={w:g}" for n, w in result.weights.items())
    grids = "; ".join(
        f"{p.name} {', '.join(f'{v:g}' if isinstance(v, float) else str(v) for v in p.grid)}" for p in result.params
    )
    lines = [
        f"{spec_path}: {suite}, median of {reps} rep{'s' if reps != 1 else ''}"
        + (f" x up to {tokens} tokens" if tokens else "")
        + f"; mix {weights} (weighted harmonic mean of decode tok/s)",
        f"grids: {grids}",
        f"{result.measurements} configurations measured (one server start each); an exhaustive sweep of these grids: {result.grid_size}",
        "",
        *_measured_lines(result),
        "",
        *_profile_lines(result),
        "",
        *_choice_lines(result),
    ]
    return "\n".join(lines)


def _measured_lines(result: TuneResult) -> list[str]:
    names, mix = list(result.weights), harmonic_mix(result.weights)
    lines = [f"{'configuration':<48}" + "".join(f"{n:>11}" for n in names) + f"{'mix':>11}"]
    for config, rates in result.table.items():
        marks = " (spec)" if config == result.start else ""
        marks += " (choice)" if config == result.choice else ""
        lines.append(
            f"{config.label() + marks:<48}"
            + "".join(f"{rates.get(n, 0.0):>11.1f}" for n in names)
            + f"{mix(rates):>11.1f}"
        )
    if result.no_draft:
        lines.append(
            f"{'no draft':<48}"
            + "".join(f"{result.no_draft.get(n, 0.0):>11.1f}" for n in names)
            + f"{mix(result.no_draft):>11.1f}"
        )
    return lines


def _profile_lines(result: TuneResult) -> list[str]:
    lines = [
        f"{'workload':<10} {'spec now':>9}  {'its own best':<34} {'tok/s':>7} {'gain':>7}  {'shared':>7} {'loss by sharing':>15}"
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
    return lines


def _choice_lines(result: TuneResult) -> list[str]:
    choice_mix, start_mix = result.mix(result.choice), result.mix(result.start)
    no_draft = harmonic_mix(result.weights)(result.no_draft) if result.no_draft else 0.0
    return [
        "llama-server applies one set of speculative values to all requests (its per-request fields are compiled out),",
        f"so the mix gets: {result.choice.label()} -> {choice_mix:.1f} tok/s, "
        + (f"{_pct(choice_mix / start_mix - 1)} over the spec's current values" if start_mix else "")
        + (f"; no draft: {no_draft:.1f} tok/s ({choice_mix / no_draft:.2f}x with the draft)" if no_draft else ""),
    ]


def profile_values(result: TuneResult, name: str) -> dict[str, Any]:
    """A workload's own best as a [tuning.profiles] entry: its values and its decode tok/s there."""
    config = result.profiles[name]
    values = {key: value for key, value in config.to_json().items() if key != "draft"}
    values["p_min"] = float(config.p_min)
    values["decode_tps"] = round(result.rate(config, name), 2)
    return values


def updated_spec(text: str, result: TuneResult, suite: str, measured_at: str, ctx_size: int | None = None) -> str:
    """The spec with the choice in the sections it maps onto ([speculative], [models.draft]), server.ctx_size
    when tuned (`tune --ctx max`), and a fresh [tuning] section; every other line, comment and blank kept."""
    import tomlkit

    document = tomlkit.parse(text)
    if ctx_size is not None:
        _table(document, "server")["ctx_size"] = ctx_size
    for section, values in spec_values(result.choice).items():
        table = _table(document, section)
        for key, value in values.items():
            table[key] = value
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


def _table(document: Any, section: str) -> Any:
    """The table of a dotted section ("models.draft"), added where the spec has none."""
    import tomlkit

    table = document
    for key in section.split("."):
        if key not in table:
            table.add(key, tomlkit.table())
        table = table[key]
    return table


def write_spec(path: Path, text: str) -> None:
    """The tuned spec in place of the old one, with the old one's permissions."""
    write_atomically(path, text, mode=path.stat().st_mode & 0o7777)
