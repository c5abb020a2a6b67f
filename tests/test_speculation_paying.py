"""Speculation that does not pay, for real: SmolLM2 drafting for itself decodes slower than SmolLM2 alone.

The no-speculation rate is measured on a real llama-server started without the draft (what bench's baseline side
does) and written to the baseline file with the real writer; then `llm-appliance up` runs the self-draft pair
with traffic, the daemon exports the measured speedup below 1, and promtool runs the rendered
LlmApplianceSpeculationNotPaying rule over the values scraped from the real exporter: it fires.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from conftest import INSTALLED_MODELS, UpProcess
from test_alert_rules import parse_rules, promtool
from test_health_daemon import Traffic, Windows, lines_with, scrape, wait_ready, wait_until
from test_launch import free_port

from appliance.measure.bench_report import write_baseline
from appliance.measure.config import NO_SPECULATION
from appliance.measure.server import TempServer
from appliance.plan.resolved import resolve
from appliance.plan.validate import validate
from appliance.render.apply import installed_spec_path
from appliance.render.render import render
from appliance.runtime.server_api import ServerApi

pytestmark = pytest.mark.engine

SELF_DRAFT = Path(__file__).parents[1] / "etc" / "llm-appliance" / "demo-draft.toml"  # SmolLM2 drafting for itself
BUCKET = "ctx<=1K"  # Traffic's short prompt and 16 tokens
PROMPT, TOKENS = "def add(a, b):", 16  # what Traffic sends
RULES = "etc/llm-appliance/rendered/prometheus/llm-appliance.rules.yml"
NOT_PAYING_FOR = 30  # seconds: the rule's `for:` here, so promtool needs few samples


def self_draft_spec(directory: Path, models: Path, server_port: int, exporter_port: int, baseline: Path) -> Path:
    text = SELF_DRAFT.read_text().replace(INSTALLED_MODELS, str(models))
    for old, new in {
        "port = 8080": f"port = {server_port}",
        "port = 9478": f"port = {exporter_port}\nalert_for_seconds = {{ speculation_not_paying = {NOT_PAYING_FOR} }}",
        "interval_seconds = 10": f'interval_seconds = 1\nbaseline_file = "{baseline}"',
        "canary_after_idle_seconds = 60": "canary_after_idle_seconds = 0",
    }.items():
        assert old in text, old
        text = text.replace(old, new)
    spec = directory / "demo-draft.toml"
    spec.write_text(text)
    return spec


def no_speculation_rate(spec: Path) -> float:
    """The traffic's own request on a real llama-server without the draft, at its best of several: on a shared
    box other processes only ever lower a rate, and a plain rate measured while they ran would make the
    self-draft, measured when they had stopped, look faster than it is (seen: 10 tok/s plain under load)."""
    with TempServer(validate(spec), NO_SPECULATION) as server:
        server.api.completion(PROMPT, TOKENS, temperature=0, ignore_eos=True, timeout=120)  # cold start
        rates = [
            float(
                server.api.completion(PROMPT, TOKENS, temperature=0, ignore_eos=True, timeout=120)["timings"][
                    "predicted_per_second"
                ]
            )
            for _ in range(6)
        ]
    return max(rates)


def speedup(text: str) -> float | None:
    match = re.search(rf'^llm_appliance_speculation_speedup{{bucket="{re.escape(BUCKET)}"}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else None


def test_speculation_slower_than_without_is_exported_and_alerts(
    fixture_models: Path, appliance_up: UpProcess, tmp_path: Path, outside_tmp: Path
) -> None:
    server_port, exporter_port = free_port(), free_port()
    baseline = outside_tmp / f"{tmp_path.name}-baseline.json"  # not in /tmp: the units' PrivateTmp= hides it
    spec_path = self_draft_spec(tmp_path, fixture_models, server_port, exporter_port, baseline)
    plain = no_speculation_rate(spec_path)
    assert plain > 0
    write_baseline(baseline, {}, {"measured_by": "test"}, {BUCKET: plain})

    process, output = appliance_up(spec_path)
    wait_ready(process, output, 1)
    traffic = Traffic(ServerApi(f"http://127.0.0.1:{server_port}", timeout=5))
    seen: list[float] = []
    try:
        # The daemon's median needs median_of (5) windows with traffic after the first check.
        wait_until(
            lambda: speedup(scrape(exporter_port)) is not None,
            Windows(traffic, 1.0, 6),
            lambda: "a speedup for " + BUCKET + "\n" + "".join(output[-30:]),
        )
        for _ in range(6):  # a scrape a second: what Prometheus would have stored, at a shorter step
            value = speedup(scrape(exporter_port))
            assert value is not None
            seen.append(value)
            wait_until(lambda n=traffic.done: traffic.done > n, Windows(traffic, 1.0, 1), "a request")
    finally:
        traffic.close()
    print(f"no speculation {plain:.1f} tok/s; speedup with the self-draft: {seen}")
    assert max(seen) < 1.0, f"the self-draft should decode slower than SmolLM2 alone ({plain:.1f} tok/s): {seen}"
    assert lines_with(output, f"speculation does not pay in {BUCKET}"), "".join(output[-30:])
    assert len(lines_with(output, f"speculation does not pay in {BUCKET}")) == 1  # said once, not every window
    assert not lines_with(output, "restarting llama-server")  # the config is the admin's

    # The rendered rule over the real values, a sample per 10 s: pending before its `for:`, firing after.
    files = render(resolve(validate(spec_path).plan, installed_spec_path(spec_path)))
    rules = tmp_path / "rules.yml"
    rules.write_text(files[RULES])
    rule = parse_rules(files[RULES])["LlmApplianceSpeculationNotPaying"]
    values = " ".join(repr(v) for v in seen)
    steps = len(seen)
    assert steps * 10 > NOT_PAYING_FOR + 10
    test = {
        "rule_files": [str(rules)],
        "evaluation_interval": "10s",
        "tests": [
            {
                "interval": "10s",
                "input_series": [
                    {
                        "series": f'llm_appliance_speculation_speedup{{appliance="{rule.labels["appliance"]}", bucket="{BUCKET}"}}',
                        "values": values,
                    }
                ],
                "alert_rule_test": [
                    {"eval_time": f"{NOT_PAYING_FOR - 10}s", "alertname": rule.alert, "exp_alerts": []},
                    {
                        "eval_time": f"{(steps - 1) * 10}s",
                        "alertname": rule.alert,
                        "exp_alerts": [
                            {
                                "exp_labels": {"bucket": BUCKET, **rule.labels},
                                "exp_annotations": {
                                    key: text.replace(
                                        "{{ $value | humanizePercentage }}", f"{100 * seen[-1]:.4g}%"
                                    ).replace("{{ $labels.bucket }}", BUCKET)
                                    for key, text in rule.annotations.items()
                                },
                            }
                        ],
                    },
                ],
            }
        ],
    }
    path = tmp_path / "not-paying.test.json"
    path.write_text(json.dumps(test, indent=2))
    result = subprocess.run(
        [promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
