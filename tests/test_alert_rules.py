"""The rendered alert rules, unit-tested with `promtool test rules`: for every alert, series that fire it and
near misses that must not (a load shorter than its `for:`, one slow scrape, another GPU, another appliance).

The rules are rendered from the single-GPU example (every alert is in it); thresholds, `for:` durations and
labels are read from that spec, so the cases follow the spec rather than copies of its numbers. The
annotations' prose is the rendered file's own; a case states what its Prometheus templates must print.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import EXAMPLE_FACTS, EXAMPLES, INSTALLED_MODELS, KeyFile

from appliance.plan.resolved import resolve
from appliance.plan.validate import validate
from appliance.render.apply import installed_spec_path
from appliance.render.render import duration, render
from appliance.spec.load import load_spec
from appliance.spec.model import AlertForSeconds, Spec
from appliance.spec.problems import SpecInvalid

RULES = "etc/llm-appliance/rendered/prometheus/llm-appliance.rules.yml"
SCRAPE = "etc/llm-appliance/rendered/prometheus/scrape.yml"
EXAMPLE = "appliance.toml"
SPEC = Spec.model_validate(tomllib.loads((EXAMPLES / EXAMPLE).read_text()))
STEP = SPEC.prometheus.scrape_interval_seconds  # series samples and rule evaluations, as Prometheus would
APPLIANCE = SPEC.prometheus.labels
HEALTH = {"job": "llm-appliance-health", "instance": f"127.0.0.1:{SPEC.prometheus.port}", **APPLIANCE}
SERVER = {"job": "llm-appliance-llama-server", "instance": f"127.0.0.1:{SPEC.server.port}", **APPLIANCE}
OTHER = {**HEALTH, "appliance": "another-box"}
MIB = 1 << 20
# Which [prometheus.alert_for_seconds] field sets each alert's `for:`.
FOR_FIELD = {
    "LlmAppliance" + "".join(w.title() for w in name.split("_")): name for name in AlertForSeconds.model_fields
}


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is not installed (apt-get install prometheus; tests/run installs it)")
    return found


def steps(alert: str) -> int:
    """The alert's `for:` in scrape steps."""
    seconds: int = getattr(SPEC.prometheus.alert_for_seconds, FOR_FIELD[alert])
    assert seconds % STEP == 0
    return seconds // STEP


def run(*pieces: tuple[float, int]) -> str:
    """Series values in promtool's notation from (value, how many samples) runs, one sample per STEP."""
    exact = [str(int(v)) if float(v).is_integer() else repr(v) for v, _ in pieces]  # 536870912, not 5.36871e+08
    return " ".join(v if count == 1 else f"{v}x{count - 1}" for v, (_, count) in zip(exact, pieces, strict=True))


def series(metric: str, labels: dict[str, str], **extra: str) -> str:
    return metric + "{" + ", ".join(f"{k}={json.dumps(v)}" for k, v in {**labels, **extra}.items()) + "}"


@dataclass(frozen=True)
class Case:
    alert: str
    why: str
    input: dict[str, str]  # series -> values
    at: int  # fires: the step it fires at (and not one step before); quiet: it is silent at every step up to this
    fires: dict[str, str] | None = None  # the firing alert's labels from its series; None: must not fire
    templated: dict[str, str] = field(default_factory=dict)  # Prometheus template -> what it must print

    @property
    def id(self) -> str:
        return f"{self.alert.removeprefix('LlmAppliance')}-{'fires' if self.fires is not None else 'quiet'}-{self.why}"


def _flag(alert: str, metric: str) -> list[Case]:
    """An alert on a 0/1 gauge of the health daemon: held for its `for:` fires; a shorter blip does not."""
    n = steps(alert)
    return [
        Case(alert, "held", {series(metric, HEALTH): run((0, 4), (1, n + 10))}, 4 + n, HEALTH),
        Case(alert, "blip-shorter-than-for", {series(metric, HEALTH): run((0, 4), (1, n - 1), (0, 10))}, 4 + n),
        Case(alert, "never", {series(metric, HEALTH): run((0, n + 14))}, 4 + n),
    ]


def cases() -> list[Case]:
    h = SPEC.health
    found: list[Case] = []

    # -- server down / not ready for longer than a load may take --
    alert, n = "LlmApplianceServerDown", steps("LlmApplianceServerDown")
    found += [
        Case(
            alert,
            "health-daemon-sees-it",
            {
                series("llm_appliance_server_up", HEALTH): run((1, 4), (0, n + 10)),
                series("up", SERVER): run((1, 4), (0, n + 10)),
            },
            4 + n,
            HEALTH,
            {"{{ $labels.job }}": "llm-appliance-health"},
        ),
        Case(
            alert,
            "server-never-scrapable-daemon-not-started",
            {series("up", SERVER): run((0, n + 10))},
            n,
            SERVER,
            {"{{ $labels.job }}": "llm-appliance-llama-server"},
        ),
        Case(
            alert,
            "load-one-scrape-shorter-than-for",
            {
                series("llm_appliance_server_up", HEALTH): run((0, n), (1, 20)),
                series("up", SERVER): run((0, n), (1, 20)),
            },
            n,
        ),
        Case(alert, "another-appliance", {series("llm_appliance_server_up", OTHER): run((0, n + 10))}, n + 5),
    ]

    # -- decode decay: sustained, not one slow request --
    alert, n = "LlmApplianceDecodeDecay", steps("LlmApplianceDecodeDecay")
    baseline = 100.0
    low, near = round(h.decay_ratio * baseline) - 10, round(h.decay_ratio * baseline) + 1
    short = {"bucket": "ctx<=1K"}
    base = {series("llm_appliance_decode_baseline_tokens_per_second", HEALTH, **short): run((baseline, n + 20))}
    rate = series("llm_appliance_decode_tokens_per_second", HEALTH, **short)
    found += [
        Case(
            alert,
            "sustained",
            {**base, rate: run((baseline, 4), (low, n + 15))},
            4 + n,
            {**HEALTH, **short},
            {"{{ $value | humanize }}": f"{low:g}", "{{ $labels.bucket }}": "ctx<=1K"},
        ),
        Case(alert, "one-slow-scrape", {**base, rate: run((baseline, 4), (low, 1), (baseline, n + 14))}, 4 + n),
        Case(
            alert,
            "dips-each-shorter-than-for",
            {**base, rate: run((baseline, 4), (low, n - 1), (baseline, 1), (low, 14))},
            4 + n + 14,
        ),
        Case(alert, "just-above-the-ratio", {**base, rate: run((baseline, 4), (near, n + 15))}, 4 + n),
        Case(
            alert,
            "long-context-bucket-at-its-own-baseline",
            {
                **base,
                rate: run((baseline, n + 20)),
                series("llm_appliance_decode_tokens_per_second", HEALTH, bucket="ctx<=32K"): run((50, n + 20)),
                series("llm_appliance_decode_baseline_tokens_per_second", HEALTH, bucket="ctx<=32K"): run((50, n + 20)),
            },
            n + 10,
        ),
    ]

    # -- server VRAM creep, GPU headroom --
    alert, n = "LlmApplianceVramCreep", steps("LlmApplianceVramCreep")
    creep = series("llm_appliance_server_vram_creep_ratio", HEALTH)
    found += [
        Case(
            alert,
            "sustained",
            {creep: run((0, 4), (2 * h.creep_ratio, n + 10))},
            4 + n,
            HEALTH,
            {"{{ $value | humanizePercentage }}": f"{200 * h.creep_ratio:g}%"},
        ),
        Case(alert, "at-the-threshold", {creep: run((h.creep_ratio, n + 10))}, n + 5),
        Case(alert, "cured-by-a-restart-in-time", {creep: run((0, 4), (2 * h.creep_ratio, n - 1), (0, 10))}, 4 + n),
    ]
    alert, n = "LlmApplianceGpuHeadroomLow", steps("LlmApplianceGpuHeadroomLow")
    free = "llm_appliance_gpu_memory_free_bytes"
    minimum = h.min_free_mib * MIB
    found += [
        Case(
            alert,
            "server-gpu",
            {series(free, HEALTH, device="CUDA0"): run((8192 * MIB, 4), (minimum // 2, n + 10))},
            4 + n,
            {**HEALTH, "device": "CUDA0"},
            {"{{ $labels.device }}": "CUDA0", "{{ $value | humanize1024 }}": f"{h.min_free_mib // 2}Mi"},
        ),
        Case(
            alert,
            "another-gpu-not-the-servers",
            {series(free, HEALTH, device="CUDA1"): run((minimum // 2, n + 10))},
            n + 5,
        ),
        Case(alert, "exactly-the-minimum", {series(free, HEALTH, device="CUDA0"): run((minimum, n + 10))}, n + 5),
    ]

    # -- speculation: not engaged while a draft is configured; acceptance --
    alert, n = "LlmApplianceSpeculationNotEngaged", steps("LlmApplianceSpeculationNotEngaged")
    engaged, configured = (
        series("llm_appliance_speculation_engaged", HEALTH),
        series("llm_appliance_speculation_configured", HEALTH),
    )
    found += [
        Case(
            alert, "draft-configured", {engaged: run((1, 4), (0, n + 10)), configured: run((1, n + 14))}, 4 + n, HEALTH
        ),
        Case(alert, "no-draft-configured", {engaged: run((0, n + 10)), configured: run((0, n + 10))}, n + 5),
        Case(
            alert,
            "engaged-again-in-time",
            {engaged: run((1, 4), (0, n - 1), (1, 10)), configured: run((1, n + 14))},
            4 + n,
        ),
    ]
    alert, n = "LlmApplianceAcceptanceLow", steps("LlmApplianceAcceptanceLow")
    ratio, drafted = (
        series("llm_appliance_speculation_acceptance_ratio", HEALTH),
        series("llm_appliance_speculation_drafted_tokens_total", HEALTH),
    )
    drafting = f"100+100x{n + 9}"
    found += [
        Case(
            alert,
            "sustained",
            {ratio: run((h.acceptance_min / 2, n + 10)), drafted: drafting},
            n,
            HEALTH,
            {"{{ $value | humanizePercentage }}": f"{50 * h.acceptance_min:g}%"},
        ),
        Case(alert, "fresh-daemon-no-drafts-yet", {ratio: run((0, n + 10)), drafted: run((0, n + 10))}, n + 5),
        Case(alert, "at-the-minimum", {ratio: run((h.acceptance_min, n + 10)), drafted: drafting}, n + 5),
    ]

    # -- speculation slower than no speculation, per bucket (the speedup gauge is already a median) --
    alert, n = "LlmApplianceSpeculationNotPaying", steps("LlmApplianceSpeculationNotPaying")
    gain, low = series("llm_appliance_speculation_speedup", HEALTH, bucket="ctx<=1K"), h.speculation_min_speedup / 2
    found += [
        Case(
            alert,
            "slower-than-without",
            {gain: run((1.5, 4), (low, n + 10))},
            4 + n,
            {**HEALTH, "bucket": "ctx<=1K"},
            {"{{ $value | humanizePercentage }}": f"{100 * low:g}%", "{{ $labels.bucket }}": "ctx<=1K"},
        ),
        Case(alert, "near-miss-at-the-minimum", {gain: run((h.speculation_min_speedup, n + 10))}, n + 5),
        Case(alert, "dip-shorter-than-for", {gain: run((1.5, 4), (low, n - 1), (1.5, 10))}, 4 + n),
        Case(
            alert,
            "another-appliance",
            {series("llm_appliance_speculation_speedup", OTHER, bucket="ctx<=1K"): run((low, n + 10))},
            n + 5,
        ),
    ]

    # -- a shared box: the daemon's verdict held for its `for:` --
    found += _flag("LlmApplianceBoxShared", "llm_appliance_contended")

    # -- versions --
    found += _flag("LlmApplianceVersionMismatch", "llm_appliance_version_mismatch")
    found += _flag("LlmApplianceVersionDrift", "llm_appliance_version_drift")

    # -- the engine after a change of its fingerprint: the proof's ratio, below 1 - engine_regression --
    alert, n = "LlmApplianceEngineRegressed", steps("LlmApplianceEngineRegressed")
    floor = 1 - h.engine_regression
    change = "driver 550.54 -> 560.28: decode 159 -> 40 tok/s, 0.25x"
    slower = series("llm_appliance_engine_regression_ratio", HEALTH, change=change)
    found += [
        Case(
            alert,
            "a-driver-upgrade-quarters-decode",
            {slower: run((0.25, n + 10))},
            n,
            {**HEALTH, "change": change},
            {"{{ $labels.change }}": change, "{{ $value | humanize }}": "250m"},
        ),
        Case(alert, "within-the-band", {slower: run((round(floor + 0.01, 2), n + 10))}, n),
        Case(
            alert,
            "nothing-changed",
            {series("llm_appliance_engine_regression_ratio", HEALTH, change=""): run((1, n + 10))},
            n,
        ),
    ]

    # -- restarts: the budget exhausted (a loop stopped), and more often than expected --
    found += _flag("LlmApplianceRestartBudgetExhausted", "llm_appliance_restart_budget_exhausted")
    alert, n = "LlmApplianceRestartsFrequent", steps("LlmApplianceRestartsFrequent")
    limit = SPEC.restart.max_per_hour
    reasons = ("decay", "creep", "headroom", "hang", "not_on_gpu", "scheduled", "manual")

    def restarts(**count: int) -> dict[str, str]:
        # The exporter creates every reason at 0; each restart comes 4 steps after the previous one.
        out = {}
        for reason in reasons:
            total = count.get(reason, 0)
            out[series("llm_appliance_restarts_total", HEALTH, reason=reason)] = run(
                *[(i, 4) for i in range(total)], (total, n + 50)
            )
        return out

    found += [
        Case(
            alert,
            "unscheduled",
            restarts(decay=limit - 1, hang=1, creep=1),
            4 * (limit - 1) + n,  # the last of limit + 1 restarts at step 4 * (limit - 1)
            HEALTH,
            {"{{ $value | humanize }}": f"{limit + 1}"},
        ),
        Case(
            alert,
            "scheduled-and-manual-are-expected",
            restarts(decay=limit, scheduled=limit + 2, manual=2),
            4 * (limit + 3) + n,
        ),
    ]

    # -- the health daemon itself down: its metrics absent while the server answers --
    alert, n = "LlmApplianceHealthDaemonDown", steps("LlmApplianceHealthDaemonDown")
    absent: dict[str, str] = {}  # absent() of an expression has no labels: the rule's own (spec labels) remain
    server_up = {series("up", SERVER): run((1, n + 20))}
    found += [
        Case(
            alert,
            "exporter-not-answering",
            {**server_up, series("up", HEALTH): run((1, 4), (0, n + 10))},
            4 + n,
            absent,
        ),
        Case(
            alert,
            "never-scraped-though-another-appliances-is",
            {**server_up, series("up", OTHER): run((1, n + 20))},
            n,
            absent,
        ),
        Case(
            alert,
            "server-down-too-so-ServerDown-speaks",
            {series("up", SERVER): run((0, n + 20)), series("up", HEALTH): run((0, n + 20))},
            n + 5,
        ),
        Case(alert, "back-in-time", {**server_up, series("up", HEALTH): run((1, 4), (0, n - 1), (1, 10))}, 4 + n),
    ]
    return found


CASES = cases()


# -- the rendered rules --


@dataclass(frozen=True)
class Rule:
    alert: str
    expr: str
    for_: str
    labels: dict[str, str]
    annotations: dict[str, str]


def parse_rules(text: str) -> dict[str, Rule]:
    """The rendered rules file, read by its own layout (the template writes every rule the same way)."""
    rules = {}
    for chunk in re.split(r"^      - alert: ", text, flags=re.M)[1:]:
        name, _, body = chunk.partition("\n")
        expr = re.search(r"^        expr: \|-\n((?:          .*\n)+)", body, re.M)
        assert expr, chunk
        labels = dict(
            re.findall(
                r"^          (\w+): (.+)$", body.split("        labels:\n")[1].split("        annotations:")[0], re.M
            )
        )
        annotations = dict(re.findall(r"^          (summary|description): (\".*\")$", body, re.M))
        rules[name] = Rule(
            name,
            expr.group(1),
            re.search(r"^        for: (\S+)$", body, re.M).group(1),  # type: ignore[union-attr]
            {k: json.loads(v) if v.startswith('"') else v for k, v in labels.items()},
            {k: json.loads(v) for k, v in annotations.items()},
        )
    return rules


def render_example(directory: Path, fixture_models: Path, replace: dict[str, str] | None = None) -> Path:
    """Render the example (its models pointing at the fixtures) into directory; the rules file's path."""
    text = (EXAMPLES / EXAMPLE).read_text().replace(INSTALLED_MODELS, str(fixture_models))
    for old, new in (replace or {}).items():
        assert old in text
        text = text.replace(old, new)
    spec = directory / EXAMPLE
    spec.write_text(text)
    files = render(resolve(validate(spec, facts=EXAMPLE_FACTS[EXAMPLE]).plan, installed_spec_path(spec)))
    for relative, content in files.items():
        (directory / relative).parent.mkdir(parents=True, exist_ok=True)
        (directory / relative).write_text(content)
    return directory / RULES


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory: pytest.TempPathFactory, fixture_models: Path) -> Path:
    return render_example(tmp_path_factory.mktemp("rendered"), fixture_models)


@pytest.fixture(scope="module")
def rules(rules_file: Path) -> dict[str, Rule]:
    return parse_rules(rules_file.read_text())


def promtool_test(rules_file: Path, case: Case, directory: Path) -> subprocess.CompletedProcess[str]:
    rule = parse_rules(rules_file.read_text())[case.alert]
    checks = [{"eval_time": f"{step * STEP}s", "alertname": case.alert, "exp_alerts": []} for step in range(case.at)]
    if case.fires is None:
        checks.append({"eval_time": f"{case.at * STEP}s", "alertname": case.alert, "exp_alerts": []})
    else:
        checks = checks[-1:]  # pending, not firing, one step before its `for:` has passed
        annotations = {}
        for key, text in rule.annotations.items():
            for template, printed in case.templated.items():
                text = text.replace(template, printed)
            assert "{{" not in text, f"{case.id}: say what {key} prints for the templates in {text!r}"
            annotations[key] = text
        expected = [{"exp_labels": {**case.fires, **rule.labels}, "exp_annotations": annotations}]
        checks.append({"eval_time": f"{case.at * STEP}s", "alertname": case.alert, "exp_alerts": expected})
    test = {
        "rule_files": [str(rules_file)],
        "evaluation_interval": f"{STEP}s",
        "tests": [
            {
                "interval": f"{STEP}s",
                "input_series": [{"series": name, "values": values} for name, values in case.input.items()],
                "alert_rule_test": checks,
            }
        ],
    }
    path = directory / f"{case.id}.test.json"  # JSON is YAML: promtool reads it as is
    path.write_text(json.dumps(test, indent=2, ensure_ascii=False))
    return subprocess.run(
        [promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_alert_case(case: Case, rules_file: Path, tmp_path: Path) -> None:
    result = promtool_test(rules_file, case, tmp_path)
    assert result.returncode == 0, f"{case.id}\n{result.stdout}{result.stderr}"


def test_every_alert_has_a_firing_and_a_quiet_case(rules: dict[str, Rule]) -> None:
    covered = {(c.alert, c.fires is not None) for c in CASES}
    assert {c.alert for c in CASES} == set(rules)
    assert {(alert, fires) for alert in rules for fires in (True, False)} <= covered


def test_at_least_the_issues_alerts(rules: dict[str, Rule]) -> None:
    assert set(FOR_FIELD) == set(rules)  # the GPU example with a draft has them all


def test_ngram_speculation_without_a_draft_gets_the_speculation_alerts(tmp_path: Path, fixture_models: Path) -> None:
    text = (EXAMPLES / EXAMPLE).read_text().replace(INSTALLED_MODELS, str(fixture_models))
    draft = text[text.index("[models.draft]") : text.index("[speculative]")]  # n-grams need no draft model
    replace = {draft: "", 'type = "draft-simple"': 'type = "ngram-mod"'}
    rules_path = render_example(tmp_path, fixture_models, replace)
    rules = parse_rules(rules_path.read_text())
    expr = rules["LlmApplianceSpeculationNotEngaged"].expr
    assert "llm_appliance_speculation_configured" in expr  # 1 for n-grams too
    assert "draft_configured" not in expr  # that gauge means a draft model
    assert "n-gram" in rules["LlmApplianceSpeculationNotEngaged"].annotations["summary"]
    assert "n-gram" in rules["LlmApplianceAcceptanceLow"].annotations["description"]
    n = steps("LlmApplianceSpeculationNotEngaged")
    engaged, configured = (
        series("llm_appliance_speculation_engaged", HEALTH),
        series("llm_appliance_speculation_configured", HEALTH),
    )
    fires = Case(
        "LlmApplianceSpeculationNotEngaged",
        "ngram-not-engaged",
        {engaged: run((1, 4), (0, n + 10)), configured: run((1, n + 14))},
        4 + n,
        HEALTH,
    )
    result = promtool_test(rules_path, fires, tmp_path)
    assert result.returncode == 0, f"{result.stdout}{result.stderr}"


def test_every_alert_has_for_severity_labels_and_says_what_to_do(rules: dict[str, Rule]) -> None:
    for rule in rules.values():
        assert rule.for_ == duration(getattr(SPEC.prometheus.alert_for_seconds, FOR_FIELD[rule.alert])), rule.alert
        assert rule.labels == {"severity": rule.labels["severity"], **APPLIANCE}, rule.alert
        assert rule.labels["severity"] in ("critical", "warning")
        assert set(rule.annotations) == {"summary", "description"}, rule.alert
        assert len(rule.annotations["description"]) > 100, rule.alert
        # Every selector is this appliance's: two appliances in one Prometheus never answer for each other.
        for selector in re.findall(r"\b(?:llm_appliance_\w+|up)\b(\{[^}]*\})?", rule.expr):
            assert 'appliance="workstation"' in selector, f"{rule.alert}: {rule.expr}"


def test_severity_of_paging_alerts(rules: dict[str, Rule]) -> None:
    critical = {name for name, rule in rules.items() if rule.labels["severity"] == "critical"}
    assert critical == {
        "LlmApplianceServerDown",
        "LlmApplianceVersionMismatch",
        "LlmApplianceEngineRegressed",
        "LlmApplianceRestartBudgetExhausted",
        "LlmApplianceHealthDaemonDown",
    }


# -- the spec's part: `for:` from [prometheus.alert_for_seconds], labels quoted for YAML and PromQL --


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (2, "2s"), (90, "1m30s"), (900, "15m"), (3600, "1h"), (86401, "1d1s"), (604800, "7d")],
)
def test_duration(seconds: int, text: str) -> None:
    assert duration(seconds) == text


def test_for_durations_come_from_the_spec(tmp_path: Path, fixture_models: Path) -> None:
    rules_file = render_example(
        tmp_path,
        fixture_models,
        {
            'labels = { appliance = "workstation" }': 'labels = { appliance = "workstation" }\nalert_for_seconds = { server_down = 2, acceptance_low = 5400 }'
        },
    )
    rules = parse_rules(rules_file.read_text())
    assert rules["LlmApplianceServerDown"].for_ == "2s"
    assert rules["LlmApplianceAcceptanceLow"].for_ == "1h30m"
    assert rules["LlmApplianceDecodeDecay"].for_ == "10m"
    assert rules["LlmApplianceServerDown"].annotations["summary"] == "llama-server has not been ready for 2s"


def test_label_values_are_quoted_for_yaml_and_promql(tmp_path: Path, fixture_models: Path) -> None:
    odd = 'lab "A": 2nd floor # ü \\ end'
    rules_file = render_example(
        tmp_path,
        fixture_models,
        {'labels = { appliance = "workstation" }': f"labels = {{ appliance = {json.dumps(odd)} }}"},
    )
    check = subprocess.run([promtool(), "check", "rules", str(rules_file)], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    scrape = (tmp_path / SCRAPE).read_text()
    config = tmp_path / "prometheus.yml"
    config.write_text("scrape_configs:\n" + "".join(f"  {line}\n" for line in scrape.splitlines() if line.strip()))
    check = subprocess.run([promtool(), "check", "config", str(config)], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    # The selector matches the label's exact value: the alert fires for this appliance's series.
    labels = {**HEALTH, "appliance": odd}
    n = steps("LlmApplianceVersionMismatch")
    case = Case(
        "LlmApplianceVersionMismatch",
        "odd-label",
        {series("llm_appliance_version_mismatch", labels): run((1, n + 5))},
        n,
        labels,
    )
    result = promtool_test(rules_file, case, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", ["severity", "job", "alertname"])
def test_labels_the_rules_set_themselves_are_refused(tmp_path: Path, fixture_models: Path, name: str) -> None:
    text = (EXAMPLES / EXAMPLE).read_text().replace(INSTALLED_MODELS, str(fixture_models))
    spec = tmp_path / EXAMPLE
    spec.write_text(text.replace('labels = { appliance = "workstation" }', f'labels = {{ {name} = "x" }}'))
    with pytest.raises(SpecInvalid) as raised:
        load_spec(spec)
    assert any("set by the rendered rules" in p.message for p in raised.value.problems)


def test_unknown_alert_for_key_is_refused_with_a_suggestion(tmp_path: Path, fixture_models: Path) -> None:
    text = (EXAMPLES / EXAMPLE).read_text().replace(INSTALLED_MODELS, str(fixture_models))
    spec = tmp_path / EXAMPLE
    spec.write_text(text + "\n[prometheus.alert_for_seconds]\nserver_dwn = 60\n")
    with pytest.raises(SpecInvalid) as raised:
        load_spec(spec)
    assert [p.fix for p in raised.value.problems] == ["did you mean 'server_down'?"]


def test_with_an_api_key_server_down_asks_whether_prometheus_can_read_it(
    tmp_path: Path, fixture_models: Path, key_file: KeyFile
) -> None:
    keys = key_file("a-key")
    rules_file = render_example(tmp_path, fixture_models, {"[server]\n": f'[server]\napi_key_file = "{keys}"\n'})
    description = parse_rules(rules_file.read_text())["LlmApplianceServerDown"].annotations["description"]
    assert f"can Prometheus read {keys}, and is its key one of the server's?" in description
    assert f'credentials_file: "{keys}"' in (tmp_path / SCRAPE).read_text()
    check = subprocess.run([promtool(), "check", "rules", str(rules_file)], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
