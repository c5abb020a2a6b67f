"""What a token costs: the [cost] section's arithmetic, and what bench's table and JSON say of energy and cost,
measured or not. The measurement itself runs for real in test_bench.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.measure.bench_report import BenchResult, Side, format_table
from appliance.measure.config import NO_SPECULATION, Config
from appliance.measure.cost import PerMillion, Usage
from appliance.measure.measure import Sample, WorkloadResult
from appliance.spec.fallback import Fallback
from appliance.spec.model import Cost

# 0.30 per kWh; 3506.4 over 4 years (35064 hours) is 0.1 per hour at full use.
COST = Cost(currency="EUR", price_per_kwh=0.30, hardware_price=3506.4, lifetime_years=4)


def sample(tokens: int, seconds: float, joules: float | None) -> Sample:
    return Sample(100.0, 500.0, 20.0, 30, tokens, 0, 0, 0, seconds=seconds, joules=joules)


def result(name: str, *samples: Sample) -> WorkloadResult:
    workload = WorkloadResult(name, name, 100, 30)
    workload.samples = list(samples)
    return workload


def bench(draft: list[WorkloadResult], plain: list[WorkloadResult], **energy: object) -> BenchResult:
    return BenchResult(
        spec=Path("demo-draft.toml"),
        suite="suite-v1",
        mode="standalone",
        reps=2,
        tokens=None,
        speculative=Side("draft-simple (n_max 8)", Config(("draft-simple",), 8), None, {r.name: r for r in draft}),
        no_speculation=Side("none", NO_SPECULATION, None, {r.name: r for r in plain}),
        canary=None,
        measured_at="2026-12-03T00:00:00+00:00",
        **energy,  # type: ignore[arg-type]
    )


def test_a_lifetime_in_years_or_hours() -> None:
    assert COST.lifetime_seconds == 4 * 8766 * 3600
    assert Cost(hardware_price=1.0, lifetime_hours=10).lifetime_seconds == 36000
    assert Cost(price_per_kwh=0.2).lifetime_seconds is None


def test_usage_sums_the_requests_of_every_workload() -> None:
    usage = Usage.of(
        [result("chat", sample(100, 2.0, 50.0), sample(100, 2.0, 30.0)), result("code", sample(200, 4.0, 80.0))]
    )
    assert (usage.joules, usage.seconds, usage.tokens) == (160.0, 8.0, 400)
    assert usage.joules_per_token == pytest.approx(0.4)
    assert usage.seconds_per_token == pytest.approx(0.02)
    partly = Usage.of([result("chat", sample(100, 2.0, 50.0), sample(100, 2.0, None))])
    assert partly.joules is None and partly.joules_per_token is None  # never a sum that leaves a request out


def test_a_million_tokens_cost_electricity_and_depreciation() -> None:
    # 3.6 J per token is 1 kWh per million tokens; 0.036 s per token is 10 hours per million.
    usage = Usage(joules=360.0, seconds=3.6, tokens=100)
    price = PerMillion.of(COST, usage)
    assert price.electricity == pytest.approx(0.30)
    assert price.depreciation == pytest.approx(1.0)
    assert price.total(COST) == pytest.approx(1.30)
    quarter = Cost(price_per_kwh=0.30, hardware_price=3506.4, lifetime_hours=35064, utilization=0.25)
    assert PerMillion.of(quarter, usage).depreciation == pytest.approx(4.0)  # an idle box costs more per token


def test_without_energy_only_depreciation_is_known_and_the_total_is_not() -> None:
    price = PerMillion.of(COST, Usage(joules=None, seconds=3.6, tokens=100))
    assert price.electricity is None and price.depreciation == pytest.approx(1.0)
    assert price.total(COST) is None
    hardware_only = Cost(hardware_price=3506.4, lifetime_years=4)
    assert PerMillion.of(hardware_only, Usage(None, 3.6, 100)).total(hardware_only) == pytest.approx(1.0)


def test_the_table_says_joules_per_token_and_the_cost_with_and_without_the_draft() -> None:
    draft = [result("chat", sample(100, 3.6, 720.0))]
    plain = [result("chat", sample(100, 1.8, 360.0))]
    table = format_table(bench(draft, plain, energy_sources=("rapl",), cost=COST))
    assert (
        "energy (rapl, over each whole request): 7.2 J/token with speculation, 3.6 J/token with no speculation" in table
    )
    assert (
        "cost per million generated tokens, in EUR (electricity at 0.3 EUR/kWh; hardware 3506.4 EUR over 4 years at "
        "100% use):" in table
    )
    assert "  with speculation  0.6 electricity + 1 depreciation = 1.6" in table
    assert "  no speculation    0.3 electricity + 0.5 depreciation = 0.8" in table


def test_the_fallbacks_price_stands_beside_the_local_cost() -> None:
    draft = [result("chat", sample(100, 3.6, 720.0))]
    plain = [result("chat", sample(100, 1.8, 360.0))]
    upstream = Fallback(base_url="http://192.0.2.10:8000/v1", model="big-coder", price_per_million_output_tokens=10.0)
    outcome = bench(draft, plain, energy_sources=("rapl",), cost=COST, fallback=upstream)
    assert (
        "  fallback (big-coder at http://192.0.2.10:8000/v1, as the spec states): - per million input tokens, "
        "10 per million output tokens" in format_table(outcome).splitlines()
    )
    assert outcome.to_json()["cost"]["per_million_tokens"]["fallback"] == {"input": None, "output": 10.0}
    assert "fallback" not in format_table(bench(draft, plain, energy_sources=("rapl",), cost=COST))


def test_energy_that_cannot_be_read_is_said_once_and_priced_at_nothing() -> None:
    why = "no /sys/class/powercap: this kernel exposes no RAPL counters (a virtual machine, or no intel_rapl driver)"
    draft = [result("chat", sample(100, 3.6, None))]
    plain = [result("chat", sample(100, 1.8, None))]
    outcome = bench(draft, plain, energy_unreadable={"rapl": why}, cost=COST)
    table = format_table(outcome)
    assert table.count("not measured") == 3  # once for the source, once in each price that needs it
    assert f"energy (rapl) not measured: {why}" in table
    assert "J/token" not in table
    assert "  with speculation  electricity not measured + 1 depreciation" in table
    assert "= " not in table.split("cost per million")[1]
    document = outcome.to_json()
    assert document["energy"] == {
        "sources": [],
        "not_measured": {"rapl": why},
        "speculative": {"joules": None, "seconds": 3.6, "tokens": 100, "joules_per_token": None},
        "no_speculation": {"joules": None, "seconds": 1.8, "tokens": 100, "joules_per_token": None},
    }
    assert document["cost"]["per_million_tokens"]["speculative"] == {
        "electricity": None,
        "depreciation": 1.0,
        "total": None,
    }
    assert document["workloads"][0]["speculative"]["joules_per_token"] is None


def test_without_a_cost_section_bench_prices_nothing() -> None:
    draft = [result("chat", sample(100, 3.6, 720.0))]
    outcome = bench(draft, [result("chat", sample(100, 1.8, 360.0))], energy_sources=("nvml", "rapl"))
    assert "cost per million" not in format_table(outcome)
    assert outcome.to_json()["cost"] is None
    assert outcome.to_json()["workloads"][0]["speculative"]["joules_per_token"] == pytest.approx(7.2)
