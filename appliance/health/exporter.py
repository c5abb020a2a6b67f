"""The health daemon's Prometheus metrics, on a registry of its own.

Labelled series that alerts depend on are created at start, so they exist at zero before anything
happens (an alert on `increase(...restarts_total[6h])` needs the series to exist). Every help text ends with
the metric's unit in brackets: "(bytes)", "(seconds)", "(tokens per second)", "(ratio)", "(1/0)", a count.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Info
from prometheus_client.exposition import make_wsgi_app
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import RestrictedRegistry

from appliance.spec.address import is_ipv6

PREFIX = "llm_appliance"
RESTART_REASONS = ("decay", "creep", "headroom", "hang", "not_on_gpu", "scheduled", "manual")
CANARY_OUTCOMES = ("ok", "slow", "failed")  # slow: below decay_ratio x its baseline
PROBES = ("health", "metrics", "slots", "nvml", "canary", "unit", "check")  # "check": an unexpected error


# prometheus_client adds a `<name>_created` sample (the Unix time the series was made) to these families unless
# told not to; the Prometheus text format turns it into a gauge series of its own beside every counter.
_CREATED_FAMILIES = ("counter", "histogram", "summary")


class WithoutCreated:
    """A registry as the exporter serves it: no `_created` series. Filtered here, at the exposition, rather than
    with prometheus_client's disable_created_metrics() or PROMETHEUS_DISABLE_CREATED_SERIES: both set one global
    read when a series is collected, so whether they hold would depend on who imported or called what first."""

    def __init__(self, registry: CollectorRegistry | RestrictedRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        for metric in self._registry.collect():
            if metric.type not in _CREATED_FAMILIES:
                yield metric
                continue
            clean = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            clean.samples = [s for s in metric.samples if s.name != f"{metric.name}_created"]
            yield clean

    def restricted_registry(self, names: Iterable[str]) -> WithoutCreated:
        """What `/metrics?name[]=...` asks for (prometheus_client's exposition calls this)."""
        assert isinstance(self._registry, CollectorRegistry)
        return WithoutCreated(self._registry.restricted_registry(names))


class UnsetGauge:
    """A gauge without labels that has no sample until it is first set. prometheus_client exposes an unlabelled
    Gauge at 0 from its creation; a ratio that is 0 before anything was measured says what is not so (the
    acceptance before the first draft), where no series says "not known yet". Its HELP and TYPE lines are there
    from the start, as a labelled family's without children are."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self._lock = threading.Lock()
        self._value: float | None = None
        registry.register(self)

    def set(self, value: float) -> None:
        with self._lock:
            self._value = float(value)

    def get(self) -> float | None:
        with self._lock:
            return self._value

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(self.name, self.documentation)
        value = self.get()
        if value is not None:
            family.add_metric([], value)
        return [family]


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.exposed = WithoutCreated(r)  # what /metrics serves

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"{PREFIX}_{name}", doc, labels, registry=r)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, labels, registry=r)

        self.server_up = gauge("server_up", "Whether llama-server answers /health with 200 (1/0)")
        self.unit_active = gauge(
            "server_unit_active", "Whether the server unit (or the launcher of `up`) is active (1/0)"
        )
        self.requests_processing = gauge("requests_processing", "Requests llama-server is processing (requests)")
        self.decode_tps = gauge(
            "decode_tokens_per_second",
            "Median decode rate of recent windows, by context bucket (tokens per second)",
            ("bucket",),
        )
        self.decode_baseline = gauge(
            "decode_baseline_tokens_per_second",
            "Decode rate baseline, by context bucket (tokens per second)",
            ("bucket",),
        )
        self.decay_breaches = gauge(
            "decode_decay_breaches",
            "Consecutive windows below decay_ratio x baseline, by context bucket (windows)",
            ("bucket",),
        )
        self.draft_configured = gauge("draft_configured", "Whether the spec configures a draft model (1/0)")
        self.speculation_configured = gauge(
            "speculation_configured", "Whether llama-server is set to speculate: a draft model or n-gram types (1/0)"
        )
        self.speculation_engaged = gauge(
            "speculation_engaged", "Whether drafts are being made, or nothing was generated yet (1/0)"
        )
        # Absent until the first window with drafts: "no drafts yet" is not an acceptance of 0.
        self.acceptance = UnsetGauge(
            f"{PREFIX}_speculation_acceptance_ratio",
            "Accepted / drafted tokens in the last window with drafts (ratio)",
            r,
        )
        self.decode_no_speculation = gauge(
            "decode_no_speculation_tokens_per_second",
            "Decode rate without speculation from the baseline file, by bucket (tokens per second)",
            ("bucket",),
        )
        self.speculation_speedup = gauge(
            "speculation_speedup",
            "Median decode rate of recent windows over the same bucket's rate without speculation (ratio)",
            ("bucket",),
        )
        self.contention = gauge(
            "contention_share",
            "Share of the resource other processes used during the last check's samples: cpu all CPUs, gpu the "
            "server's GPUs' SM time (ratio)",
            ("resource",),
        )
        self.contended = gauge(
            "contended", "Whether the last check's samples were contended, so not counted toward decay (1/0)"
        )
        self.contended_samples = counter(
            "decode_contended_samples", "Decode samples not counted toward decay: taken under contention (samples)"
        )
        self.canaries = counter(
            "canary_runs", "Idle canary completions, by outcome: ok, slow, failed (runs)", ("outcome",)
        )
        self.drafted = counter(
            "speculation_drafted_tokens", "Draft tokens proposed, as counted by llama-server (tokens)"
        )
        self.accepted = counter("speculation_accepted_tokens", "Draft tokens accepted by the target (tokens)")
        self.gpu_total = gauge("gpu_memory_total_bytes", "GPU memory, total, by device (bytes)", ("device",))
        self.gpu_used = gauge("gpu_memory_used_bytes", "GPU memory, used, by device (bytes)", ("device",))
        self.gpu_free = gauge("gpu_memory_free_bytes", "GPU memory, free, by device (bytes)", ("device",))
        self.gpu_visible = gauge("gpu_visible", "Whether NVML can be read (1/0)")
        self.xid_errors = counter(
            "gpu_xid_errors", "Critical XID errors reported by NVML, by device (errors)", ("device",)
        )
        self.server_vram = gauge("server_vram_bytes", "GPU memory held by the llama-server process (bytes)")
        self.server_vram_baseline = gauge(
            "server_vram_baseline_bytes", "GPU memory held by the llama-server process after warm-up (bytes)"
        )
        self.creep = gauge("server_vram_creep_ratio", "Server VRAM / its post-warm-up baseline - 1 (ratio)")
        self.server_on_gpu = gauge("server_on_gpu", "Whether the server process holds GPU memory, GPU specs only (1/0)")
        self.version = Info(
            f"{PREFIX}_version",
            "Driver, CUDA, llama.cpp and llama-cpp-python versions in use (info: always 1, the versions are labels)",
            registry=r,
        )
        self.version_mismatch = gauge("version_mismatch", "Whether a version differs from the spec's pins (1/0)")
        self.version_drift = gauge("version_drift", "Whether versions changed since the baseline was measured (1/0)")
        self.restarts = counter("restarts", "Server restarts by the appliance, by reason (restarts)", ("reason",))
        self.last_restart = gauge(
            "last_restart_timestamp_seconds", "Time of the last restart by the appliance (Unix time in seconds)"
        )
        self.restart_budget_exhausted = gauge(
            "restart_budget_exhausted", "Whether max_per_hour was reached and restarts stopped (1/0)"
        )
        self.restart_pending = gauge("restart_pending", "Whether a wanted restart waits for idle or the cooldown (1/0)")
        self.ready = gauge("ready", "Whether /ready answers 200: llama-server is up and not draining (1/0)")
        self.draining = gauge("draining", "Whether the daemon keeps new requests away before a restart (1/0)")
        self.peers_ready = gauge(
            "fleet_peers_ready", "The fleet's other hosts that answered /ready with 200, last read (hosts)"
        )
        self.fleet_decay = gauge(
            "fleet_decay",
            "Whether most of the fleet decays at once, so restarts for decay are held: a driver or CUDA change? (1/0)",
        )
        # Labelled by source (rapl, nvml), created at a source's first reading: an unreadable one exports nothing.
        self.energy = counter(
            "energy_joules",
            "Energy drawn since the daemon started, by source: rapl the CPU packages and DRAM, nvml the server's "
            "GPUs (joules)",
            ("source",),
        )
        self.energy_per_token = gauge(
            "energy_per_token_joules",
            "Energy of the recent decode windows over the tokens they generated, by source (joules per token)",
            ("source",),
        )
        self.check_duration = gauge("check_duration_seconds", "Duration of the last health check (seconds)")
        self.probe_errors = counter("probe_errors", "Probes that failed, by probe (failed probes)", ("probe",))
        for reason in RESTART_REASONS:
            self.restarts.labels(reason)
        for probe in PROBES:
            self.probe_errors.labels(probe)
        for outcome in CANARY_OUTCOMES:
            self.canaries.labels(outcome)


# Why /ready answers 503; "loading" until the first check has seen the server (a fresh daemon knows nothing).
# "warming": up, its warm-up completion not done yet.
NOT_READY = ("loading", "warming", "down", "draining", "restarting")
# What /ready tells the fleet's other daemons beside its status (the min_ready guard reads them, health/peers.py):
# how long this host has been ready, whether it has claimed the next restart turn, and which restart it wants.
READY_SECONDS = "X-Llm-Appliance-Ready-Seconds"
CLAIM = "X-Llm-Appliance-Restart-Claim"
WANTS = "X-Llm-Appliance-Restart-Wanted"


class Readiness:
    """What /ready answers, for a balancer's health check: None (200) or why not (503), and for the peers the
    restart this host wants and whether it claimed its turn. The daemon sets it from its checks and its restart
    path; the exporter's threads read it."""

    def __init__(self, metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._metrics = metrics
        self._clock = clock
        self._reason: str | None = "loading"
        self._since = clock()
        self._claim = False
        self._wants: str | None = None
        self._changed = threading.Condition(self._lock)
        self._publish()

    def set(self, reason: str | None) -> None:
        assert reason is None or reason in NOT_READY, reason
        with self._lock:
            if (reason is None) != (self._reason is None):
                self._since = self._clock()
            self._reason = reason
            self._publish()
            self._changed.notify_all()

    def restart_wanted(self, reason: str | None, claim: bool) -> None:
        with self._lock:
            self._wants, self._claim = reason, claim

    @property
    def reason(self) -> str | None:
        with self._lock:
            return self._reason

    def headers(self) -> list[tuple[str, str]]:
        with self._lock:
            ready_for = self._clock() - self._since if self._reason is None else 0.0
            return [
                (READY_SECONDS, f"{ready_for:.1f}"),
                (CLAIM, "1" if self._claim else "0"),
                (WANTS, self._wants or ""),
            ]

    def wait_for(self, predicate: Callable[[str | None], bool], timeout: float) -> bool:
        """Until `predicate(reason)` holds (True) or `timeout` seconds pass (False): tests wait on the change."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self._reason), timeout)

    def _publish(self) -> None:
        self._metrics.ready.set(1 if self._reason is None else 0)
        self._metrics.draining.set(1 if self._reason == "draining" else 0)


class ExporterUnavailable(Exception):
    """The metrics port cannot be opened; the message names the port and the spec field."""


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds the daemon's exit


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # every scrape and check is no news
        pass


def app(metrics: Metrics, readiness: Readiness) -> Callable[..., Iterable[bytes]]:
    """/ready for balancers; everything else is the Prometheus exposition, as before."""
    exposition = make_wsgi_app(metrics.exposed)

    def route(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/ready":
            result: Iterable[bytes] = exposition(environ, start_response)
            return result
        reason = readiness.reason
        body = b"ready\n" if reason is None else f"not ready: {reason}\n".encode()
        status = "200 OK" if reason is None else "503 Service Unavailable"
        headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
        start_response(status, headers + readiness.headers())
        return [body]

    return route


def serve(metrics: Metrics, host: str, port: int, readiness: Readiness | None = None) -> WSGIServer:
    """The exporter in a thread of its own: /metrics (and every other path) and /ready. Port 0 picks a free one."""
    # wsgiref's server is IPv4 unless told: an exporter on ::1 or an IPv6 address needs AF_INET6.
    family = (
        type("Server", (_ThreadingServer,), {"address_family": socket.AF_INET6}) if is_ipv6(host) else _ThreadingServer
    )
    try:
        server: WSGIServer = make_server(
            host, port, app(metrics, readiness or Readiness(metrics)), family, handler_class=_QuietHandler
        )
    except OSError as exc:
        raise ExporterUnavailable(
            f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}; free the port or set prometheus.port"
        ) from None
    threading.Thread(target=server.serve_forever, daemon=True, name="exporter").start()
    return server
