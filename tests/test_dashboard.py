"""The Grafana dashboard rendered from the spec: its shape (what Grafana's import needs, the spec's labels in every
selector, GPU panels only on GPU specs), and every query of every panel and annotation run, as Grafana runs it,
against a real Prometheus scraping the real demo appliance of `llm-appliance up`, until each returns data."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLE_FACTS, UpProcess
from test_examples import rendered
from test_health_daemon import Traffic, wait_ready, wait_until
from test_launch import free_port
from test_prometheus_e2e import TARGETS_SECONDS, Prometheus, Timeline, fast_spec, prometheus_config

from appliance.health.exporter import RESTART_REASONS
from appliance.plan.resolved import resolve
from appliance.plan.validate import validate
from appliance.render.render import render
from appliance.runtime.server_api import ServerApi

DASHBOARD = "etc/llm-appliance/rendered/grafana/llm-appliance.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# The series only a GPU spec has: NVML's memory and the server's own VRAM.
GPU_METRICS = re.compile(r"llm_appliance_(gpu_memory_\w+|server_vram_\w+)")
SPECULATION_METRICS = re.compile(r"llamacpp:spec_decode_|llm_appliance_speculation_")
# A series named in an expr, and the matchers after it.
SELECTOR = re.compile(r"(?P<metric>\bup\b|llm_appliance_\w+|llamacpp:\w+|litellm_\w+)(?P<matchers>\{[^}]*\})?")


def dashboard_of(files: dict[str, str]) -> dict[str, Any]:
    board: dict[str, Any] = json.loads(files[DASHBOARD])
    return board


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in board["panels"] if p["type"] != "row"]


def exprs(board: dict[str, Any]) -> list[str]:
    found = [t["expr"] for p in panels(board) for t in p["targets"]]
    return found + [a["expr"] for a in board["annotations"]["list"] if "expr" in a]


@pytest.fixture
def example_boards(example: Callable[[str], Path], fixture_models: Path) -> dict[str, dict[str, Any]]:
    return {name: dashboard_of(rendered(example, name, fixture_models)) for name in sorted(EXAMPLE_FACTS)}


def test_it_imports_through_the_ui_with_a_prometheus_input(example_boards: dict[str, dict[str, Any]]) -> None:
    for name, board in example_boards.items():
        assert board["__inputs"] == [
            {
                "name": "DS_PROMETHEUS",
                "label": "Prometheus",
                "description": "The Prometheus that scrapes the appliance (its rendered scrape.yml)",
                "type": "datasource",
                "pluginId": "prometheus",
                "pluginName": "Prometheus",
            }
        ], name
        assert board["id"] is None, name  # Grafana assigns its own on import
        required = {r["id"] for r in board["__requires"] if r["type"] == "panel"}
        assert required == {p["type"] for p in panels(board)}, name
        for panel in panels(board):
            assert panel["datasource"] == DATASOURCE, (name, panel["title"])
            assert all(t["datasource"] == DATASOURCE for t in panel["targets"]), (name, panel["title"])
            assert [t["refId"] for t in panel["targets"]] == [chr(ord("A") + i) for i in range(len(panel["targets"]))]
        queried = [a for a in board["annotations"]["list"] if "expr" in a]
        assert [a["datasource"] for a in queried] == [DATASOURCE], name
        # The only variables are Grafana's own, which it fills in for every query.
        assert {v for e in exprs(board) for v in re.findall(r"\$\w+", e)} <= {"$__rate_interval", "$__range"}, name


def test_panel_ids_are_unique_and_panels_do_not_overlap(example_boards: dict[str, dict[str, Any]]) -> None:
    for name, board in example_boards.items():
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), name
        cells: set[tuple[int, int]] = set()
        for panel in board["panels"]:
            g = panel["gridPos"]
            assert g["x"] + g["w"] <= 24, (name, panel["title"])
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not mine & cells, (name, panel["title"])
            cells |= mine


def labelled(expr: str, matchers: list[str]) -> list[str]:
    """The selectors of `expr` that lack one of `matchers`; none may."""
    selectors = list(SELECTOR.finditer(expr))
    assert selectors, expr
    return [s.group(0) for s in selectors if not all(m in (s.group("matchers") or "") for m in matchers)]


def test_every_selector_carries_the_specs_labels(
    example_boards: dict[str, dict[str, Any]], example: Callable[..., Path]
) -> None:
    for name, board in example_boards.items():
        value = {
            "demo.toml": "demo",
            "demo-draft.toml": "demo",
            "demo-fallback.toml": "demo",
            "appliance.toml": "workstation",
            "dual-gpu.toml": "dual-gpu",
        }[name]
        for expr in exprs(board):
            assert labelled(expr, [f'appliance="{value}"']) == [], (name, expr)
    # Two labels, one of them needing escapes: both in every selector, quoted as PromQL reads them back.
    spec = example(
        "demo-draft.toml",
        {'labels = { appliance = "demo" }': 'labels = { appliance = "demo", team = "ml \\"core\\"" }'},
    )
    board = dashboard_of(render(resolve(validate(spec).plan, spec)))
    for expr in exprs(board):
        assert labelled(expr, ['appliance="demo"', 'team="ml \\"core\\""']) == [], expr
    assert board["uid"] != example_boards["demo-draft.toml"]["uid"]  # imported beside the demo's, not over it
    assert len(board["uid"]) <= 40  # Grafana's limit
    assert board["title"] == 'llm-appliance (appliance=demo, team=ml "core")'


def test_gpu_panels_only_on_gpu_specs(example_boards: dict[str, dict[str, Any]]) -> None:
    assert not [e for e in exprs(example_boards["demo-draft.toml"]) if GPU_METRICS.search(e)]
    for name in ("appliance.toml", "dual-gpu.toml"):
        gpu = {
            p["title"] for p in panels(example_boards[name]) if any(GPU_METRICS.search(t["expr"]) for t in p["targets"])
        }
        assert gpu == {"GPU memory", "llama-server VRAM", "VRAM creep", "Free GPU memory"}, name
    # Headroom is judged on the server's GPUs only, as the alert does.
    (free,) = [p for p in panels(example_boards["dual-gpu.toml"]) if p["title"] == "Free GPU memory"]
    assert 'device=~"CUDA0|CUDA1"' in free["targets"][0]["expr"]


def test_the_specs_thresholds_are_drawn(example_boards: dict[str, dict[str, Any]]) -> None:
    board = {p["title"]: p for p in panels(example_boards["appliance.toml"])}
    decode = board["Decode tok/s by context bucket"]["targets"]
    assert decode[2]["expr"] == f"0.8 * {decode[1]['expr']}"  # decay_ratio x the baseline
    assert decode[2]["legendFormat"] == "{{bucket}} decay threshold"

    def line(title: str) -> float:
        defaults = board[title]["fieldConfig"]["defaults"]
        assert defaults["custom"]["thresholdsStyle"] == {"mode": "line"}
        return float(defaults["thresholds"]["steps"][1]["value"])

    assert line("Free GPU memory") == 512 * 2**20  # min_free_mib
    assert line("VRAM creep") == 0.15
    assert line("Draft acceptance") == 0.4


def test_no_speculation_panels_without_a_draft(example: Callable[..., Path]) -> None:
    spec = example("demo-draft.toml", {'type = "draft-simple"': 'type = "none"'})
    spec.write_text(re.sub(r"\[models\.draft\]\n(.+\n)+\n", "", spec.read_text()))
    board = dashboard_of(render(resolve(validate(spec).plan, spec)))
    assert not [e for e in exprs(board) if SPECULATION_METRICS.search(e)]
    assert "Decode tok/s by context bucket" in {p["title"] for p in panels(board)}


def test_speculation_panels_for_ngram_speculation_without_a_draft(example: Callable[..., Path]) -> None:
    spec = example("demo-draft.toml", {'type = "draft-simple"': 'type = "ngram-mod"'})
    spec.write_text(re.sub(r"\[models\.draft\]\n(.+\n)+\n", "", spec.read_text()))
    board = dashboard_of(render(resolve(validate(spec).plan, spec)))
    titles = {p["title"] for p in panels(board)}
    assert {"Speculation", "Draft acceptance", "Mean accepted length"} <= titles
    speculation = next(p for p in panels(board) if p["title"] == "Speculation")
    assert "n-gram" in speculation["description"]


# -- every query against a real Prometheus scraping the real demo appliance --

# Rates need two scrapes in a window and a baseline needs its windows; a busy 2-core box stretches both. Every
# wait ends at its event, so only a failure waits this long.
DATA_SECONDS = 300


@dataclass(frozen=True)
class Query:
    where: str  # panel title and refId, or the annotation's name
    expr: str
    instant: bool
    step_seconds: int  # range queries: Grafana's step (the targets' min step; an annotation's own step)


def queries(board: dict[str, Any]) -> Iterator[Query]:
    for panel in panels(board):
        for t in panel["targets"]:
            step = int(t["interval"].removesuffix("s"))
            yield Query(f"{panel['title']} {t['refId']}", t["expr"], t["instant"], step)
    for a in board["annotations"]["list"]:
        if "expr" in a:
            yield Query(f"annotation {a['name']}", a["expr"], False, int(a["step"].removesuffix("s")))


def as_grafana_sends(expr: str, step_seconds: int, range_seconds: int) -> str:
    """Grafana's own variables filled in as Grafana fills them: $__rate_interval is max($__interval + min step,
    4 x min step), $__interval the step of a range query (here the min step), $__range the time range."""
    rate_interval = max(step_seconds + step_seconds, 4 * step_seconds)
    expr = expr.replace("$__rate_interval", f"{rate_interval}s").replace("$__range", f"{range_seconds}s")
    assert "$" not in expr, expr
    return expr


def answer(prometheus: Prometheus, query: Query, start: float) -> list[tuple[dict[str, str], list[float]]]:
    """What Grafana would get, each series' labels and values: an instant query at the end of the range, else a
    range query over it."""
    end = time.time()
    expr = as_grafana_sends(query.expr, query.step_seconds, math.ceil(end - start))
    if query.instant:
        return [(r["metric"], [float(r["value"][1])]) for r in prometheus.query(expr)]
    data = prometheus.get(
        "/api/v1/query_range", query=expr, start=str(start), end=str(end), step=str(query.step_seconds)
    )
    return [(r["metric"], [float(value) for _, value in r["values"]]) for r in data["result"]]


def has_data(prometheus: Prometheus, query: Query, start: float) -> bool:
    return any(math.isfinite(v) for _, values in answer(prometheus, query, start) for v in values)


PROMPTS = (
    "Write a Python function that reverses a string.",
    "List three prime numbers and say why each is prime.",
    "def fibonacci(n):",
)


@pytest.mark.engine
@pytest.mark.system
def test_every_query_returns_data_from_the_real_appliance(
    example: Callable[..., Path], appliance_up: UpProcess, fixture_models: Path, tmp_path: Path
) -> None:
    t = Timeline()
    server_port, exporter_port = free_port(), free_port()
    spec = fast_spec(example, server_port, exporter_port)
    config = prometheus_config(spec, tmp_path / "prometheus")
    board = dashboard_of(render(resolve(validate(spec).plan, spec)))
    assert not [e for e in exprs(board) if GPU_METRICS.search(e)]  # the CPU demo: no GPU panel to prove
    up, output = appliance_up(spec)
    wait_ready(up, output, 1)
    t("appliance up")
    prometheus = Prometheus(config, tmp_path / "prometheus")
    try:
        wait_until(prometheus.ready, 60, "prometheus to be ready")
        start = time.time()
        t("prometheus ready")
        # GPU panels cannot show data without a GPU, nor router panels without a router here; the real Prometheus
        # still parses every query of those examples (a 400 would raise here).
        for name in ("appliance.toml", "dual-gpu.toml", "demo-fallback.toml"):
            for query in queries(dashboard_of(rendered(example, name, fixture_models))):
                prometheus.query(as_grafana_sends(query.expr, query.step_seconds, 3600))

        # A real restart, for the restarts panel and its annotation, asked for the way the timer and an admin do;
        # once Prometheus holds the counters at zero, or it would never see them change.
        wait_until(
            lambda: bool(prometheus.query('llm_appliance_restarts_total{appliance="demo", reason="manual"} == 0')),
            TARGETS_SECONDS + DATA_SECONDS,
            lambda: f"the restart counters scraped\n{t}",
        )
        command = [
            sys.executable,
            "-m",
            "appliance.cli.main",
            "restart",
            "--when-idle",
            "--state-dir",
            tmp_path / "state",
        ]
        asked = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert asked.returncode == 0, asked.stderr
        wait_ready(up, output, 2)
        t("llama-server restarted (manual)")
        # Traffic besides the daemon's canary: prompts the cache has not seen, drafts, requests.
        api = ServerApi(f"http://127.0.0.1:{server_port}", timeout=120)
        for prompt in PROMPTS:
            api.completion(prompt, n_predict=16, temperature=0)
        t(f"{len(PROMPTS)} completions")

        every = list(queries(board))
        assert len(every) >= 20
        silent: dict[str, str] = {}
        answered: dict[str, float] = {}

        def all_answer() -> bool:
            silent.clear()
            for query in every:
                if has_data(prometheus, query, start):
                    answered.setdefault(query.where, time.monotonic() - t.start)
                else:
                    silent[query.where] = query.expr
            return not silent

        # The decode baseline needs baseline_windows windows with traffic: completions until every query answers.
        traffic = Traffic(api)
        try:
            wait_until(
                all_answer,
                TARGETS_SECONDS + DATA_SECONDS,
                lambda: (
                    "every query to return data; none yet from:\n"
                    + "\n".join(f"  {where}: {expr}" for where, expr in silent.items())
                    + f"\n{t}, {traffic.done} more completions"
                ),
            )
        finally:
            traffic.close()
        t(f"all {len(every)} queries returned data; the last: " + ", ".join(sorted(answered, key=answered.get)[-3:]))
        found = {q.where: answer(prometheus, q, start) for q in every}
        restarts = {labels["reason"]: values[0] for labels, values in found["Restarts by reason A"]}
        assert restarts == dict.fromkeys(RESTART_REASONS, 0.0) | {"manual": 1.0}  # round(): a count is whole
        assert [labels["reason"] for labels, _ in found["annotation Restarts"]] == ["manual"]
    finally:
        prometheus.stop()
