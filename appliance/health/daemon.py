"""The health daemon: every interval, probe the server, the GPU and the versions; feed the detectors;
restart the server when it must (idle-aware, rate-limited); export everything to Prometheus.

It never restarts the server because its own probe failed: a probe error is counted and reported, and
only a server that is seen to be slow, swollen, hung or off the GPU is restarted.

This module is the loop and the wiring. Its parts, each tested on its own:
- probe.py reads (ServerProbe: /health, warm-up, /metrics as a window, /slots, the canary; read_gpus: NVML;
  CpuProbe: what else used the CPUs),
- watch.py judges (Watch: the detectors' state, the metrics, an Observation with the reason wanted),
- turn.py restarts in turn (RestartTurn: the policy, the fleet's turn, the drain; ready_reason: /ready).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from appliance.facts.energy_meters import EnergyMeter, meters_for
from appliance.facts.engine_record import EngineRecord, record_file
from appliance.facts.gpu import Nvml
from appliance.facts.keys import read_fleet_key
from appliance.health import versions
from appliance.health.detectors import CANARY_BUCKET
from appliance.health.eviction import Evictor, InCluster, NotInCluster
from appliance.health.exporter import Metrics, Readiness
from appliance.health.peers import PeerReader, reader
from appliance.health.probe import (
    CANARY_PROMPT,
    WARMUP_PROMPT,
    CpuProbe,
    Saturation,
    ServerProbe,
    canary_timeout,
    own_processes,
    read_gpus,
)
from appliance.health.requests import RestartRequests
from appliance.health.state import RestartLog
from appliance.health.turn import RestartTurn, ready_reason
from appliance.health.units import ServerControl, UnitError
from appliance.health.watch import Observation, Watch
from appliance.plan.resolved import Appliance
from appliance.plan.router import NOT_READY
from appliance.runtime.notify import Notifier
from appliance.runtime.server_api import ServerApi, read_api_key
from appliance.spec.model import Spec
from appliance.system import paths

__all__ = ["CANARY_PROMPT", "WARMUP_PROMPT", "DaemonConfig", "HealthDaemon", "Observation"]
log = logging.getLogger("llm-appliance.health")
# While draining, checks come this often (at most): the drain ends, and idle is seen, within this much.
DRAIN_POLL_SECONDS = 1.0
# A peer's /ready answers at once or the peer does not count: the guard must not stall the drain's polls.
PEER_TIMEOUT_SECONDS = 1.0
# How often the loop looks for a restart request between checks (one stat of a file).
REQUEST_POLL_SECONDS = 1.0
# /ready's live look at the slots: a balancer's check must not wait on a server too busy to answer its gauges.
SATURATION_TIMEOUT_SECONDS = 0.5


def retry_after(spec: Spec) -> dict[str, int]:
    """Retry-After of /ready's 503, by reason: about when asking again can find the host ready. A slot frees
    within seconds; a drain lasts its drain and the requests in flight; the rest resolve at a later check."""
    drain = (spec.fleet.drain_seconds if spec.fleet else 0) + spec.restart.idle_timeout_seconds
    seconds: dict[str, int] = dict.fromkeys(NOT_READY, max(1, spec.health.interval_seconds))
    seconds.update(saturated=1, draining=max(1, drain))
    return seconds


@dataclass(frozen=True)
class DaemonConfig:
    """The applied appliance the daemon watches, and where the engine's manifest is."""

    appliance: Appliance
    engine_dir: Path = paths.ENGINE_DIR

    @property
    def spec(self) -> Spec:
        return self.appliance.spec


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
        cpu: CpuProbe | None = None,
        evictor: Evictor | None = None,
    ) -> None:
        appliance, health = config.appliance, config.spec.health
        self.config, self.control, self.nvml, self.clock = config, control, nvml, clock
        self.metrics = metrics or Metrics()
        # What /ready says to a balancer; the exporter serves the same object.
        self.readiness = readiness or Readiness(self.metrics)
        fleet = config.spec.fleet
        # The fleet's key: this host proves its /ready with it, and believes no peer's that does not.
        fleet_key = read_fleet_key(fleet.key_file) if fleet and fleet.key_file else None
        if fleet and fleet_key:
            self.readiness.prove_with(fleet_key, fleet.host)
        timeout_peers = min(PEER_TIMEOUT_SECONDS, health.probe_timeout_seconds)
        self.read_peers = peers or reader(timeout=timeout_peers, key=fleet_key)
        self.requests = RestartRequests(appliance.state_file.parent)
        key = read_api_key(appliance.api_key_file)
        timeout = min(health.probe_timeout_seconds, 0.8 * health.interval_seconds)
        # The server runs as this daemon's user: the key goes to no other user's listener on its port.
        self.api = api or ServerApi(appliance.server.url, key, timeout=timeout, listener_uid=os.geteuid())
        self.probe = ServerProbe(self.api, control, self.metrics, clock, timeout=health.probe_timeout_seconds)
        self.cpu = cpu or CpuProbe()
        meters = meters_for(appliance.server_devices, nvml) if energy is None else energy
        self.watch = Watch(appliance, self.metrics, list(meters))
        evicts = fleet is not None and fleet.turns == "eviction"
        self.turn = RestartTurn(
            config.spec, self.requests, self.metrics, self.readiness, (evictor or _evictor()) if evicts else None
        )
        # A drain is the running daemon's (requests.py): one a previous daemon left is not this one's to do.
        self.turn.drains.forget()
        # A fleet host's balancer queues for it (maxconn = its slots), and its peers count its /ready toward
        # min_ready: saturation and degradation are a lone appliance's to say (to a router in front of it).
        self.alone = not (fleet and (fleet.peers or evicts))
        live = ServerApi(appliance.server.url, key, timeout=SATURATION_TIMEOUT_SECONDS, listener_uid=os.geteuid())
        saturation = Saturation(live, config.spec.server.parallel, health.ready_max_queued) if self.alone else None
        self.readiness.refuse_when_saturated(saturation, retry_after(config.spec))
        self.restart_log = RestartLog(appliance.state_file)
        export_engine_regression(self.metrics, engine_record(appliance), health.engine_regression)
        self.metrics.draft_in_use.set(1 if appliance.draft_in_use else 0)
        self.metrics.speculation_configured.set(1 if appliance.speculation else 0)
        self.metrics.speculation_engaged.set(1)
        self.watch.load_baseline(appliance.baseline_file)
        self._load_restarts()

    def _load_restarts(self) -> None:
        """The restarts before this daemon started: a server restart restarts the daemon bound to it."""
        restarts = self.restart_log.read()
        self.turn.policy.history = [t for t, _ in restarts if self.clock() - t < 3600]
        self.watch.gpu_restart_done = bool(restarts) and restarts[-1][1] == "not_on_gpu"
        for reason, total in self.restart_log.totals().items():
            self.metrics.restarts.labels(reason).inc(total)
        if restarts:
            self.metrics.last_restart.set(restarts[-1][0])

    # -- one check --

    def check(self) -> Observation:
        started = time.monotonic()
        seen = Observation()
        try:
            self.watch.energy.read()  # every check, the server up or not: the counter counts what the machine draws
            health, appliance = self.config.spec.health, self.config.appliance
            timeout = canary_timeout(health, self.watch.decay.baselines.get(CANARY_BUCKET))
            server = self.probe.read(not self.turn.draining, health.canary_after_idle_seconds, timeout)
            # What else used the machine since the last check: the samples just read were taken meanwhile.
            ours = own_processes(self.probe.main_pid())
            gpus = read_gpus(self.nvml, ours if appliance.on_gpu else None, appliance.server_devices, self.metrics)
            now = self.clock()
            self.watch.contention(self.cpu.read(ours), gpus.others_share, now, seen)
            self.watch.server(server, seen)
            self.watch.gpus(gpus, seen)
            self.watch.versions(versions.detect(self.nvml, self.config.engine_dir), seen)
            self.watch.verdict(seen)
            action = self.turn.step(now, seen, self.read_peers)
            if action.kind in ("restart", "evicted"):
                self.restart(action.reason or "unknown", action.detail, now, by_cluster=action.kind == "evicted")
            self.readiness.set(ready_reason(seen, self.probe.warm, self.turn.draining, action.kind, self.alone))
        except Exception:  # the daemon must outlive any surprise; say what happened and carry on
            log.exception("health check failed")
            self.metrics.probe_errors.labels("check").inc()
        self.metrics.check_duration.set(time.monotonic() - started)
        return seen

    def restart(self, reason: str, detail: str, now: float, by_cluster: bool = False) -> None:
        """Restart the server; `by_cluster`: its pod was evicted, so the kubelet stops it and the StatefulSet
        starts it again: counted and logged the same, carried out by the cluster while this daemon drains."""
        log.warning("restarting llama-server: %s (%s)", reason, detail)
        self.turn.restarted(now)
        self.restart_log.append(now, reason)
        self.metrics.restarts.labels(reason).inc()
        self.metrics.last_restart.set(now)
        if by_cluster:
            self.turn.leave(now, "the pod was evicted; the cluster restarts it")
            return
        self.watch.after_restart(reason)
        self.probe.after_restart(now)
        # Not ready until a check sees the restarted server answer /health again.
        self.readiness.set("restarting")
        try:
            self.control.restart(reason)
        except UnitError as exc:
            log.error("could not restart the server: %s", exc)

    def next_check_in(self) -> float:
        """Seconds until the next check: the interval, or sooner while a restart takes its turn or drains."""
        interval = float(self.config.spec.health.interval_seconds)
        return min(interval, DRAIN_POLL_SECONDS) if self.turn.in_turn or self.turn.draining else interval

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
        while not self._asked():
            left = due - time.monotonic()
            if left <= 0:
                break
            if stop.wait(min(left, REQUEST_POLL_SECONDS)):
                return False
        return not stop.is_set()

    def _asked(self) -> bool:
        """A drain asked for; or a restart, unless draining for good (it is not carried out, and would wake
        every poll)."""
        return self.turn.drains.pending() or (self.turn.leaving is None and self.requests.pending())


def export_engine_regression(metrics: Metrics, record: EngineRecord | None, band: float) -> None:
    """Exported once at start: the engine's proof judged its last change (facts/engine_record.py); a slower
    engine is said in the log, and restarts nothing (a restart cannot cure a slower driver)."""
    ratio = record.regression_ratio if record is not None else None
    change = record.change_summary() if record is not None else ""
    metrics.engine_regression.labels(change=change).set(ratio if ratio is not None else 1.0)
    if ratio is not None and ratio < 1 - band:
        log.error("ENGINE REGRESSED: %s (health.engine_regression %.2f); restarts do not cure it", change, band)
    elif change:
        log.info("engine changed since its last proof: %s", change)


def engine_record(appliance: Appliance, engine_dir: Path = paths.ENGINE_DIR) -> EngineRecord | None:
    """The proof of the engine the appliance runs (readable inside the units' sandbox: /opt is read-only there)."""
    return EngineRecord.read(record_file(Path(appliance.binary), engine_dir))


def _evictor() -> Evictor | NotInCluster:
    try:
        return Evictor(InCluster.from_env())
    except NotInCluster as exc:
        log.error("%s", exc)
        return exc
