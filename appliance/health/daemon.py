"""The health daemon: every interval, probe the server, the GPU and the versions; feed the detectors;
restart the server when it must (idle-aware, rate-limited); export everything to Prometheus.

It never restarts the server because its own probe failed: a probe error is counted and reported, and
only a server that is seen to be slow, swollen, hung or off the GPU is restarted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from appliance.facts.energy_meters import EnergyMeter, meters_for
from appliance.facts.gpu import Nvml, NvmlUnavailable
from appliance.health import versions
from appliance.health.detectors import (
    CANARY_BUCKET,
    CounterSample,
    CreepDetector,
    DecayDetector,
    PayingTracker,
    RestartPolicy,
    context_bucket,
    speculation,
    speedup,
    window,
)
from appliance.health.drain import Drain, restart_turn
from appliance.health.energy_probe import EnergyProbe
from appliance.health.exporter import Metrics, Readiness
from appliance.health.peers import Peer, PeerReader, reader
from appliance.health.requests import RestartRequest, RestartRequests
from appliance.health.state import RestartLog
from appliance.health.units import ServerControl, UnitError, descendants
from appliance.plan.resolved import Appliance
from appliance.runtime.notify import Notifier
from appliance.runtime.server_api import ServerApi, ServerUnreachable, read_api_key
from appliance.spec.model import Spec
from appliance.system import paths

log = logging.getLogger("llm-appliance.health")
CANARY_PROMPT = "def fibonacci(n):\n    "
CANARY_TOKENS = 32
# One short completion after every (re)start before /ready says 200: the first request after a load pays
# for CUDA graphs and caches, and should not be a client's.
WARMUP_PROMPT = "Hello"
WARMUP_TOKENS = 4
# A window of fewer generated tokens says nothing about the decode rate.
MIN_RATE_TOKENS = 16
# While draining, checks come this often (at most): the drain ends, and idle is seen, within this much.
DRAIN_POLL_SECONDS = 1.0
# A peer's /ready answers at once or the peer does not count: the guard must not stall the drain's polls.
PEER_TIMEOUT_SECONDS = 1.0
# How often the loop looks for a restart request between checks (one stat of a file).
REQUEST_POLL_SECONDS = 1.0


@dataclass(frozen=True)
class DaemonConfig:
    """The applied appliance the daemon watches, and where the engine's manifest is."""

    appliance: Appliance
    engine_dir: Path = paths.ENGINE_DIR

    @property
    def spec(self) -> Spec:
        return self.appliance.spec


@dataclass
class Observation:
    """What one check saw, for the STATUS line and the tests."""

    up: bool = False
    busy: bool = False
    decode_tps: float | None = None
    baseline_tps: float | None = None
    acceptance: float | None = None
    creep: float | None = None
    reason: str | None = None
    action: str = "none"
    notes: list[str] = field(default_factory=list)

    def status(self) -> str:
        if not self.up:
            parts = ["server not answering /health"]
        elif self.decode_tps is None:
            parts = ["server up, no decode measured yet"]
        else:
            baseline = f" (baseline {self.baseline_tps:.0f})" if self.baseline_tps else " (learning baseline)"
            parts = [f"decode {self.decode_tps:.0f} tok/s{baseline}"]
        if self.acceptance is not None:
            parts.append(f"acceptance {self.acceptance:.2f}")
        if self.creep is not None:
            parts.append(f"creep {100 * self.creep:.0f}%")
        if self.action not in ("none",):
            parts.append(f"restart {self.action} ({self.reason})")
        return ", ".join(parts + self.notes)


class HealthDaemon:
    def __init__(
        self,
        config: DaemonConfig,
        control: ServerControl,
        nvml: Nvml,
        metrics: Metrics | None = None,
        api: ServerApi | None = None,
        clock: Callable[[], float] = time.time,
        readiness: Readiness | None = None,
        peers: PeerReader | None = None,
        energy: Sequence[EnergyMeter] | None = None,
    ) -> None:
        health, restart = config.spec.health, config.spec.restart
        self.config, self.control, self.nvml, self.clock = config, control, nvml, clock
        self.metrics = metrics or Metrics()
        # What /ready says to a balancer; the exporter serves the same object.
        self.readiness = readiness or Readiness(self.metrics)
        self.draining = False
        fleet = config.spec.fleet
        self.drain = Drain(fleet.drain_seconds if fleet else 0, restart.idle_timeout_seconds)
        # A restart taking its turn in the fleet (claimed, or waiting for one): the daemon polls meanwhile.
        self.in_turn = False
        self.claimed = False
        self.said = ""
        self.read_peers = peers or reader(timeout=min(PEER_TIMEOUT_SECONDS, health.probe_timeout_seconds))
        self.requests = RestartRequests(config.appliance.state_file.parent)
        self.requested: RestartRequest | None = None
        # One warm-up completion after every (re)start of the server before /ready says 200.
        self.warm = False
        timeout = min(health.probe_timeout_seconds, 0.8 * health.interval_seconds)
        appliance = config.appliance
        self.api = api or ServerApi(appliance.server.url, read_api_key(appliance.api_key_file), timeout=timeout)
        self.decay = DecayDetector(health.decay_ratio, health.consecutive, health.baseline_windows)
        self.creep = CreepDetector(health.creep_ratio, health.consecutive)
        self.policy = RestartPolicy(restart.cooldown_seconds, restart.max_per_hour, restart.idle_timeout_seconds)
        self.previous: CounterSample | None = None
        self.last_tokens_at = clock()
        self.warmed_up = False
        self.hung_checks = 0
        self.low_headroom_checks = 0
        self.gpu_restart_done = False
        self.xids_seen: dict[int, int] = {}
        self.last_context: int | None = None
        self.baseline_versions: dict[str, str | None] | None = None
        self.no_speculation: dict[str, float] = {}
        self.paying = PayingTracker(health.speculation_min_speedup)
        self.metrics.draft_configured.set(1 if appliance.draft_in_use else 0)
        self.metrics.speculation_configured.set(1 if appliance.speculation else 0)
        self.metrics.speculation_engaged.set(1)
        self.restart_log = RestartLog(appliance.state_file)
        self.energy = EnergyProbe(
            meters_for(appliance.server_devices, nvml) if energy is None else energy, self.metrics
        )
        self._load_baseline()
        self._load_state()

    # -- state that outlives the daemon (a server restart restarts the daemon bound to it) --

    def _load_baseline(self) -> None:
        baseline = versions.Baseline.read(self.config.appliance.baseline_file)
        if baseline is not None:
            self.decay.baselines.update(baseline.decode_tps)
            self.baseline_versions = baseline.versions
            self.no_speculation = baseline.no_speculation_tps
            for bucket, rate in self.no_speculation.items():
                self.metrics.decode_no_speculation.labels(bucket).set(rate)
            log.info("decode baselines from %s: %s", self.config.appliance.baseline_file, baseline.decode_tps)

    def _load_state(self) -> None:
        restarts = self.restart_log.read()
        self.policy.history = [t for t, _ in restarts if self.clock() - t < 3600]
        # Restarting the server restarts this daemon (BindsTo=): the one not_on_gpu restart must hold across it.
        self.gpu_restart_done = bool(restarts) and restarts[-1][1] == "not_on_gpu"
        for reason, total in self.restart_log.totals().items():
            self.metrics.restarts.labels(reason).inc(total)
        if restarts:
            self.metrics.last_restart.set(restarts[-1][0])

    # -- one check --

    def check(self) -> Observation:
        started = time.monotonic()
        seen = Observation()
        try:
            self.energy.read()  # every check, the server up or not: the counter counts what the machine draws
            self._probe_server(seen)
            self._probe_gpu(seen)
            self._probe_versions(seen)
            self._act(seen)
        except Exception:  # the daemon must outlive any surprise; say what happened and carry on
            log.exception("health check failed")
            self.metrics.probe_errors.labels("check").inc()
        self.metrics.check_duration.set(time.monotonic() - started)
        return seen

    def _probe_server(self, seen: Observation) -> None:
        self.metrics.unit_active.set(1 if self._unit_active() else 0)
        try:
            status = self.api.health()
            seen.up = status == 200
            self.hung_checks = 0
        except ServerUnreachable as exc:
            status, seen.up = None, False
            self.metrics.probe_errors.labels("health").inc()
            # A server that accepts and never answers is hung; a refused connection is merely down.
            self.hung_checks = self.hung_checks + 1 if "timed out" in str(exc) and self._unit_active() else 0
        self.metrics.server_up.set(1 if seen.up else 0)
        # llama-server answers /health with 503 while it loads the model (and before), and not at all when down.
        if seen.up and not self.warm and not self.draining:
            self._warm_up()
        self.readiness.set(
            "draining"
            if self.draining
            else ("warming" if not self.warm else None)
            if seen.up
            else "loading"
            if status == 503
            else "down"
        )
        if not seen.up:
            return
        try:
            values = self.api.metrics()
        except ServerUnreachable as exc:
            log.warning("cannot use /metrics: %s", exc)
            self.metrics.probe_errors.labels("metrics").inc()
            return
        processing = values.get("requests_processing", 0.0)
        seen.busy = processing > 0
        self.metrics.requests_processing.set(processing)
        sample = CounterSample(
            values.get("tokens_predicted_total", 0.0),
            values.get("tokens_predicted_seconds_total", 0.0),
            values.get("spec_decode_num_draft_tokens_total", 0.0),
            values.get("spec_decode_num_accepted_tokens_total", 0.0),
        )
        w = window(self.previous, sample)
        self.previous = sample
        if w is None:
            self.energy.mark()
        else:
            self.energy.window(w.tokens)
        now = self.clock()
        if w is not None and w.tokens > 0:
            self.last_tokens_at = now
            self.warmed_up = True
            rate = w.decode_tps
            # A few tokens (a warm-up the daemon gave up on, which the server finished anyway) are timed in
            # microseconds by llama-server: a rate of millions that would become the baseline.
            if rate is not None and w.tokens >= MIN_RATE_TOKENS:
                self._record_rate(context_bucket(self._context_tokens()), rate, seen)
            self.metrics.drafted.inc(max(w.drafted, 0))
            self.metrics.accepted.inc(max(w.accepted, 0))
            verdict = speculation(self.config.appliance.speculation, w, self.config.spec.health.acceptance_min)
            if verdict.engaged is not None:
                self.metrics.speculation_engaged.set(1 if verdict.engaged else 0)
                if not verdict.engaged:
                    seen.notes.append("SPECULATION NOT ENGAGED")
            if verdict.acceptance is not None:
                seen.acceptance = verdict.acceptance
                self.metrics.acceptance.set(verdict.acceptance)
        idle_for = now - self.last_tokens_at
        canary_after = self.config.spec.health.canary_after_idle_seconds
        if canary_after and idle_for >= canary_after and not seen.busy:
            self._canary(seen)

    def _warm_up(self) -> None:
        try:
            # The whole probe timeout, not the share of the interval a check's probes get: a cold server (first
            # CUDA graphs) on a busy box may need it, and /ready waits for this completion anyway.
            self.api.completion(
                WARMUP_PROMPT,
                WARMUP_TOKENS,
                timeout=self.config.spec.health.probe_timeout_seconds,
                temperature=0,
                cache_prompt=False,
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

    def _record_rate(self, bucket: str, rate: float, seen: Observation) -> None:
        self.decay.add(bucket, rate)
        seen.decode_tps = self.decay.current(bucket) or rate
        seen.baseline_tps = self.decay.baselines.get(bucket)
        self.metrics.decode_tps.labels(bucket).set(seen.decode_tps)
        if seen.baseline_tps:
            self.metrics.decode_baseline.labels(bucket).set(seen.baseline_tps)
        self.metrics.decay_breaches.labels(bucket).set(self.decay.breaches.get(bucket, 0))
        if self.config.appliance.speculation:
            self._judge_speedup(bucket)

    def _judge_speedup(self, bucket: str) -> None:
        """Export what speculation gains here; say once when it stops paying. The running config is the
        admin's: the alert tells what to run, nothing here changes it."""
        gain = speedup(self.decay.current(bucket), self.no_speculation.get(bucket))
        if gain is None:
            return
        self.metrics.speculation_speedup.labels(bucket).set(gain)
        change = self.paying.update(bucket, gain)
        if change == "slower":
            log.warning(
                "speculation does not pay in %s: %.2fx the rate without it (%.1f tok/s); run `llm-appliance tune %s`",
                bucket,
                gain,
                self.no_speculation[bucket],
                self.config.appliance.spec_file,
            )
        elif change == "recovered":
            log.info("speculation pays again in %s: %.2fx the rate without it", bucket, gain)

    def _canary(self, seen: Observation) -> None:
        """An idle box is still measured: a fixed prompt, greedy, a few tokens; its own bucket."""
        try:
            answer = self.api.completion(
                CANARY_PROMPT,
                CANARY_TOKENS,
                timeout=self.api.timeout,
                temperature=0,
                ignore_eos=True,
                cache_prompt=False,
            )
            rate = float(answer["timings"]["predicted_per_second"])
            values = self.api.metrics()
        except (ServerUnreachable, KeyError, TypeError, ValueError) as exc:
            log.warning("canary completion failed: %s", exc)
            self.metrics.probe_errors.labels("canary").inc()
            return
        self.last_tokens_at = self.clock()
        # The canary's own tokens are not traffic: the next window starts after them.
        self.previous = CounterSample(
            values.get("tokens_predicted_total", 0.0),
            values.get("tokens_predicted_seconds_total", 0.0),
            values.get("spec_decode_num_draft_tokens_total", 0.0),
            values.get("spec_decode_num_accepted_tokens_total", 0.0),
        )
        self.energy.mark()
        self.warmed_up = True
        if rate > 0:
            self._record_rate(CANARY_BUCKET, rate, seen)

    def _unit_active(self) -> bool:
        try:
            return self.control.active()
        except UnitError:
            self.metrics.probe_errors.labels("unit").inc()
            return False

    def _probe_gpu(self, seen: Observation) -> None:
        try:
            gpus = self.nvml.gpus()
        except NvmlUnavailable as exc:
            self.metrics.gpu_visible.set(0)
            if self.config.appliance.on_gpu:  # on a CPU spec no NVML is expected, not an error
                self.metrics.probe_errors.labels("nvml").inc()
                seen.notes.append(f"GPU not visible ({exc})")
            return
        self.metrics.gpu_visible.set(1)
        min_free = self.config.appliance.min_free_bytes
        server_devices = self.config.appliance.server_devices
        low = False
        for gpu in gpus:
            self.metrics.gpu_total.labels(gpu.device).set(gpu.total_bytes)
            self.metrics.gpu_used.labels(gpu.device).set(gpu.used_bytes)
            self.metrics.gpu_free.labels(gpu.device).set(gpu.free_bytes)
            # Only the server's GPUs: another workload filling another GPU is no reason to restart it.
            low = low or (gpu.device in server_devices and gpu.free_bytes < min_free)
            try:
                errors = self.nvml.xid_errors(gpu.index)
            except NvmlUnavailable:
                self.metrics.probe_errors.labels("nvml").inc()
                errors = 0
            if errors > self.xids_seen.get(gpu.index, 0):
                self.metrics.xid_errors.labels(gpu.device).inc(errors - self.xids_seen.get(gpu.index, 0))
                self.xids_seen[gpu.index] = errors
        self.low_headroom_checks = self.low_headroom_checks + 1 if low and seen.up else 0
        if self.low_headroom_checks >= self.config.spec.health.consecutive:
            seen.reason = seen.reason or "headroom"
        if not self.config.appliance.on_gpu:
            return
        pid = self._main_pid()
        if pid is None:
            return
        mine = descendants(pid)
        try:
            used = sum(p.used_bytes for gpu in gpus for p in self.nvml.processes(gpu.index) if p.pid in mine)
        except NvmlUnavailable:
            self.metrics.probe_errors.labels("nvml").inc()
            return
        self.metrics.server_vram.set(used)
        self.metrics.server_on_gpu.set(1 if used > 0 else 0)
        if seen.up and self.warmed_up and used == 0:
            seen.notes.append("server is NOT on the GPU")
            if not self.gpu_restart_done:
                seen.reason = seen.reason or "not_on_gpu"
        if self.creep.add(used, seen.up and self.warmed_up):
            seen.reason = seen.reason or "creep"
        if self.creep.baseline:
            seen.creep = self.creep.creep(used)
            self.metrics.server_vram_baseline.set(self.creep.baseline)
            self.metrics.creep.set(seen.creep)

    def _main_pid(self) -> int | None:
        try:
            return self.control.main_pid()
        except UnitError:
            self.metrics.probe_errors.labels("unit").inc()
            return None

    def _probe_versions(self, seen: Observation) -> None:
        found = versions.detect(self.nvml, self.config.engine_dir)
        self.metrics.version.info(
            {k: v or "unknown" for k, v in {**found.comparable(), "llama_cpp_python": found.llama_cpp_python}.items()}
        )
        problems = versions.mismatches(self.config.spec.versions, found)
        self.metrics.version_mismatch.set(1 if problems else 0)
        if problems:
            seen.notes.append("version mismatch: " + "; ".join(problems))
        if self.baseline_versions is None:
            self.baseline_versions = found.comparable()
        changed = versions.drift(self.baseline_versions, found)
        self.metrics.version_drift.set(1 if changed else 0)
        if changed:
            seen.notes.append("versions changed since the baseline (" + ", ".join(changed) + "); baseline stale")

    def _act(self, seen: Observation) -> None:
        # Verdicts are states, not events: a wanted restart stays wanted across checks without new windows.
        if self.decay.breached():
            seen.reason = seen.reason or "decay"
        if self.hung_checks >= self.config.spec.health.consecutive:
            seen.reason = seen.reason or "hang"
        if seen.reason != "decay":
            self.metrics.fleet_decay.set(0)
        now = self.clock()
        # Busy or not, a restart drains first (below): waiting for idle while still taking new requests would
        # wait for ever behind a balancer. The policy keeps the budget and the cooldown.
        decision = self.policy.decide(now, seen.reason, busy=False)
        seen.action = decision.action
        self.metrics.restart_budget_exhausted.set(1 if self.policy.exhausted else 0)
        self.requested = self.requested or self.requests.adopt()
        # What the peers read: the restart this host wants (whatever the policy says of it), and its claim.
        asked = self.requested.reason if self.requested else None
        self.readiness.restart_wanted(seen.reason or asked, self.claimed)
        if decision.action == "exhausted":
            self._say(
                f"restart wanted ({decision.reason}) but not done: {decision.detail}; the server needs a human",
                level=logging.ERROR,
            )
        elif decision.action in ("wait", "cooldown"):
            log.info("restart wanted (%s): %s", decision.reason, decision.detail)
        # Asked for (the timer, an admin), a restart is not the policy's to refuse; it still takes its turn.
        if decision.action == "restart":
            self._take_turn(decision.reason, decision.detail, now, seen)
        elif self.requested is not None:
            seen.reason = self.requested.reason
            self._take_turn(self.requested.reason, "asked for", now, seen)
        elif self.in_turn:
            log.info("restart no longer wanted (%s): serving again", decision.action)
            self._serve_again(seen)
        self.metrics.restart_pending.set(1 if seen.action in ("claim", "drain", "wait", "cooldown") else 0)

    def _take_turn(self, reason: str, detail: str, now: float, seen: Observation) -> None:
        """The restart once it is this host's turn in the fleet (always, alone): claim, drain, restart."""
        self.in_turn = True
        fleet = self.config.spec.fleet
        # A server that does not answer (hung, gone) is out of the rotation already: no turn to wait for.
        if fleet is None or not fleet.peers or not seen.up:
            self._drain_then_restart(reason, detail, now, seen)
            return
        peers = self.read_peers(fleet.peers)
        self.metrics.peers_ready.set(sum(1 for p in peers if p.ready))
        if reason == "decay" and self._fleet_decays(peers, seen):
            return
        verdict = restart_turn(fleet.host, fleet.min_ready, fleet.settle_seconds, peers, self.claimed, self.draining)
        if verdict.turn in ("wait", "yield"):
            if verdict.turn == "yield":
                log.warning("restart (%s): stopping the drain, serving again: %s", reason, verdict.detail)
            self._serve_again(seen, still_wanted=True)
            self._say(f"restart wanted ({reason}), not this host's turn yet: {verdict.detail}")
            seen.action = "wait"
        elif verdict.turn == "claim":
            self.claimed = True
            self.readiness.restart_wanted(reason, claim=True)
            self._say(f"restart wanted ({reason}): claiming the turn ({verdict.detail})")
            seen.action = "claim"
        elif verdict.turn == "hold":
            self._say(f"restart ({reason}) draining, not restarting yet: {verdict.detail}")
            seen.action = "drain"
        else:
            self._drain_then_restart(reason, detail, now, seen)

    def _fleet_decays(self, peers: list[Peer], seen: Observation) -> bool:
        """Most of the fleet decaying at once is the fleet's cause (a driver, CUDA, a library), not this host's:
        restarting every host would cure nothing. Hold, and let the alert call a human."""
        decaying = 1 + sum(1 for p in peers if p.wants == "decay")
        held = decaying > (len(peers) + 1) / 2
        self.metrics.fleet_decay.set(1 if held else 0)
        if held:
            self._serve_again(seen)
            self._say(
                f"decay on {decaying} of {len(peers) + 1} hosts of the fleet at once: not restarting (a restart "
                "cures one host's fragmentation, not a fleet-wide cause such as a driver or CUDA change)",
                level=logging.ERROR,
            )
            seen.action = "held"
        return held

    def _say(self, message: str, level: int = logging.INFO) -> None:
        """Log a turn's state once, not every poll of it."""
        if message != self.said:
            log.log(level, message)
            self.said = message

    def _drain_then_restart(self, reason: str, detail: str, now: float, seen: Observation) -> None:
        if not self.drain.active:
            log.warning(
                "restart wanted (%s): draining first (%d s, then requests in flight)", reason, self.drain.drain_seconds
            )
        self.draining = True
        self.readiness.set("draining")
        step = self.drain.step(now, seen.busy)
        if step != "restart":
            seen.action = step
            return
        waited = now - (self.drain.started or now)
        seen.action = "restart"
        self.restart(
            reason, detail if not seen.busy else f"still busy {waited:.0f} s into the drain (idle_timeout)", now
        )

    def _serve_again(self, seen: Observation, still_wanted: bool = False) -> None:
        self.drain.cancel()
        self.claimed = False
        self.in_turn = still_wanted
        if self.draining:
            self.draining = False
            self.readiness.set(None if seen.up and self.warm else "loading")

    def next_check_in(self) -> float:
        """Seconds until the next check: the interval, or sooner while a restart takes its turn or drains."""
        interval = float(self.config.spec.health.interval_seconds)
        return min(interval, DRAIN_POLL_SECONDS) if self.in_turn or self.draining else interval

    def restart(self, reason: str, detail: str, now: float) -> None:
        log.warning("restarting llama-server: %s (%s)", reason, detail)
        self.drain.cancel()
        self.draining = self.claimed = self.in_turn = False
        self.said = ""
        self.readiness.restart_wanted(None, claim=False)
        self.restart_log.append(now, reason)
        # Whatever its reason, this restart is the one a request asked for; gone before the restart may stop us.
        if self.requested is not None:
            self.requests.done()
            self.requested = None
        self.policy.restarted(now)
        self.metrics.restarts.labels(reason).inc()
        self.metrics.last_restart.set(now)
        if reason == "not_on_gpu":
            self.gpu_restart_done = True
        self.decay.after_restart()
        self.creep.after_restart()
        self.previous, self.warmed_up, self.hung_checks, self.low_headroom_checks = None, False, 0, 0
        self.warm = False
        self.last_tokens_at = now
        # Not ready until a check sees the restarted server answer /health again.
        self.readiness.set("restarting")
        try:
            self.control.restart(reason)
        except UnitError as exc:
            log.error("could not restart the server: %s", exc)

    # -- the loop --

    def run(self, stop: threading.Event, notifier: Notifier | None = None) -> int:
        notifier = notifier or Notifier()
        seen = self.check()
        notifier.ready(seen.status())
        log.info("first check: %s", seen.status())
        while self._wait_for_next_check(stop):
            seen = self.check()
            notifier.watchdog()
            notifier.status(seen.status())
            if seen.reason or seen.notes:
                log.info("check: %s", seen.status())
        notifier.stopping("stopping")
        return 0

    def _wait_for_next_check(self, stop: threading.Event) -> bool:
        """Until the next check is due, or sooner when a restart is asked for; False once stopped."""
        due = time.monotonic() + self.next_check_in()
        while not self.requests.pending():
            left = due - time.monotonic()
            if left <= 0:
                break
            if stop.wait(min(left, REQUEST_POLL_SECONDS)):
                return False
        return not stop.is_set()
