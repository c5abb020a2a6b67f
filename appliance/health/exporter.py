"""The health daemon's Prometheus metrics, on a registry of its own.

Labelled series that alerts depend on are created at start, so they exist at zero before anything
happens (an alert on `increase(...restarts_total[6h])` needs the series to exist). Every help text ends with
the metric's unit in brackets: "(bytes)", "(seconds)", "(tokens per second)", "(ratio)", "(1/0)", a count.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from wsgiref.simple_server import WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Info
from prometheus_client.exposition import make_wsgi_app
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import RestrictedRegistry

from appliance.health import fleet_proof
from appliance.health.eviction import OUTCOMES as EVICTION_OUTCOMES
from appliance.health.serving import BoundedServer, BoundedServer6, QuietHandler
from appliance.plan.router import NOT_READY
from appliance.spec.address import is_ipv6
from appliance.system import metric_names as metric

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
        for family in self._registry.collect():
            if family.type not in _CREATED_FAMILIES:
                yield family
                continue
            clean = Metric(family.name, family.documentation, family.type, family.unit)
            clean.samples = [s for s in family.samples if s.name != f"{family.name}_created"]
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
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, registry=r)  # the family is named without the _total

        self.server_up = gauge(metric.SERVER_UP, "Whether llama-server answers /health with 200 (1/0)")
        self.unit_active = gauge(
            metric.SERVER_UNIT_ACTIVE, "Whether the server unit (or the launcher of `up`) is active (1/0)"
        )
        self.requests_processing = gauge(metric.REQUESTS_PROCESSING, "Requests llama-server is processing (requests)")
        self.decode_tps = gauge(
            metric.DECODE_TOKENS_PER_SECOND,
            "Median decode rate of recent windows, by context bucket (tokens per second)",
            ("bucket",),
        )
        self.decode_baseline = gauge(
            metric.DECODE_BASELINE_TOKENS_PER_SECOND,
            "Decode rate baseline, by context bucket (tokens per second)",
            ("bucket",),
        )
        self.decay_breaches = gauge(
            metric.DECODE_DECAY_BREACHES,
            "Consecutive windows below decay_ratio x baseline, by context bucket (windows)",
            ("bucket",),
        )
        self.draft_in_use = gauge(metric.DRAFT_CONFIGURED, "Whether the spec configures a draft model (1/0)")
        self.speculation_configured = gauge(
            metric.SPECULATION_CONFIGURED,
            "Whether llama-server is set to speculate: a draft model or n-gram types (1/0)",
        )
        self.speculation_engaged = gauge(
            metric.SPECULATION_ENGAGED, "Whether drafts are being made, or nothing was generated yet (1/0)"
        )
        # Absent until the first window with drafts: "no drafts yet" is not an acceptance of 0.
        self.acceptance = UnsetGauge(
            metric.SPECULATION_ACCEPTANCE_RATIO,
            "Accepted / drafted tokens in the last window with drafts (ratio)",
            r,
        )
        self.decode_no_speculation = gauge(
            metric.DECODE_NO_SPECULATION_TOKENS_PER_SECOND,
            "Decode rate without speculation from the baseline file, by bucket (tokens per second)",
            ("bucket",),
        )
        self.speculation_speedup = gauge(
            metric.SPECULATION_SPEEDUP,
            "Median decode rate of recent windows over the same bucket's rate without speculation (ratio)",
            ("bucket",),
        )
        self.contention = gauge(
            metric.CONTENTION_SHARE,
            "Share of the resource other processes used during the last check's samples: cpu all CPUs, gpu the "
            "server's GPUs' SM time (ratio)",
            ("resource",),
        )
        self.contended = gauge(
            metric.CONTENDED, "Whether the last check's samples were contended, so not counted toward decay (1/0)"
        )
        self.contended_samples = counter(
            metric.DECODE_CONTENDED_SAMPLES_TOTAL,
            "Decode samples not counted toward decay: taken under contention (samples)",
        )
        self.canaries = counter(
            metric.CANARY_RUNS_TOTAL, "Idle canary completions, by outcome: ok, slow, failed (runs)", ("outcome",)
        )
        self.drafted = counter(
            metric.SPECULATION_DRAFTED_TOKENS_TOTAL, "Draft tokens proposed, as counted by llama-server (tokens)"
        )
        self.accepted = counter(
            metric.SPECULATION_ACCEPTED_TOKENS_TOTAL, "Draft tokens accepted by the target (tokens)"
        )
        self.gpu_total = gauge(metric.GPU_MEMORY_TOTAL_BYTES, "GPU memory, total, by device (bytes)", ("device",))
        self.gpu_used = gauge(metric.GPU_MEMORY_USED_BYTES, "GPU memory, used, by device (bytes)", ("device",))
        self.gpu_free = gauge(metric.GPU_MEMORY_FREE_BYTES, "GPU memory, free, by device (bytes)", ("device",))
        self.gpu_visible = gauge(metric.GPU_VISIBLE, "Whether NVML can be read (1/0)")
        self.xid_errors = counter(
            metric.GPU_XID_ERRORS_TOTAL, "Critical XID errors reported by NVML, by device (errors)", ("device",)
        )
        self.server_vram = gauge(metric.SERVER_VRAM_BYTES, "GPU memory held by the llama-server process (bytes)")
        self.server_vram_baseline = gauge(
            metric.SERVER_VRAM_BASELINE_BYTES, "GPU memory held by the llama-server process after warm-up (bytes)"
        )
        self.creep = gauge(metric.SERVER_VRAM_CREEP_RATIO, "Server VRAM / its post-warm-up baseline - 1 (ratio)")
        self.server_on_gpu = gauge(
            metric.SERVER_ON_GPU, "Whether the server process holds GPU memory, GPU specs only (1/0)"
        )
        self.version = Info(
            metric.VERSION_INFO.removesuffix("_info"),  # prometheus_client adds the _info
            "Driver, CUDA, llama.cpp and llama-cpp-python versions in use (info: always 1, the versions are labels)",
            registry=r,
        )
        self.version_mismatch = gauge(metric.VERSION_MISMATCH, "Whether a version differs from the spec's pins (1/0)")
        self.version_drift = gauge(
            metric.VERSION_DRIFT, "Whether versions changed since the baseline was measured (1/0)"
        )
        self.engine_regression = gauge(
            metric.ENGINE_REGRESSION,
            "Decode of the engine's proof prompt after the last change of its fingerprint over decode before it; "
            "1 when nothing changed or it was not judged, `change` says what changed and the figures (ratio)",
            ("change",),
        )
        self.restarts = counter(
            metric.RESTARTS_TOTAL, "Server restarts by the appliance, by reason (restarts)", ("reason",)
        )
        self.last_restart = gauge(
            metric.LAST_RESTART_TIMESTAMP_SECONDS, "Time of the last restart by the appliance (Unix time in seconds)"
        )
        self.restart_budget_exhausted = gauge(
            metric.RESTART_BUDGET_EXHAUSTED, "Whether max_per_hour was reached and restarts stopped (1/0)"
        )
        self.restart_pending = gauge(
            metric.RESTART_PENDING, "Whether a wanted restart waits for idle or the cooldown (1/0)"
        )
        self.evictions = counter(
            metric.EVICTIONS_TOTAL,
            "Evictions of its own pod the daemon asked for, [fleet] turns = eviction, by outcome: granted, refused "
            "(429: the PodDisruptionBudget), failed (evictions)",
            ("outcome",),
        )
        self.ready = gauge(metric.READY, "Whether /ready answers 200: llama-server is up and not draining (1/0)")
        self.draining = gauge(metric.DRAINING, "Whether the daemon keeps new requests away before a restart (1/0)")
        self.peers_ready = gauge(
            metric.FLEET_PEERS_READY, "The fleet's other hosts that answered /ready with 200, last read (hosts)"
        )
        self.fleet_decay = gauge(
            metric.FLEET_DECAY,
            "Whether most of the fleet decays at once, so restarts for decay are held: a driver or CUDA change? (1/0)",
        )
        # Labelled by source (rapl, nvml), created at a source's first reading: an unreadable one exports nothing.
        self.energy = counter(
            metric.ENERGY_JOULES_TOTAL,
            "Energy drawn since the daemon started, by source: rapl the CPU packages and DRAM, nvml the server's "
            "GPUs (joules)",
            ("source",),
        )
        self.energy_per_token = gauge(
            metric.ENERGY_PER_TOKEN_JOULES,
            "Energy of the recent decode windows over the tokens they generated, by source (joules per token)",
            ("source",),
        )
        self.check_duration = gauge(metric.CHECK_DURATION_SECONDS, "Duration of the last health check (seconds)")
        self.probe_errors = counter(
            metric.PROBE_ERRORS_TOTAL, "Probes that failed, by probe (failed probes)", ("probe",)
        )
        for reason in RESTART_REASONS:
            self.restarts.labels(reason)
        for probe in PROBES:
            self.probe_errors.labels(probe)
        for outcome in CANARY_OUTCOMES:
            self.canaries.labels(outcome)
        for outcome in EVICTION_OUTCOMES:
            self.evictions.labels(outcome)


# What /ready tells the fleet's other daemons beside its status (the min_ready guard reads them, health/peers.py):
# how long this host has been ready, whether it has claimed the next restart turn, and which restart it wants.
READY_SECONDS = "X-Llm-Appliance-Ready-Seconds"
CLAIM = "X-Llm-Appliance-Restart-Claim"
WANTS = "X-Llm-Appliance-Restart-Wanted"
# What a fleet host's proof covers (health/fleet_proof.py), beside the reader's challenge and the status.
SIGNED = (fleet_proof.HOST, READY_SECONDS, CLAIM, WANTS)


class Readiness:
    """What /ready answers, for a balancer's health check: None (200) or why not (503), and for the peers the
    restart this host wants and whether it claimed its turn. The daemon sets it from its checks and its restart
    path; the exporter's threads read it."""

    def __init__(self, metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._metrics = metrics
        self._clock = clock
        self._saturated: Callable[[], bool] | None = None
        self._retry_after: dict[str, int] = {}
        self._reason: str | None = "loading"
        self._since = clock()
        self._claim = False
        self._wants: str | None = None
        self._key: bytes | None = None
        self._host = ""
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

    def refuse_when_saturated(self, saturated: Callable[[], bool] | None, retry_after: Mapping[str, int]) -> None:
        """Ask `saturated` (when given) at each /ready the daemon calls ready; send `Retry-After` (seconds, by
        reason)."""
        with self._lock:
            self._saturated, self._retry_after = saturated, dict(retry_after)

    def prove_with(self, key: bytes, host: str) -> None:
        """Answer a peer's challenge ([fleet] key_file) as `host`."""
        with self._lock:
            self._key, self._host = key, host

    def proven(self, challenge: str, status: int, body: bytes, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The headers that prove this answer to the peer that sent `challenge`; none without a key."""
        with self._lock:
            key, host = self._key, self._host
        if key is None or not fleet_proof.well_formed(challenge):
            return []
        signed = dict(headers) | {fleet_proof.HOST: host}
        return [
            (fleet_proof.HOST, host),
            (fleet_proof.PROOF, fleet_proof.proof(key, challenge, status, body, signed, SIGNED)),
        ]

    @property
    def reason(self) -> str | None:
        with self._lock:
            return self._reason

    def answer(self) -> tuple[str | None, int | None]:
        """What /ready answers now: the daemon's reason, or "saturated" when it says ready and every slot is
        busy; and the seconds a client should wait before it asks again (None when ready)."""
        with self._lock:
            reason, saturated = self._reason, self._saturated
        if reason is None and saturated is not None and saturated():
            reason = "saturated"
        return reason, None if reason is None else self._retry_after.get(reason, 1)

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


def app(metrics: Metrics, readiness: Readiness) -> Callable[..., Iterable[bytes]]:
    """/ready for balancers; everything else is the Prometheus exposition, as before."""
    exposition = make_wsgi_app(metrics.exposed)

    def route(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/ready":
            result: Iterable[bytes] = exposition(environ, start_response)
            return result
        reason, retry_after = readiness.answer()
        body = b"ready\n" if reason is None else f"not ready: {reason}\n".encode()
        status = "200 OK" if reason is None else "503 Service Unavailable"
        headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
        if retry_after is not None:
            headers.append(("Retry-After", str(retry_after)))
        fleet = readiness.headers()
        challenge = str(environ.get("HTTP_" + fleet_proof.CHALLENGE.upper().replace("-", "_"), ""))
        fleet += readiness.proven(challenge, 200 if reason is None else 503, body, fleet)
        start_response(status, headers + fleet)
        return [body]

    return route


def serve(metrics: Metrics, host: str, port: int, readiness: Readiness | None = None) -> WSGIServer:
    """The exporter in a thread of its own: /metrics (and every other path) and /ready. Port 0 picks a free one."""
    # wsgiref's server is IPv4 unless told: an exporter on ::1 or an IPv6 address needs AF_INET6.
    family = BoundedServer6 if is_ipv6(host) else BoundedServer
    try:
        server: WSGIServer = make_server(
            host, port, app(metrics, readiness or Readiness(metrics)), family, handler_class=QuietHandler
        )
    except OSError as exc:
        raise ExporterUnavailable(
            f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}; free the port or set prometheus.port"
        ) from None
    threading.Thread(target=server.serve_forever, daemon=True, name="exporter").start()
    return server
