"""What the readings mean: the decode rate against its baseline, speculation's gain, the server's VRAM creep,
headroom, a hang, the server off its GPU, the versions against the pins and the baseline. It turns one check's
readings into an `Observation`: the figures for the STATUS line and the exporter, and the reason a restart is
wanted, if any.

It keeps the detectors' state from check to check; it restarts nothing (appliance.health.turn does, in turn).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from appliance.facts.contention import Contention
from appliance.facts.energy_meters import EnergyMeter
from appliance.health import versions
from appliance.health.detectors import (
    CANARY_BUCKET,
    CreepDetector,
    DecayDetector,
    PayingTracker,
    context_bucket,
    speculation,
    speedup,
)
from appliance.health.energy_probe import EnergyProbe
from appliance.health.exporter import Metrics
from appliance.health.probe import GpuReading, Reading
from appliance.plan.resolved import Appliance

log = logging.getLogger("llm-appliance.health")


@dataclass
class Observation:
    """What one check saw, for the STATUS line and the tests."""

    up: bool = False
    busy: bool = False
    health_status: int | None = None  # what /health answered; None: no answer
    decode_tps: float | None = None
    baseline_tps: float | None = None
    acceptance: float | None = None
    creep: float | None = None
    contended: str | None = None  # what else used the machine, when it was enough to discount this check's samples
    reason: str | None = None
    action: str = "none"  # the turn's ActionKind (health/turn.py)
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
        if self.contended is not None:
            parts.append(f"contended: {self.contended}")
        if self.action not in ("none",):
            parts.append(f"restart {self.action} ({self.reason})")
        return ", ".join(parts + self.notes)

    def want(self, reason: str) -> None:
        """The first reason found in a check is the one the restart gives."""
        self.reason = self.reason or reason


class Watch:
    def __init__(self, appliance: Appliance, metrics: Metrics, energy: list[EnergyMeter]) -> None:
        health = appliance.spec.health
        self.appliance, self.metrics = appliance, metrics
        self.decay = DecayDetector(health.decay_ratio, health.consecutive, health.baseline_windows)
        self.creep = CreepDetector(health.creep_ratio, health.consecutive)
        self.paying = PayingTracker(health.speculation_min_speedup)
        self.energy = EnergyProbe(energy, metrics)
        self.no_speculation: dict[str, float] = {}
        self.baseline_versions: dict[str, str | None] | None = None
        # The server has generated something since its (re)start: its VRAM and GPU placement mean something.
        self.warmed_up = False
        self.hung_checks = 0
        self.low_headroom_checks = 0
        # Restarting the server restarts this daemon (BindsTo=): the one not_on_gpu restart must hold across it.
        self.gpu_restart_done = False
        self.xids_seen: dict[int, int] = {}
        self.contended_since: float | None = None
        self.contended_samples = 0

    def load_baseline(self, path: Path) -> None:
        baseline = versions.Baseline.read(path)
        if baseline is None:
            return
        self.decay.baselines.update(baseline.decode_tps)
        self.baseline_versions = baseline.versions
        self.no_speculation = baseline.no_speculation_tps
        for bucket, rate in self.no_speculation.items():
            self.metrics.decode_no_speculation.labels(bucket).set(rate)
        log.info("decode baselines from %s: %s", path, baseline.decode_tps)

    def after_restart(self, reason: str) -> None:
        if reason == "not_on_gpu":
            self.gpu_restart_done = True
        self.decay.after_restart()
        self.creep.after_restart()
        self.warmed_up, self.hung_checks, self.low_headroom_checks = False, 0, 0

    # -- what else used the machine --

    def contention(self, cpu: Contention | None, gpu_share: float | None, now: float, seen: Observation) -> None:
        """Whether this check's samples were taken on a shared box: other processes used more than
        contention_max_share of the CPUs and kept the server waiting for one as long, or of its GPUs. Logged
        once per episode, with the top consumer; the samples meanwhile are counted, not judged."""
        limit = self.appliance.spec.health.contention_max_share
        if cpu is not None:
            self.metrics.contention.labels("cpu").set(cpu.share)
        if gpu_share is not None:
            self.metrics.contention.labels("gpu").set(gpu_share)
        cpu_contended = cpu is not None and cpu.share > limit and (cpu.waited or 0.0) > limit
        gpu_contended = gpu_share is not None and gpu_share > limit
        if cpu_contended and cpu is not None:
            seen.contended = cpu.describe()
        elif gpu_contended:
            seen.contended = f"other processes used {gpu_share:.0%} of the server's GPU"
        self.metrics.contended.set(1 if seen.contended else 0)
        if seen.contended and self.contended_since is None:
            self.contended_since, self.contended_samples = now, 0
            log.warning(
                "the box is shared: %s; decode samples are not counted toward decay while it lasts", seen.contended
            )
        elif not seen.contended and self.contended_since is not None:
            log.info(
                "contention over after %.0f s (%d decode samples not counted toward decay)",
                now - self.contended_since,
                self.contended_samples,
            )
            self.contended_since = None

    # -- the server --

    def server(self, reading: Reading, seen: Observation) -> None:
        seen.up, seen.busy, seen.health_status = reading.up, reading.busy, reading.status
        self.metrics.unit_active.set(1 if reading.unit_active else 0)
        self.metrics.server_up.set(1 if reading.up else 0)
        # A health check that timed out on a shared box may be the neighbour's doing: it counts for nothing.
        if not (reading.hung and seen.contended):
            self.hung_checks = self.hung_checks + 1 if reading.hung else 0
        w = reading.window
        if reading.counted:
            self.metrics.requests_processing.set(reading.processing)
            if w is None:
                self.energy.mark()
            else:
                self.energy.window(w.tokens)
        if w is not None and w.tokens > 0:
            self.warmed_up = True
            if reading.rated and w.decode_tps is not None:
                self._record_rate(context_bucket(reading.context_tokens), w.decode_tps, seen)
            self.metrics.drafted.inc(max(w.drafted, 0))
            self.metrics.accepted.inc(max(w.accepted, 0))
            verdict = speculation(
                self.appliance.speculation, self.appliance.draft_in_use, w, self.appliance.spec.health.acceptance_min
            )
            if verdict.engaged is not None:
                self.metrics.speculation_engaged.set(1 if verdict.engaged else 0)
                if not verdict.engaged:
                    seen.notes.append("SPECULATION NOT ENGAGED")
            if verdict.acceptance is not None:
                seen.acceptance = verdict.acceptance
                self.metrics.acceptance.set(verdict.acceptance)
        if reading.canary_tps is not None:
            self.energy.mark()
            self.warmed_up = True
            self._judge_canary(reading.canary_tps, seen)
            if reading.canary_tps > 0:
                self._record_rate(CANARY_BUCKET, reading.canary_tps, seen)

    def _judge_canary(self, rate: float, seen: Observation) -> None:
        """A slow canary is a sample (of decay, or of a shared box), told apart from one that failed."""
        baseline = self.decay.baselines.get(CANARY_BUCKET)
        slow = baseline is not None and rate < self.appliance.spec.health.decay_ratio * baseline
        self.metrics.canaries.labels("slow" if slow else "ok").inc()
        if slow:
            log.info(
                "canary slow: %.1f tok/s against a baseline of %.1f%s",
                rate,
                baseline,
                f" ({seen.contended}: not counted)" if seen.contended else "",
            )

    def _record_rate(self, bucket: str, rate: float, seen: Observation) -> None:
        if seen.contended:
            self.contended_samples += 1
            self.metrics.contended_samples.inc()
            seen.decode_tps, seen.baseline_tps = rate, self.decay.baselines.get(bucket)
            return
        self.decay.add(bucket, rate)
        seen.decode_tps = self.decay.current(bucket) or rate
        seen.baseline_tps = self.decay.baselines.get(bucket)
        self.metrics.decode_tps.labels(bucket).set(seen.decode_tps)
        if seen.baseline_tps:
            self.metrics.decode_baseline.labels(bucket).set(seen.baseline_tps)
        self.metrics.decay_breaches.labels(bucket).set(self.decay.breaches.get(bucket, 0))
        if self.appliance.speculation:
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
                self.appliance.spec_file,
            )
        elif change == "recovered":
            log.info("speculation pays again in %s: %.2fx the rate without it", bucket, gain)

    # -- the GPUs --

    def gpus(self, reading: GpuReading, seen: Observation) -> None:
        if reading.gpus is None:
            self.metrics.gpu_visible.set(0)
            if self.appliance.on_gpu:  # on a CPU spec no NVML is expected, not an error
                self.metrics.probe_errors.labels("nvml").inc()
                seen.notes.append(f"GPU not visible ({reading.error})")
            return
        self.metrics.gpu_visible.set(1)
        low = False
        for gpu in reading.gpus:
            self.metrics.gpu_total.labels(gpu.device).set(gpu.total_bytes)
            self.metrics.gpu_used.labels(gpu.device).set(gpu.used_bytes)
            self.metrics.gpu_free.labels(gpu.device).set(gpu.free_bytes)
            # Only the server's GPUs: another workload filling another GPU is no reason to restart it.
            low = low or (
                gpu.device in self.appliance.server_devices and gpu.free_bytes < self.appliance.min_free_bytes
            )
            errors, before = reading.xid_errors.get(gpu.index, 0), self.xids_seen.get(gpu.index, 0)
            if errors > before:
                self.metrics.xid_errors.labels(gpu.device).inc(errors - before)
                self.xids_seen[gpu.index] = errors
        self.low_headroom_checks = self.low_headroom_checks + 1 if low and seen.up else 0
        if self.low_headroom_checks >= self.appliance.spec.health.consecutive:
            seen.want("headroom")
        used = reading.server_vram
        if used is None:
            return
        self.metrics.server_vram.set(used)
        self.metrics.server_on_gpu.set(1 if used > 0 else 0)
        if seen.up and self.warmed_up and used == 0:
            seen.notes.append("server is NOT on the GPU")
            if not self.gpu_restart_done:
                seen.want("not_on_gpu")
        if self.creep.add(used, seen.up and self.warmed_up):
            seen.want("creep")
        if self.creep.baseline:
            seen.creep = self.creep.creep(used)
            self.metrics.server_vram_baseline.set(self.creep.baseline)
            self.metrics.creep.set(seen.creep)

    # -- the versions --

    def versions(self, found: versions.Found, seen: Observation) -> None:
        self.metrics.version.info(
            {k: v or "unknown" for k, v in {**found.comparable(), "llama_cpp_python": found.llama_cpp_python}.items()}
        )
        problems = versions.mismatches(self.appliance.spec.versions, found)
        self.metrics.version_mismatch.set(1 if problems else 0)
        if problems:
            seen.notes.append("version mismatch: " + "; ".join(problems))
        if self.baseline_versions is None:
            self.baseline_versions = found.comparable()
        changed = versions.drift(self.baseline_versions, found)
        self.metrics.version_drift.set(1 if changed else 0)
        if changed:
            seen.notes.append("versions changed since the baseline (" + ", ".join(changed) + "); baseline stale")

    def verdict(self, seen: Observation) -> None:
        """The restarts wanted whatever this check's readings: verdicts are states, not events, and a wanted
        restart stays wanted across checks without new windows."""
        # On a shared box a restart cures nothing: the neighbour is an operator's problem (LlmApplianceBoxShared).
        if self.decay.breached() and not seen.contended:
            seen.want("decay")
        if self.hung_checks >= self.appliance.spec.health.consecutive:
            seen.want("hang")
