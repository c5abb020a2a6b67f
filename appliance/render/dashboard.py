"""The appliance's Grafana dashboard: what an admin looks at, from the series the health daemon exports and
llama-server's own `llamacpp:` counters, with the spec's thresholds drawn in.

Built as data from a small view (grafana.py knows Grafana's model) and printed whole by its template, so the
template holds no logic and the JSON is valid by construction. Every selector carries the spec's labels, as the
alert rules' do. GPU panels only where the server uses a GPU, speculation panels only where the server speculates:
a panel that can never show data is noise.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from appliance.plan.resolved import Appliance
from appliance.render.grafana import (
    DATASOURCE,
    JSON,
    Panel,
    Target,
    Threshold,
    bars,
    dashed,
    envelope,
    layout,
    state,
    table,
    timeseries,
)
from appliance.render.promql import label_matchers, series
from appliance.system import metric_names as metric

# Grafana's own variable: at least four scrapes (the targets' min step), more when zoomed out.
RATE = "$__rate_interval"
# Grafana's own variable: the dashboard's time range.
RANGE = "$__range"
TOKENS_PER_SECOND = "suffix: tok/s"


@dataclass(frozen=True)
class DashboardView:
    title: str
    uid: str  # one per set of labels: two appliances imported into one Grafana do not overwrite each other
    description: str
    labels: tuple[str, ...]  # the spec's labels as matchers, in every selector
    server_devices: tuple[str, ...]  # the server's GPUs; none: no GPU panels
    draft_in_use: bool  # a draft model is in use
    speculation: bool  # the server speculates (a draft, or n-gram types)
    scrape_seconds: int
    interval_seconds: int
    decay_ratio: float
    creep_ratio: float
    min_free_bytes: int
    min_free_mib: int
    acceptance_min: float
    engine_floor: float  # below it the engine regressed since its last change (1 - health.engine_regression)
    router: bool  # [fallback]: the router's answers by backend

    def of(self, metric: str, *matchers: str) -> str:
        return series(metric, self.labels, *matchers)

    def rate(self, counter: str) -> str:
        return f"rate({self.of(counter)}[{RATE}])"

    @property
    def annotation_step_seconds(self) -> int:
        # Grafana reads an annotation query at this step: a restart shows once, not once per scrape.
        return 4 * self.scrape_seconds

    @property
    def annotation_window(self) -> str:
        # One scrape longer than the step: a change between the last sample of one window and the first of the
        # next falls inside a window too (windows that only tiled would miss it).
        return f"{self.annotation_step_seconds + self.scrape_seconds}s"


def view(appliance: Appliance, header: str) -> DashboardView:
    spec = appliance.spec
    labels = label_matchers(spec.prometheus.labels)
    named = ", ".join(f"{name}={value}" for name, value in sorted(spec.prometheus.labels.items()))
    digest = hashlib.sha256("\n".join(labels).encode()).hexdigest()[:12]
    return DashboardView(
        title=f"llm-appliance ({named})" if named else "llm-appliance",
        uid=f"llm-appliance-{digest}" if labels else "llm-appliance",
        description=header,
        labels=labels,
        server_devices=appliance.server_devices,
        draft_in_use=appliance.draft_in_use,
        speculation=appliance.speculation,
        scrape_seconds=spec.prometheus.scrape_interval_seconds,
        interval_seconds=spec.health.interval_seconds,
        decay_ratio=spec.health.decay_ratio,
        creep_ratio=spec.health.creep_ratio,
        min_free_bytes=appliance.min_free_bytes,
        min_free_mib=spec.health.min_free_mib,
        acceptance_min=spec.health.acceptance_min,
        engine_floor=round(1 - spec.health.engine_regression, 6),
        router=appliance.router is not None,
    )


def dashboard_json(appliance: Appliance, header: str) -> str:
    return json.dumps(dashboard(view(appliance, header)), indent=2, ensure_ascii=False) + "\n"


def dashboard(v: DashboardView) -> JSON:
    rows = [
        ("Overview", overview(v)),
        ("Decode", decode(v)),
        ("Load", load(v)),
        *([("Router: local first", router(v))] if v.router else []),
        *([("GPU memory", gpu(v))] if v.server_devices else []),
        ("Restarts and versions", restarts_and_versions(v)),
        ("Health daemon", daemon(v)),
    ]
    return envelope(v.title, v.uid, v.description, layout(rows, f"{v.scrape_seconds}s"), annotations_of(v))


def overview(v: DashboardView) -> list[Panel]:
    up, down = ("up", "green"), ("down", "red")
    panels = [
        state(
            "llama-server",
            "/health answers 200, as the health daemon sees it",
            v.of(metric.SERVER_UP),
            {1: up, 0: down},
        ),
        state(
            "Ready",
            "/ready: up, warmed up and not draining; what a balancer reads",
            v.of(metric.READY),
            {1: ("ready", "green"), 0: ("not ready", "orange")},
        ),
        state(
            "Health daemon",
            "Prometheus scrapes the health daemon's exporter",
            v.of("up", 'job="llm-appliance-health"'),
            {1: up, 0: down},
        ),
        state(
            "Restart pending",
            "A restart the daemon wants waits for idle, the cooldown or its fleet turn",
            v.of(metric.RESTART_PENDING),
            {0: ("no", "green"), 1: ("waiting", "orange")},
        ),
        state(
            "Restart budget",
            "max_per_hour reached: the daemon stopped restarting (a restart loop)",
            v.of(metric.RESTART_BUDGET_EXHAUSTED),
            {0: ("ok", "green"), 1: ("exhausted", "red")},
        ),
    ]
    if v.speculation:
        panels.append(
            state(
                "Speculation",
                "Drafts are being made: the configured draft was not refused"
                if v.draft_in_use
                else "Drafts are being made: the n-gram types find repeated text to draft from",
                v.of(metric.SPECULATION_ENGAGED),
                {1: ("engaged", "green"), 0: ("not engaged", "red")},
            )
        )
    return panels


def decode(v: DashboardView) -> list[Panel]:
    baseline = v.of(metric.DECODE_BASELINE_TOKENS_PER_SECOND)
    rate = timeseries(
        "Decode tok/s by context bucket",
        "The health daemon's median decode rate of recent windows in each context bucket (the canary has its own), "
        f"against the bucket's baseline and the decay threshold ({v.decay_ratio} x baseline) under which it "
        "restarts the server and LlmApplianceDecodeDecay fires.",
        TOKENS_PER_SECOND,
        Target(v.of(metric.DECODE_TOKENS_PER_SECOND), "{{bucket}}"),
        Target(baseline, "{{bucket}} baseline"),
        Target(f"{v.decay_ratio} * {baseline}", "{{bucket}} decay threshold"),
        overrides=(dashed(".* baseline"), dashed(".* decay threshold", "red")),
        w=12 if v.speculation else 24,
    )
    if not v.speculation:
        return [rate]
    accepted = v.rate("llamacpp:spec_decode_num_accepted_tokens_total")
    return [
        rate,
        timeseries(
            "Draft acceptance",
            "Draft tokens the target accepted / draft tokens proposed, from llama-server's counters; under "
            f"acceptance_min ({v.acceptance_min}) the draft costs more than it saves (LlmApplianceAcceptanceLow).",
            "percentunit",
            Target(f"{accepted} / {v.rate('llamacpp:spec_decode_num_draft_tokens_total')}", "acceptance"),
            threshold=Threshold(v.acceptance_min, above_is_bad=False),
            w=6,
        ),
        timeseries(
            "Mean accepted length",
            "Tokens each verification step of the target yields: 1 + accepted draft tokens / drafts; "
            "1 means speculation gains nothing.",
            "none",
            Target(f"1 + {accepted} / {v.rate('llamacpp:spec_decode_num_drafts_total')}", "tokens per step"),
            w=6,
        ),
    ]


def load(v: DashboardView) -> list[Panel]:
    return [
        timeseries(
            "Requests",
            "Requests llama-server is processing (at most server.parallel slots) and deferred: waiting for a slot.",
            "none",
            Target(v.of("llamacpp:requests_processing"), "processing"),
            Target(v.of("llamacpp:requests_deferred"), "deferred"),
        ),
        timeseries(
            "Prompt tok/s",
            "Prompt processing speed (prompt tokens / seconds spent on prompts), and the prompt tokens arriving: "
            "processed, and reused from the cache.",
            TOKENS_PER_SECOND,
            Target(
                f"{v.rate('llamacpp:prompt_tokens_total')} / {v.rate('llamacpp:prompt_seconds_total')}",
                "processing speed",
            ),
            Target(v.rate("llamacpp:prompt_tokens_total"), "processed per second"),
            Target(v.rate("llamacpp:prompt_tokens_cached_total"), "from cache per second"),
        ),
    ]


def router(v: DashboardView) -> list[Panel]:
    answered = f"sum by (model_id) ({v.rate(metric.ROUTER_ANSWERS_TOTAL)})"
    failed = f"sum by (model_id) ({v.rate(metric.ROUTER_FAILURES_TOTAL)})"
    return [
        timeseries(
            "Answers by backend",
            "Requests the router answered per second, by who answered: local (llama-server) or fallback (the "
            "upstream of [fallback], when /ready said the local server could not serve, or it failed the request "
            "before its first byte); and the failures of each backend, which the router sent on to the other.",
            "reqps",
            Target(answered, "{{model_id}}"),
            Target(failed, "{{model_id}} failed"),
            overrides=(dashed(".* failed", "red"),),
            w=24,
        ),
    ]


def gpu(v: DashboardView) -> list[Panel]:
    devices = "|".join(v.server_devices)
    return [
        timeseries(
            "GPU memory",
            "Each GPU's memory, used and total, as NVML reports it: every process, not only llama-server.",
            "bytes",
            Target(v.of(metric.GPU_MEMORY_USED_BYTES), "{{device}} used"),
            Target(v.of(metric.GPU_MEMORY_TOTAL_BYTES), "{{device}} total"),
            overrides=(dashed(".* total"),),
        ),
        timeseries(
            "llama-server VRAM",
            "GPU memory held by the llama-server process, and its baseline after warm-up, from which creep counts.",
            "bytes",
            Target(v.of(metric.SERVER_VRAM_BYTES), "llama-server"),
            Target(v.of(metric.SERVER_VRAM_BASELINE_BYTES), "baseline"),
            overrides=(dashed("baseline"),),
        ),
        timeseries(
            "VRAM creep",
            f"llama-server's VRAM past its post-warm-up baseline; over creep_ratio ({v.creep_ratio}) the daemon "
            "restarts it when idle (LlmApplianceVramCreep).",
            "percentunit",
            Target(v.of(metric.SERVER_VRAM_CREEP_RATIO), "creep"),
            threshold=Threshold(v.creep_ratio),
        ),
        timeseries(
            "Free GPU memory",
            f"Free memory on the server's GPUs, against min_free_mib ({v.min_free_mib} MiB): below it the KV "
            "cache or compute buffers may spill to system RAM (LlmApplianceGpuHeadroomLow).",
            "bytes",
            Target(v.of(metric.GPU_MEMORY_FREE_BYTES, f'device=~"{devices}"'), "{{device}} free"),
            threshold=Threshold(v.min_free_bytes, above_is_bad=False),
        ),
    ]


def restarts_and_versions(v: DashboardView) -> list[Panel]:
    restarts = v.of(metric.RESTARTS_TOTAL)
    return [
        bars(
            "Restarts by reason",
            "Restarts of llama-server by the appliance in the dashboard's time range, by reason; each is also "
            "an annotation on the time series.",
            # increase() extrapolates to the range's edges; a count of restarts is whole.
            Target(f"round(increase({restarts}[{RANGE}]))", "{{reason}}", instant=True),
            w=8,
        ),
        table(
            "Versions",
            "Driver, CUDA, llama.cpp and llama-cpp-python in use, as the health daemon reads them.",
            Target(v.of(metric.VERSION_INFO), "", instant=True, table=True),
            {
                "driver": "NVIDIA driver",
                "cuda": "CUDA",
                "llama_cpp": "llama.cpp",
                "llama_cpp_python": "llama-cpp-python",
            },
            w=10,
        ),
        state(
            "Pins",
            "The versions against the spec's [versions] pins (LlmApplianceVersionMismatch)",
            v.of(metric.VERSION_MISMATCH),
            {0: ("met", "green"), 1: ("mismatch", "red")},
            w=3,
            h=8,
        ),
        state(
            "Drift",
            "A version changed since the decode baseline was measured: the baseline is stale "
            "(LlmApplianceVersionDrift)",
            v.of(metric.VERSION_DRIFT),
            {0: ("none", "green"), 1: ("drifted", "orange")},
            w=3,
            h=8,
        ),
    ]


def daemon(v: DashboardView) -> list[Panel]:
    return [
        timeseries(
            "Health check duration",
            f"How long the daemon's last check took; past interval_seconds ({v.interval_seconds} s) checks run "
            "back to back and the next one is late.",
            "s",
            Target(v.of(metric.CHECK_DURATION_SECONDS), "check"),
            threshold=Threshold(v.interval_seconds),
        ),
        timeseries(
            "Engine since its last change",
            "Decode of the engine's proof prompt after the last change of its fingerprint (driver, CUDA, kernel, "
            f"build, CPU) over decode before it; under {v.engine_floor} the engine regressed "
            "(LlmApplianceEngineRegressed), and no restart cures it. 1: nothing changed.",
            "none",
            Target(v.of(metric.ENGINE_REGRESSION), "{{change}}"),
            threshold=Threshold(v.engine_floor, above_is_bad=False),
        ),
        timeseries(
            "Probe errors",
            "Probes of the daemon that failed, by probe: blind spots, never a reason to restart.",
            "none",
            Target(f"increase({v.of(metric.PROBE_ERRORS_TOTAL)}[{RATE}])", "{{probe}}"),
            bars=True,
        ),
    ]


def annotations_of(v: DashboardView) -> list[JSON]:
    restarts = v.of(metric.RESTARTS_TOTAL)
    return [
        {
            "builtIn": 1,
            "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True,
            "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts",
            "type": "dashboard",
        },
        {
            "datasource": DATASOURCE,
            "enable": True,
            "expr": f"changes({restarts}[{v.annotation_window}]) > 0",
            "iconColor": "orange",
            "name": "Restarts",
            "step": f"{v.annotation_step_seconds}s",
            "tagKeys": "reason",
            "textFormat": "the health daemon restarted llama-server: {{reason}}",
            "titleFormat": "restart: {{reason}}",
            "useValueForTime": False,
        },
    ]
