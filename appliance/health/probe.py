"""What one check reads from the server and the GPUs, as one `Reading`: /health, /metrics as a window of
traffic since the last check, the context of the slots, the warm-up after a (re)start, the idle canary, and
NVML's memory, Xid and process views.

The probe keeps only what reading needs from one check to the next (the last counters, the last context,
whether the server was warmed up); what the readings mean is the watch's (appliance.health.watch).
A probe that fails is counted in `probe_errors` and read as nothing, never as a slow or absent server.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from appliance.facts.contention import Contention, CpuUse, contention
from appliance.facts.gpu import GpuMemory, Nvml, NvmlUnavailable
from appliance.health.detectors import CounterSample, Window, window
from appliance.health.exporter import Metrics
from appliance.health.units import ServerControl, UnitError, descendants
from appliance.runtime.server_api import ServerApi, ServerUnreachable
from appliance.spec.model import Health

log = logging.getLogger("llm-appliance.health")
CANARY_PROMPT = "def fibonacci(n):\n    "
CANARY_TOKENS = 32
# One short completion after every (re)start before /ready says 200: the first request after a load pays
# for CUDA graphs and caches, and should not be a client's.
WARMUP_PROMPT = "Hello"
WARMUP_TOKENS = 4
# A window of fewer generated tokens says nothing about the decode rate.
MIN_RATE_TOKENS = 16


@dataclass
class Reading:
    """One check's view of the server."""

    unit_active: bool = False
    status: int | None = None  # what /health answered; None: no answer
    hung: bool = False  # /health was accepted and timed out while the unit runs
    counted: bool = False  # /metrics answered
    processing: float = 0.0  # requests in flight, from /metrics
    deferred: float = 0.0  # requests queued for a slot, from /metrics: in flight too, for a drain
    window: Window | None = None  # the traffic since the last check's counters
    context_tokens: int | None = None  # read only for a window long enough to give a rate
    canary_tps: float | None = None  # the idle canary's rate, when one was run and measured

    @property
    def up(self) -> bool:
        return self.status == 200

    @property
    def busy(self) -> bool:
        # A queued request is in flight: a drain that ended between one slot's request and the next queued
        # one would cut it.
        return self.processing > 0 or self.deferred > 0

    @property
    def rated(self) -> bool:
        """Enough tokens in the window for its rate to count (a few tokens a given-up warm-up left behind are
        timed in microseconds by llama-server: a rate of millions that would become the baseline)."""
        return self.window is not None and self.window.tokens >= MIN_RATE_TOKENS


@dataclass
class GpuReading:
    """One check's view of the GPUs; `gpus` None when NVML did not answer (`error` says why)."""

    gpus: list[GpuMemory] | None = None
    error: str = ""
    xid_errors: dict[int, int] = field(default_factory=dict)  # by GPU index, since the driver loaded
    server_vram: int | None = None  # bytes the server's processes hold on all GPUs; None: not read
    others_share: float | None = None  # other processes' share of the SM time of the server's busiest GPU


class ServerProbe:
    def __init__(
        self, api: ServerApi, control: ServerControl, metrics: Metrics, clock: Callable[[], float], timeout: float
    ) -> None:
        self.api, self.control, self.metrics, self.clock = api, control, metrics, clock
        self.warmup_timeout = timeout
        self.previous: CounterSample | None = None
        self.last_context: int | None = None
        self.last_tokens_at = clock()
        # One warm-up completion after every (re)start of the server before /ready says 200.
        self.warm = False

    def read(self, warm_up: bool, canary_after: float, canary_timeout: float) -> Reading:
        """/health, the warm-up when wanted, /metrics and its window, the slots' context, then the canary when
        the server has generated nothing for canary_after seconds (0: never)."""
        seen = Reading(unit_active=self.unit_active())
        try:
            seen.status = self.api.health()
        except ServerUnreachable as exc:
            self.metrics.probe_errors.labels("health").inc()
            # A server that accepts and never answers is hung; a refused connection is merely down.
            seen.hung = "timed out" in str(exc) and self.unit_active()
        # llama-server answers /health with 503 while it loads the model (and before), and not at all when down.
        if seen.up and not self.warm and warm_up:
            self._warm_up()
        if not seen.up:
            return seen
        try:
            values = self.api.metrics()
        except ServerUnreachable as exc:
            log.warning("cannot use /metrics: %s", exc)
            self.metrics.probe_errors.labels("metrics").inc()
            return seen
        seen.counted, seen.processing = True, values.get("requests_processing", 0.0)
        seen.deferred = values.get("requests_deferred", 0.0)
        sample = counters(values)
        seen.window = window(self.previous, sample)
        self.previous = sample
        now = self.clock()
        if seen.window is not None and seen.window.tokens > 0:
            self.last_tokens_at = now
            if seen.rated:
                seen.context_tokens = self._context_tokens()
        if canary_after and now - self.last_tokens_at >= canary_after and not seen.busy:
            seen.canary_tps = self._canary(canary_timeout)
        return seen

    def after_restart(self, now: float) -> None:
        self.previous, self.warm, self.last_tokens_at = None, False, now

    def unit_active(self) -> bool:
        try:
            return self.control.active()
        except UnitError:
            self.metrics.probe_errors.labels("unit").inc()
            return False

    def main_pid(self) -> int | None:
        try:
            return self.control.main_pid()
        except UnitError:
            self.metrics.probe_errors.labels("unit").inc()
            return None

    def _warm_up(self) -> None:
        try:
            # The whole probe timeout, not the share of the interval a check's probes get: a cold server (first
            # CUDA graphs) on a busy box may need it, and /ready waits for this completion anyway.
            self.api.completion(
                WARMUP_PROMPT, WARMUP_TOKENS, timeout=self.warmup_timeout, temperature=0, cache_prompt=False
            )
        except ServerUnreachable as exc:
            log.warning("warm-up completion failed (not ready yet): %s", exc)
            self.metrics.probe_errors.labels("canary").inc()
            return
        self.warm = True
        # Its tokens are not traffic: the next window starts after them.
        self.previous = None
        log.info("warm-up completion done: ready")

    def _context_tokens(self) -> int | None:
        """The longest context of the slots' latest tasks; the last known one when /slots fails."""
        try:
            slots = self.api.slots()
        except ServerUnreachable:
            self.metrics.probe_errors.labels("slots").inc()
            return self.last_context
        sizes = [
            int(s.get("n_prompt_tokens", 0)) + sum(int(t.get("n_decoded", 0)) for t in s.get("next_token", []))
            for s in slots
            if "n_prompt_tokens" in s
        ]
        if sizes:
            self.last_context = max(sizes)
        return self.last_context

    def _canary(self, timeout: float) -> float | None:
        """An idle box is still measured: a fixed prompt, greedy, a few tokens; None when it failed."""
        try:
            answer = self.api.completion(
                CANARY_PROMPT,
                CANARY_TOKENS,
                timeout=timeout,
                temperature=0,
                ignore_eos=True,
                cache_prompt=False,
            )
            rate = float(answer["timings"]["predicted_per_second"])
            values = self.api.metrics()
        except (ServerUnreachable, KeyError, TypeError, ValueError) as exc:
            # No answer, not a slow one: the timeout allows the canary at a fraction of its baseline rate.
            log.warning("canary completion failed (no rate measured, not a slow sample): %s", exc)
            self.metrics.probe_errors.labels("canary").inc()
            self.metrics.canaries.labels("failed").inc()
            return None
        self.last_tokens_at = self.clock()
        # The canary's own tokens are not traffic: the next window starts after them.
        self.previous = counters(values)
        return rate


def canary_timeout(health: Health, baseline_tps: float | None) -> float:
    """How long the canary may take: at a quarter of the rate that counts as decay it still answers (a slow
    sample, not a failure), within the check's share of the interval; that share while no baseline is known."""
    ceiling = 0.8 * health.interval_seconds
    if not baseline_tps:
        return ceiling
    slowest = baseline_tps * health.decay_ratio / 4
    return min(ceiling, health.probe_timeout_seconds + CANARY_TOKENS / slowest)


def counters(values: dict[str, float]) -> CounterSample:
    return CounterSample(
        values.get("tokens_predicted_total", 0.0),
        values.get("tokens_predicted_seconds_total", 0.0),
        values.get("spec_decode_num_draft_tokens_total", 0.0),
        values.get("spec_decode_num_accepted_tokens_total", 0.0),
    )


def read_gpus(nvml: Nvml, ours: set[int] | None, devices: tuple[str, ...], metrics: Metrics) -> GpuReading:
    """Every GPU's memory and Xid count; with the server's process tree (`ours`, None on a CPU spec) the memory
    it holds, and the share of the server's GPUs (`devices`) other processes kept busy."""
    try:
        gpus = nvml.gpus()
    except NvmlUnavailable as exc:
        return GpuReading(error=str(exc))
    seen = GpuReading(gpus=gpus)
    for gpu in gpus:
        try:
            seen.xid_errors[gpu.index] = nvml.xid_errors(gpu.index)
        except NvmlUnavailable:
            metrics.probe_errors.labels("nvml").inc()
    if not ours:
        return seen
    try:
        seen.server_vram = sum(p.used_bytes for gpu in gpus for p in nvml.processes(gpu.index) if p.pid in ours)
        # The busiest of the server's GPUs: one shared GPU slows a split model as a whole.
        seen.others_share = max(
            (
                sum(share for pid, share in nvml.process_utilization(gpu.index).items() if pid not in ours)
                for gpu in gpus
                if gpu.device in devices
            ),
            default=0.0,
        )
    except NvmlUnavailable:
        metrics.probe_errors.labels("nvml").inc()
    return seen


class CpuProbe:
    """What else used the CPUs since the last check, and whether it kept the appliance's threads waiting."""

    def __init__(self, read: Callable[[Collection[int]], CpuUse | None] = CpuUse.read) -> None:
        self.read_cpu = read
        self.previous: CpuUse | None = None

    def read(self, ours: set[int]) -> Contention | None:
        current = self.read_cpu(ours)
        found = contention(self.previous, current, ours)
        self.previous = current
        return found


def own_processes(server_pid: int | None) -> set[int]:
    """The appliance's processes: the server's tree and this daemon's (under `up`, one tree)."""
    return descendants(os.getpid()) | (descendants(server_pid) if server_pid is not None else set())


class Saturation:
    """Whether every slot is busy and more than `max_queued` requests wait for one, from llama-server's own
    gauges. /ready asks it at every balancer check (every few seconds, far more often than the daemon checks),
    so an answer is kept for `ttl` seconds; a server that does not answer in time is not saturated (the
    daemon's checks judge a server that does not answer)."""

    def __init__(
        self,
        api: ServerApi,
        parallel: int,
        max_queued: int,
        clock: Callable[[], float] = time.monotonic,
        ttl: float = 1.0,
    ) -> None:
        self.api, self.parallel, self.max_queued, self.clock, self.ttl = api, parallel, max_queued, clock, ttl
        self._lock = threading.Lock()
        self._at: float | None = None
        self._saturated = False

    def __call__(self) -> bool:
        with self._lock:
            now = self.clock()
            if self._at is None or now - self._at >= self.ttl:
                self._at, self._saturated = now, self._read()
            return self._saturated

    def _read(self) -> bool:
        try:
            values = self.api.metrics()
        except ServerUnreachable:
            return False
        processing, queued = values.get("requests_processing", 0.0), values.get("requests_deferred", 0.0)
        return processing >= self.parallel and queued > self.max_queued
