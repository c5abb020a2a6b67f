"""`llm-appliance bench`: measure the speculative server against no speculation, on a fixed prompt suite.

Speculative settings are server-wide (the current llama-server compiles its per-request fields out), so
every configuration measured is its own llama-server process: the spec's plan rebuilt with other
speculative values (or none), on a free loopback port, started, measured, stopped. Without `--standalone`
the speculative numbers come from the running appliance and only the baseline gets a server of its own.
Both sides get the same prompts; since greedy speculation should not change an answer, each workload says
whether the two sides' answers were the same.

Every figure comes from the server's own `timings`, except time to first token: the wall time from
sending the (streamed) request to the first chunk with content, measured here. Mean accepted length is
1 + accepted / drafts, with drafts from the `llamacpp:spec_decode_num_drafts_total` delta.

This module glues the others together: the suite (suite.py), the servers (server.py), the measurement
(measure.py) and what is told and written (bench_report.py).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from appliance.facts.energy_meters import Energy, meters_for
from appliance.facts.gpu import Pynvml
from appliance.measure.bench_report import BenchResult, Side, chart_rows, format_table, now, write_baseline
from appliance.measure.config import NO_SPECULATION, BenchError, BenchUsage, Config
from appliance.measure.measure import WorkloadResult, measure
from appliance.measure.progress import Progress
from appliance.measure.server import LOAD_TIMEOUT, TempServer
from appliance.measure.suite import CANARY, Prepared, Suite, canary_workload, load_suite
from appliance.plan.resolved import Appliance, resolve
from appliance.plan.validate import Validated
from appliance.runtime.server_api import ServerApi, ServerUnreachable, read_api_key

Measured = tuple[dict[str, WorkloadResult], WorkloadResult | None]  # the workloads' results, the canary's


@dataclass
class _Run:
    """What every side of one bench run shares: the same prompts, repetitions and progress."""

    validated: Validated
    appliance: Appliance
    prepared: Prepared
    canary: Prepared | None
    reps: int
    progress: Progress
    load_timeout: float
    energy: Energy

    def side(self, api: ServerApi, pid: int | None, config: Config) -> Measured:
        n_max = config.n_max if config.draft else None
        results = measure(api, self.prepared.get(api), self.reps, pid, self.progress, n_max=n_max, energy=self.energy)
        if self.canary is None:
            return results, None
        return results, measure(api, self.canary.get(api), self.reps, pid, self.progress, n_max=n_max)[CANARY]

    def standalone(self, config: Config) -> Measured:
        self.progress.phase(f"starting llama-server with {config.label()}")
        with TempServer(self.validated, config, self.load_timeout) as server:
            self.progress.phase(config.label())
            return self.side(server.api, server.pid, config)

    def running(self, config: Config) -> tuple[str, Measured]:
        url, api = appliance_api(self.appliance)
        self.progress.phase(f"the running appliance at {url} ({config.label()})")
        return url, self.side(api, None, config)

    def baseline(self) -> Measured:
        self.progress.phase("starting llama-server without speculation (baseline)")
        with TempServer(self.validated, NO_SPECULATION, self.load_timeout) as server:
            self.progress.phase("no speculation (baseline)")
            return self.side(server.api, server.pid, NO_SPECULATION)


def appliance_api(appliance: Appliance) -> tuple[str, ServerApi]:
    """The running appliance's server, ready to answer; BenchError when it is not."""
    url = appliance.server.url
    api = ServerApi(url, read_api_key(appliance.api_key_file), timeout=5.0)
    try:
        status = api.health()
    except ServerUnreachable as exc:
        raise BenchError(f"the appliance does not answer at {url} ({exc}); start it, or use --standalone") from None
    if status != 200:
        raise BenchError(f"the appliance at {url} is not ready (/health answered {status}); wait, or use --standalone")
    return url, api


def run_bench(
    validated: Validated,
    spec_path: Path,
    *,
    standalone: bool,
    reps: int = 3,
    tokens: int | None = None,
    suite: Suite | None = None,
    progress: Progress | None = None,
    with_canary: bool = True,
    load_timeout: float = LOAD_TIMEOUT,
    energy: Energy | None = None,
) -> BenchResult:
    spec = validated.plan.spec
    suite = suite or load_suite()
    appliance = resolve(validated.plan, spec_path)
    config = Config.of(spec) if validated.plan.speculation else NO_SPECULATION
    prepared = Prepared(suite.workloads, tokens, appliance.slot_ctx, suite.stop_at_eos)
    canary = Prepared([canary_workload()], None, prepared.slot_ctx) if with_canary else None
    progress = progress or Progress(enabled=False)
    # Both sides measure every workload (and the canary) `reps` times.
    names = [*(w.name for w in suite.workloads), *([CANARY] if with_canary else [])]
    progress.plan(dict.fromkeys(names, 2 * reps))
    # The server's GPUs through NVML and the CPUs through RAPL, each read around every request where it can be.
    energy = energy if energy is not None else Energy(meters_for(appliance.server_devices, Pynvml()))
    run = _Run(validated, appliance, prepared, canary, reps, progress, load_timeout, energy)
    url: str | None = None
    if standalone:
        speculative, canary_result = run.standalone(config)
    else:
        url, (speculative, canary_result) = run.running(config)
    no_speculation, canary_no_speculation = run.baseline()
    progress.close()
    return BenchResult(
        spec=spec_path,
        suite=suite.version,
        mode="standalone" if standalone else "appliance",
        reps=reps,
        tokens=tokens,
        speculative=Side(config.label(), config, url, speculative),
        no_speculation=Side(NO_SPECULATION.label(), NO_SPECULATION, None, no_speculation),
        canary=canary_result,
        canary_no_speculation=canary_no_speculation,
        measured_at=now(),
        energy_sources=energy.sources,
        energy_unreadable=dict(energy.unreadable),
        cost=spec.cost,
        fallback=spec.fallback,
    )


def main_bench(
    spec_path: Path,
    validated: Validated,
    *,
    standalone: bool,
    reps: int,
    tokens: int | None,
    workloads: Sequence[str] | None,
    suite_file: Path | None,
    as_json: bool,
    chart: Path | None,
    baseline: Path | None,
    out: TextIO | None = None,
) -> int:
    """The `bench` command; returns its exit code (3 when the baseline file cannot be written)."""
    out = out or sys.stdout
    if reps < 1 or (tokens is not None and tokens < 1):
        raise BenchUsage("--reps and --tokens must be at least 1")
    suite = load_suite(suite_file).select(workloads)
    result = run_bench(
        validated, spec_path, standalone=standalone, reps=reps, tokens=tokens, suite=suite, progress=Progress()
    )
    if chart is not None:
        from appliance.measure.chart import draw_bench_chart

        title = f"{spec_path.name}: decode tok/s with and without speculation ({result.suite}, median of {reps})"
        draw_bench_chart(chart, title, chart_rows(result), (result.speculative.config.type_label(), "none"))
        result.chart = chart
    written = _write_baseline(baseline, result, tokens, reps) if baseline is not None else None
    if as_json:
        document = result.to_json()
        document["baseline_file"] = str(written) if written else None
        print(json.dumps(document, indent=2, ensure_ascii=False), file=out)
    else:
        print(format_table(result), file=out)
        if result.chart:
            print(f"chart: {result.chart}", file=out)
        if written:
            print(f"baseline: {written} (decode tok/s per workload and the canary, for the health daemon)", file=out)
    return 3 if baseline is not None and written is None else 0


def _write_baseline(path: Path, result: BenchResult, tokens: int | None, reps: int) -> Path | None:
    """The speculative rates as the health daemon's baseline, beside the rates without speculation (what the
    daemon's speedup is measured against); None (and why, on stderr) when it cannot be written."""
    details: dict[str, Any] = {
        "measured_by": "llm-appliance bench",
        "suite": result.suite,
        "speculative": result.speculative.config.to_json(),
        "tokens": tokens,
        "reps": reps,
    }
    try:
        write_baseline(path, result.decode_rates(), details, no_speculation=result.no_speculation_rates())
    except OSError as exc:
        print(f"bench: cannot write the baseline {path}: {exc}; run as root, or pass --baseline PATH", file=sys.stderr)
        return None
    return path
