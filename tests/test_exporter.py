"""The health daemon's Prometheus exposition: series that exist before anything happens, names that
follow Prometheus conventions, no `_created` series, a unit in every help text, and HELP/TYPE lines compared
with a golden file. tests/test_clients.py scrapes the same from the exporter of a running `up`."""

from __future__ import annotations

import os
import re
from pathlib import Path

import prometheus_client.metrics
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from appliance.health.exporter import PROBES, RESTART_REASONS, Metrics
from appliance.system import metric_names
from appliance.system.metric_names import PREFIX

REPO = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).parent / "golden" / "exporter-help.txt"
# What each help text ends with, in brackets: a base unit, 1/0 for a yes/no gauge, or what a count counts.
UNITS = {
    "bytes",
    "seconds",
    "Unix time in seconds",
    "tokens per second",
    "ratio",
    "1/0",
    "tokens",
    "requests",
    "windows",
    "samples",
    "runs",
    "restarts",
    "evictions",
    "errors",
    "failed probes",
    "joules",
    "joules per token",
    "hosts",
    "info: always 1, the versions are labels",
}
# A name's unit suffix and the unit its help must then say.
SUFFIX_UNITS = {
    "_timestamp_seconds": "Unix time in seconds",
    "_tokens_per_second": "tokens per second",
    "_seconds": "seconds",
    "_bytes": "bytes",
    "_ratio": "ratio",
    "_tokens_total": "tokens",
    "_per_token_joules": "joules per token",
    "_joules_total": "joules",
    "_info": "info: always 1, the versions are labels",
}


def exposition() -> str:
    return generate_latest(Metrics(CollectorRegistry()).exposed).decode()


def families() -> dict[str, str]:
    """Family name as exposed (counters with _total, info with _info) -> type."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", exposition(), re.MULTILINE))


def unit_problems(text: str) -> list[str]:
    """Each HELP line of an exposition whose text does not end with a known unit, or names another than the
    metric's name does; empty when every one does."""
    problems = []
    helps = re.findall(r"^# HELP (\S+) (.*)$", text, re.MULTILINE)
    for name, help_text in helps:
        unit = re.search(r"\(([^()]+)\)$", help_text)
        expected = next((u for suffix, u in SUFFIX_UNITS.items() if name.endswith(suffix)), None)
        if unit is None or unit.group(1) not in UNITS:
            problems.append(f"{name}: {help_text!r} ends with no unit of {sorted(UNITS)}")
        elif expected is not None and unit.group(1) != expected:
            problems.append(f"{name}: {help_text!r} says {unit.group(1)!r}, its name says {expected!r}")
    return problems if helps else ["no HELP lines at all"]


def sample_value(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


@pytest.mark.parametrize("reason", RESTART_REASONS)
def test_restart_counters_exist_at_zero(reason: str) -> None:
    text = exposition()
    assert f'{PREFIX}_restarts_total{{reason="{reason}"}} 0.0' in text
    assert sample_value(text, f"{PREFIX}_restarts_total", reason=reason) == 0.0


@pytest.mark.parametrize("probe", PROBES)
def test_probe_error_counters_exist_at_zero(probe: str) -> None:
    text = exposition()
    assert f'{PREFIX}_probe_errors_total{{probe="{probe}"}} 0.0' in text


def test_every_reason_and_probe_the_code_uses_is_created_at_start() -> None:
    # An alert on increase(...[6h]) needs its series before the first increment.
    sources = [*(REPO / "appliance/health").glob("*.py"), REPO / "appliance/cli/parser.py"]
    code = "\n".join(path.read_text() for path in sources)
    probes = set(re.findall(r'probe_errors\.labels\("(\w+)"\)', code))
    assert probes and probes <= set(PROBES), probes - set(PROBES)
    reasons = set(re.findall(r'seen\.want\("(\w+)"\)', code))
    for choices in re.findall(r'"--reason".*choices=\[([^\]]*)\]', code):  # what the timer and an admin pass
        reasons |= set(re.findall(r'"(\w+)"', choices))
    assert {"scheduled", "manual"} <= reasons
    assert {"decay", "creep", "headroom", "hang", "not_on_gpu"} <= reasons
    assert reasons <= set(RESTART_REASONS), reasons - set(RESTART_REASONS)


def test_only_labelled_series_without_children_and_the_acceptance_are_empty() -> None:
    text = exposition()
    expected_empty = {
        f"{PREFIX}_speculation_acceptance_ratio",  # until the first window with drafts
        f"{PREFIX}_decode_tokens_per_second",
        f"{PREFIX}_decode_baseline_tokens_per_second",
        f"{PREFIX}_decode_decay_breaches",
        f"{PREFIX}_decode_no_speculation_tokens_per_second",  # a bucket at a time, from the baseline file
        f"{PREFIX}_speculation_speedup",
        f"{PREFIX}_contention_share",  # by resource, from the first check that reads it
        f"{PREFIX}_gpu_memory_total_bytes",
        f"{PREFIX}_gpu_memory_used_bytes",
        f"{PREFIX}_gpu_memory_free_bytes",
        f"{PREFIX}_gpu_xid_errors",
        f"{PREFIX}_energy_joules",  # from a source's first reading: none where nothing can be read
        f"{PREFIX}_energy_per_token_joules",
        f"{PREFIX}_engine_regression_ratio",  # the daemon sets it at start, from the engine's proof
    }
    empty = {family.name for family in text_string_to_metric_families(text) if not family.samples}
    assert empty == expected_empty


def test_the_acceptance_is_absent_until_drafts_are_counted_then_a_series() -> None:
    """Not 0: a fresh daemon has seen no drafts, and status says "no drafts yet" where the series is absent."""
    metrics = Metrics(CollectorRegistry())
    name = f"{PREFIX}_speculation_acceptance_ratio"
    text = exposition()
    assert f"# TYPE {name} gauge" in text and sample_value(text, name) is None
    assert metrics.registry.get_sample_value(name) is None
    metrics.acceptance.set(0.0)  # drafts made, none accepted: a real 0
    assert metrics.registry.get_sample_value(name) == 0.0
    metrics.acceptance.set(0.71)
    text = generate_latest(metrics.exposed).decode()
    assert f"{name} 0.71" in text.splitlines()
    restricted = generate_latest(metrics.exposed.restricted_registry([name])).decode()  # /metrics?name[]=
    assert sample_value(restricted, name) == 0.71


def test_every_metric_is_named_once_in_metric_names() -> None:
    # What the alerts, dashboard and status read is what the exporter registers, and nothing it exports is unnamed.
    named = {value for key, value in vars(metric_names).items() if key.isupper() and key != "PREFIX"}
    # Besides the exporter's own, the router's, whose names are LiteLLM's.
    router = {metric_names.ROUTER_ANSWERS_TOTAL, metric_names.ROUTER_FAILURES_TOTAL}
    assert all(name.startswith("litellm_") for name in router)
    assert named - router == set(families())


def test_all_names_carry_the_prefix_and_are_snake_case() -> None:
    for name in families():
        assert re.fullmatch(rf"{PREFIX}_[a-z][a-z0-9_]*[a-z0-9]", name), name
        assert "__" not in name, name


def test_counters_end_in_total_and_nothing_else_does() -> None:
    found = families()
    for name, kind in found.items():
        if kind == "counter":
            assert name.endswith("_total") and not name.endswith("_total_total"), name
        else:
            assert not name.endswith("_total"), f"{name} is a {kind} named like a counter"
    assert len([k for k in found.values() if k == "counter"]) == 9


def test_units_are_base_units_in_the_name() -> None:
    for name, kind in families().items():
        if kind != "gauge":
            continue
        stem = name.removeprefix(f"{PREFIX}_")
        if "memory" in stem or "vram" in stem:
            assert stem.endswith(("_bytes", "_ratio")), name
        if "duration" in stem or "timestamp" in stem:
            assert stem.endswith("_seconds"), name
        if "acceptance" in stem or "creep" in stem:
            assert stem.endswith("_ratio"), name
        # Base units only: bytes not MiB, seconds not milliseconds.
        assert not re.search(r"_(kib|mib|gib|kb|mb|gb|ms|milliseconds|minutes|hours|percent)(_|$)", stem), name


def test_the_info_metric_is_exposed_as_info() -> None:
    assert families()[f"{PREFIX}_version_info"] == "gauge"


def test_the_names_the_alert_rules_and_dashboard_use_exist() -> None:
    # The rendered files (tests/test_examples.py holds them equal to what render writes): the names reach them
    # from appliance/system/metric_names.py through the views, not as literals in the templates.
    rendered = REPO / "tests" / "golden"
    files = [*rendered.glob("*/etc/llm-appliance/rendered/prometheus/*.yml")]
    files += [*rendered.glob("*/etc/llm-appliance/rendered/grafana/*.json")]
    used = set(re.findall(rf"\b{PREFIX}_[a-z0-9_]+", "\n".join(path.read_text() for path in files)))
    assert used
    assert used <= set(families()), used - set(families())


def test_two_registries_do_not_collide() -> None:
    first, second = Metrics(CollectorRegistry()), Metrics(CollectorRegistry())
    first.restarts.labels("decay").inc()
    assert first.registry.get_sample_value(f"{PREFIX}_restarts_total", {"reason": "decay"}) == 1
    assert second.registry.get_sample_value(f"{PREFIX}_restarts_total", {"reason": "decay"}) == 0


def test_no_created_series_whatever_the_library_global_says(monkeypatch: pytest.MonkeyPatch) -> None:
    # prometheus_client's default (and what a PROMETHEUS_DISABLE_CREATED_SERIES unset, or another module's
    # enable_created_metrics(), leaves): a `_created` sample for every counter. The exporter serves none.
    monkeypatch.setattr(prometheus_client.metrics, "_use_created", True)
    metrics = Metrics(CollectorRegistry())
    metrics.restarts.labels("decay").inc()
    assert "_created" in generate_latest(metrics.registry).decode()  # the library's own, unfiltered
    for text in (generate_latest(metrics.exposed).decode(), generate_openmetrics(metrics.exposed).decode()):
        assert "_created" not in text
        assert sample_value(text, f"{PREFIX}_restarts_total", reason="decay") == 1.0
    restricted = metrics.exposed.restricted_registry([f"{PREFIX}_restarts_total", f"{PREFIX}_restarts_created"])
    text = generate_latest(restricted).decode()  # /metrics?name[]=...
    assert "_created" not in text and f"{PREFIX}_restarts_total" in text


def test_every_help_text_says_its_unit() -> None:
    assert unit_problems(exposition()) == []
    # The check itself catches a help without one, and one at odds with the name.
    assert unit_problems("# HELP x_bytes GPU memory\n# HELP y_bytes GPU memory (seconds)\n") == [
        f"x_bytes: 'GPU memory' ends with no unit of {sorted(UNITS)}",
        "y_bytes: 'GPU memory (seconds)' says 'seconds', its name says 'bytes'",
    ]


def help_and_type_lines() -> str:
    lines = [line for line in exposition().splitlines() if line.startswith(("# HELP ", "# TYPE "))]
    return "\n".join(lines) + "\n"


def test_help_and_type_lines_match_the_golden() -> None:
    text = help_and_type_lines()
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), f"{GOLDEN.name} differs; UPDATE_GOLDEN=1 rewrites it after review"
