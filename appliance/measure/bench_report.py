"""What bench tells and writes: the bench result (`BenchResult`) as a table and as JSON, and the health daemon's
baseline file (written through the appliance's one writer). tune's report and spec rewrite: tune_report.py.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from appliance.measure.config import Config
from appliance.measure.cost import PerMillion, Usage, cost_lines, energy_lines, fallback_prices
from appliance.measure.measure import CONTENDED_SHARE, OutputMatch, Stats, WorkloadResult
from appliance.spec.fallback import Fallback
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
    speculative: Side
    no_speculation: Side
    canary: WorkloadResult | None
    measured_at: str
    canary_no_speculation: WorkloadResult | None = None
    chart: Path | None = None
    energy_sources: tuple[str, ...] = ()  # the meters read around every request
    energy_unreadable: dict[str, str] = field(default_factory=dict)  # source -> why it was not read
    cost: Cost | None = None  # the spec's [cost]
    fallback: Fallback | None = None  # the spec's [fallback]: what its upstream charges, beside the local cost

    @property
    def workloads(self) -> list[str]:
        return list(self.speculative.results)

    def speedup(self, name: str) -> float | None:
        speculative, without = self.speculative.results[name].decode, self.no_speculation.results[name].decode
        return speculative.median / without.median if speculative and without and without.median else None

    def outputs(self, name: str) -> OutputMatch:
        return OutputMatch.of(self.speculative.results[name], self.no_speculation.results[name])

    def usages(self) -> dict[str, Usage]:
        """Energy, time and tokens of each side's requests, by the words the table uses."""
        return {
            "with speculation": Usage.of(self.speculative.results.values()),
            "no speculation": Usage.of(self.no_speculation.results.values()),
        }

    def decode_rates(self) -> dict[str, float]:
        """The speculative decode rates as the health daemon's buckets: workload:<name> and the canary's."""
        return _bucket_rates(self.speculative.results, self.canary)

    def no_speculation_rates(self) -> dict[str, float]:
        """The rates without speculation in the same buckets, and in the context buckets the daemon sees live
        (each workload's prompt and answer; the median of the workloads in a bucket)."""
        from appliance.health.detectors import context_bucket

        rates = _bucket_rates(self.no_speculation.results, self.canary_no_speculation)
        by_context: dict[str, list[float]] = {}
        for result in self.no_speculation.results.values():
            if result.decode and result.samples:
                sample = result.samples[0]
                by_context.setdefault(context_bucket(sample.prompt_n + sample.predicted_n), []).append(
                    result.decode.median
                )
        rates.update({bucket: statistics.median(values) for bucket, values in by_context.items()})
        return rates

    def to_json(self) -> dict[str, Any]:
        rows = []
        for name in self.workloads:
            d, b = self.speculative.results[name], self.no_speculation.results[name]
            speedup = self.speedup(name)
            rows.append(
                {
                    "name": name,
                    "title": d.title,
                    "max_tokens": d.max_tokens,
                    "speculative": d.to_json(),
                    "no_speculation": b.to_json(),
                    "speedup": round(speedup, 4) if speedup is not None else None,
                    "outputs": self.outputs(name).to_json(),
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
                "speculative": {
                    **self.speculative.config.to_json(),
                    "label": self.speculative.label,
                    "url": self.speculative.url,
                },
                "no_speculation": {**self.no_speculation.config.to_json(), "label": self.no_speculation.label},
            },
            "workloads": rows,
            "canary": self.canary.to_json() if self.canary else None,
            "canary_no_speculation": self.canary_no_speculation.to_json() if self.canary_no_speculation else None,
            "energy": self._energy_json(),
            "cost": self._cost_json(),
            "chart": str(self.chart) if self.chart else None,
            "ttft": "wall time from sending the streamed request to the first chunk with content, measured by the client",
        }

    def _energy_json(self) -> dict[str, Any]:
        speculative, no_speculation = self.usages().values()
        return {
            "sources": list(self.energy_sources),
            "not_measured": dict(self.energy_unreadable),
            "speculative": speculative.to_json(),
            "no_speculation": no_speculation.to_json(),
        }

    def _cost_json(self) -> dict[str, Any] | None:
        if self.cost is None:
            return None
        speculative, no_speculation = (PerMillion.of(self.cost, usage) for usage in self.usages().values())
        return {
            **self.cost.model_dump(mode="json"),
            "per_million_tokens": {
                "speculative": speculative.to_json(self.cost),
                "no_speculation": no_speculation.to_json(self.cost),
                **({"fallback": fallback_prices(self.fallback)} if self.fallback else {}),
            },
        }


def _bucket_rates(results: Mapping[str, WorkloadResult], canary: WorkloadResult | None) -> dict[str, float]:
    rates = {f"workload:{n}": r.decode.median for n, r in results.items() if r.decode}
    if canary is not None and canary.decode:
        from appliance.health.detectors import CANARY_BUCKET

        rates[CANARY_BUCKET] = canary.decode.median
    return rates


def _rate(stats: Stats | None, contended: int = 0) -> str:
    if stats is None:
        return "-"
    return f"{stats.median:.1f} ±{100 * stats.spread:.0f}%{'*' if contended else ''}"


def _ms(stats: Stats | None) -> str:
    return f"{stats.median:.0f}" if stats else "-"


def _same(match: OutputMatch) -> str:
    return "yes" if match.identical else f"NO {match.matched}/{match.compared}"


def format_table(result: BenchResult) -> str:
    head = (
        f"{result.spec}: {result.suite}, {result.reps} rep{'s' if result.reps != 1 else ''} per workload, "
        f"median ± half-range; speculation: {result.speculative.label}"
        + (f" (the appliance at {result.speculative.url})" if result.speculative.url else "")
    )
    columns = (
        f"{'workload':<10} {'tokens':>6} {'prompt':>6}  {'decode tok/s spec':>18} {'none':>14} {'speedup':>7} {'same':>6}"
        f"  {'TTFT ms':>15}  {'prompt tok/s':>12}  {'accept':>6} {'mean len':>8}"
    )
    lines = [head, "", columns, "-" * len(columns)]
    contended = 0
    differing = []
    for name in result.workloads:
        d, b = result.speculative.results[name], result.no_speculation.results[name]
        contended += d.contended + b.contended
        speedup, match = result.speedup(name), result.outputs(name)
        if not match.identical and match.at is not None:
            differing.append(f"  {name}: from character {match.at}: {match.speculative!r} / {match.no_speculation!r}")
        prompt_n = d.samples[0].prompt_n if d.samples else 0
        acceptance, mean_len = d.acceptance, d.mean_accepted_length
        lines.append(
            f"{name:<10} {d.samples[0].predicted_n if d.samples else 0:>6} {prompt_n:>6}  "
            f"{_rate(d.decode, d.contended):>18} {_rate(b.decode, b.contended):>14} "
            f"{f'{speedup:.2f}x' if speedup else '-':>7} {_same(match):>6}  "
            f"{_ms(d.ttft) + ' / ' + _ms(b.ttft):>15}  "
            f"{(f'{d.prompt.median:.0f}' if d.prompt else '-') + ' / ' + (f'{b.prompt.median:.0f}' if b.prompt else '-'):>12}  "
            f"{f'{acceptance:.2f}' if acceptance is not None else '-':>6} {f'{mean_len:.2f}' if mean_len else '-':>8}"
        )
    if result.canary is not None and result.canary.decode:
        none = result.canary_no_speculation.decode if result.canary_no_speculation else None
        lines.append(
            f"{'canary':<10} {result.canary.max_tokens:>6} {'':>6}  {_rate(result.canary.decode):>18} {_rate(none):>14}"
        )
    lines += [
        "",
        "decode and prompt tok/s: the server's own timings; same: the answers with and without speculation are",
        "identical (greedy); TTFT (speculation / none): wall time to the first streamed content chunk; accept:",
        "accepted / drafted tokens; mean len: 1 + accepted / drafts (tokens per target pass).",
    ]
    if differing:
        lines += ["speculation changed the answer of:", *differing]
    if contended:
        lines.append(
            f"* {contended} sample(s) ran while other processes took more than {CONTENDED_SHARE:.0%} of the CPUs"
        )
    usages = result.usages()
    lines += ["", *energy_lines(result.energy_sources, result.energy_unreadable, usages)]
    if result.cost is not None:
        lines += cost_lines(result.cost, usages, result.fallback)
    return "\n".join(lines)


def chart_rows(result: BenchResult) -> list[tuple[str, float | None, float | None]]:
    rows = []
    for name in result.workloads:
        d, b = result.speculative.results[name].decode, result.no_speculation.results[name].decode
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
