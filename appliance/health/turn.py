"""The restart turn: from a wanted restart (the watch's reason, or one asked for by the timer or an admin) to
the restart itself, through the budget and cooldown (RestartPolicy), this host's turn in the fleet (the
min_ready guard, restart_turn; or, with [fleet] turns = "eviction", the cluster's answer to the eviction of this
pod, health/eviction.py), and the drain (Drain). A drain asked for (`llm-appliance drain`, a pod's preStop) or a
granted eviction ends it all: the host drains for good and restarts nothing, since it is going away. It owns the
state between checks: draining, the claim, the adopted request, what it last said; `step` moves it once per
check and returns what to do now.

The restart is the daemon's to carry out (it touches the server, the watch and the probe); `restarted` tells
the turn it happened. Readiness follows from the turn's state (`ready_reason`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from appliance.health.detectors import RestartPolicy
from appliance.health.drain import Drain, PeerClocks, restart_turn
from appliance.health.eviction import Evictor, NotInCluster
from appliance.health.exporter import Metrics, Readiness
from appliance.health.peers import Peer
from appliance.health.requests import DrainRequests, RestartRequest, RestartRequests
from appliance.health.watch import Observation
from appliance.plan.router import ReadyReason
from appliance.spec.model import Spec

log = logging.getLogger("llm-appliance.health")
# The actions after which a restart is still to come (restart_pending).
PENDING = ("claim", "drain", "wait", "cooldown")


# What a check does about a wanted restart (Action below says what each means).
ActionKind = Literal["none", "cooldown", "exhausted", "wait", "claim", "drain", "held", "restart", "evicted", "drained"]


@dataclass(frozen=True)
class Action:
    """What this check does about a wanted restart: "none", "cooldown" or "exhausted" (the policy), "wait" (for
    the fleet's turn or requests in flight), "claim", "drain", "held" (the fleet decays at once), "restart";
    "evicted" (the cluster restarts the pod: the restart is counted, not carried out); "drained" (drained for
    good)."""

    kind: ActionKind
    reason: str | None = None
    detail: str = ""


# A restart's loading and warm-up, beyond the drain and idle_timeout: past them a peer restarting is stuck.
LOAD_ALLOWANCE_SECONDS = 1800


# Restart reasons under which the server answers, slower than it should, until the restart cures it.
DEGRADED = ("decay", "not_on_gpu")


def ready_reason(seen: Observation, warm: bool, draining: bool, action: str, alone: bool = True) -> ReadyReason | None:
    """What /ready says after a check (whose restart turn did `action`): None (ready) or why not. `alone`: no
    fleet peers; a fleet host serves on, slow, until its turn, since its peers count it toward min_ready."""
    if action == "restart":
        return "restarting"  # until a check sees the restarted server answer /health again
    if draining:
        return "draining"
    if not seen.up:
        return "loading" if seen.health_status == 503 else "down"
    if not warm:
        return "warming"
    return "degraded" if alone and seen.reason in DEGRADED else None


class RestartTurn:
    def __init__(
        self,
        spec: Spec,
        requests: RestartRequests,
        metrics: Metrics,
        readiness: Readiness,
        evictor: Evictor | NotInCluster | None = None,
    ) -> None:
        restart, fleet = spec.restart, spec.fleet
        self.fleet = fleet
        self.requests, self.metrics, self.readiness = requests, metrics, readiness
        self.drains = DrainRequests(requests.request.parent)
        # With [fleet] turns = "eviction": the pod's evictor, or why the pod cannot ask (not in a cluster).
        self.evictor = evictor
        self.ask_again_every = float(spec.health.interval_seconds)
        self.ask_again_at = -math.inf
        # The drain for good (asked for, or after a granted eviction), and the drain requests it answers.
        self.leaving: Drain | None = None
        self.drain_asked: list[str] = []
        self.drained = False
        self.policy = RestartPolicy(restart.cooldown_seconds, restart.max_per_hour)
        self.drain = Drain(fleet.drain_seconds if fleet else 0, restart.idle_timeout_seconds)
        # A claim lasts a check (the next one drains); three of them, and a restart its drain and a load.
        self.clocks = PeerClocks(
            claim_seconds=3 * spec.health.interval_seconds + 30,
            turn_seconds=self.drain.drain_seconds + restart.idle_timeout_seconds + LOAD_ALLOWANCE_SECONDS,
        )
        self.draining = False
        # A restart taking its turn in the fleet (claimed, or waiting for one): the daemon polls meanwhile.
        self.in_turn = False
        self.claimed = False
        self.requested: RestartRequest | None = None
        self.said = ""

    def step(self, now: float, seen: Observation, read_peers: Callable[[Mapping[str, str]], list[Peer]]) -> Action:
        asked = self.drains.adopt()
        if asked is not None:
            self.drain_asked.append(asked)
            if self.leaving is None:
                self.leave(now, "asked for (`llm-appliance drain`, a pod's preStop)")
        if self.leaving is not None:
            action = self._go_on_leaving(now, seen.busy)
            seen.action = action.kind
            self.metrics.restart_pending.set(0)
            return action
        if seen.reason != "decay":
            self.metrics.fleet_decay.set(0)
        decision = self.policy.decide(now, seen.reason)
        self.metrics.restart_budget_exhausted.set(1 if self.policy.exhausted else 0)
        self.requested = self.requested or self.requests.adopt()
        # What the peers read: the restart this host wants (whatever the policy says of it), and its claim.
        wanted = self.requested.reason if self.requested else None
        self.readiness.restart_wanted(seen.reason or wanted, self.claimed)
        if decision.action == "exhausted":
            self._say(
                f"restart wanted ({decision.reason}) but not done: {decision.detail}; the server needs a human",
                level=logging.ERROR,
            )
        elif decision.action == "cooldown":
            log.info("restart wanted (%s): %s", decision.reason, decision.detail)
        # Asked for (the timer, an admin), a restart is not the policy's to refuse; it still takes its turn.
        if decision.action == "restart":
            action = self._take_turn(decision.reason, decision.detail, now, seen, read_peers)
        elif self.requested is not None:
            seen.reason = self.requested.reason
            action = self._take_turn(self.requested.reason, "asked for", now, seen, read_peers)
        else:
            if self.in_turn:
                log.info("restart no longer wanted (%s): serving again", decision.action)
                self._serve_again()
            action = Action(decision.action, decision.reason or None, decision.detail)
        seen.action = action.kind
        self.metrics.restart_pending.set(1 if action.kind in PENDING else 0)
        return action

    def _take_turn(
        self,
        reason: str,
        detail: str,
        now: float,
        seen: Observation,
        read_peers: Callable[[Mapping[str, str]], list[Peer]],
    ) -> Action:
        """The restart once it is this host's turn in the fleet (always, alone): claim, drain, restart."""
        self.in_turn = True
        fleet = self.fleet
        # A server that does not answer (hung, gone) is out of the rotation already: no turn to wait for.
        if fleet is None or not seen.up:
            return self._drain(reason, detail, now, seen.busy)
        if fleet.turns == "eviction":
            return self._evict(reason, detail, now, read_peers)
        if not fleet.peers:
            return self._drain(reason, detail, now, seen.busy)
        peers = self.clocks.judge(now, read_peers(fleet.peers))
        self.metrics.peers_ready.set(sum(1 for p in peers if p.ready))
        if reason == "decay" and self._fleet_decays(peers):
            return Action("held", reason)
        verdict = restart_turn(fleet.host, fleet.min_ready, fleet.settle_seconds, peers, self.claimed, self.draining)
        if verdict.turn in ("wait", "yield"):
            if verdict.turn == "yield":
                log.warning("restart (%s): stopping the drain, serving again: %s", reason, verdict.detail)
            self._serve_again(still_wanted=True)
            self._say(f"restart wanted ({reason}), not this host's turn yet: {verdict.detail}")
            return Action("wait", reason, verdict.detail)
        if verdict.turn == "claim":
            self.claimed = True
            self.readiness.restart_wanted(reason, claim=True)
            self._say(f"restart wanted ({reason}): claiming the turn ({verdict.detail})")
            return Action("claim", reason, verdict.detail)
        if verdict.turn == "hold":
            self._say(f"restart ({reason}) draining, not restarting yet: {verdict.detail}")
            return Action("drain", reason, verdict.detail)
        return self._drain(reason, detail, now, seen.busy)

    def _evict(
        self, reason: str, detail: str, now: float, read_peers: Callable[[Mapping[str, str]], list[Peer]]
    ) -> Action:
        """The cluster's turn: evict this pod, and the PodDisruptionBudget says whether the fleet can spare it now
        (granted: the kubelet drains the pod and the StatefulSet starts it again). Refused, serve on and ask again
        an interval later. The fleet-wide decay hold reads the peers the spec lists (the StatefulSet's pods by
        their stable names, this one among them), if it lists them."""
        assert self.fleet is not None
        if not isinstance(self.evictor, Evictor):
            self._say(f"restart wanted ({reason}) but this pod cannot ask for its turn: {self.evictor}", logging.ERROR)
            return Action("wait", reason, str(self.evictor))
        others = {name: url for name, url in self.fleet.peers.items() if name != self.evictor.pod}
        if reason == "decay" and others:
            peers = read_peers(others)
            self.metrics.peers_ready.set(sum(1 for p in peers if p.ready))
            if self._fleet_decays(peers):
                return Action("held", reason)
        if now < self.ask_again_at:
            return Action("wait", reason, "the cluster refused the eviction; asking again")
        answer = self.evictor.evict()
        self.metrics.evictions.labels(answer.outcome).inc()
        if answer.outcome == "granted":
            return Action("evicted", reason, f"{detail}; pod {self.evictor.pod} evicted ({answer.detail})")
        self.ask_again_at = now + self.ask_again_every
        level = logging.INFO if answer.outcome == "refused" else logging.ERROR
        self._say(
            f"restart wanted ({reason}), not this pod's turn yet: eviction {answer.outcome}, {answer.detail}", level
        )
        return Action("wait", reason, answer.detail)

    def leave(self, now: float, why: str) -> None:
        """Drain for good: not ready from now on, the balancer's drain_seconds, then until no request is in
        flight, with no idle_timeout (the drain command's timeout and the kubelet's grace period bound it)."""
        log.warning(
            "draining for good (%s): not ready from now on; %d s for the balancer, then the requests in flight",
            why,
            self.drain.drain_seconds,
        )
        self._serve_again()
        self.readiness.restart_wanted(None, claim=False)
        self.leaving = Drain(self.drain.drain_seconds, math.inf, started=now)
        self.draining = True

    def _go_on_leaving(self, now: float, busy: bool) -> Action:
        assert self.leaving is not None
        step = self.leaving.step(now, busy)
        if step != "restart":
            return Action(step)
        if not self.drained:
            log.info("drained: no request in flight; waiting to be stopped")
            self.drained = True
        for ident in self.drain_asked:
            self.drains.drained_for(ident)
        self.drain_asked.clear()
        return Action("drained")

    def _fleet_decays(self, peers: list[Peer]) -> bool:
        """Most of the fleet decaying at once is the fleet's cause (a driver, CUDA, a library), not this host's:
        restarting every host would cure nothing. Hold, and let the alert call a human."""
        decaying = 1 + sum(1 for p in peers if p.wants == "decay")
        held = decaying > (len(peers) + 1) / 2
        self.metrics.fleet_decay.set(1 if held else 0)
        if held:
            self._serve_again()
            self._say(
                f"decay on {decaying} of {len(peers) + 1} hosts of the fleet at once: not restarting (a restart "
                "cures one host's fragmentation, not a fleet-wide cause such as a driver or CUDA change)",
                level=logging.ERROR,
            )
        return held

    def _drain(self, reason: str, detail: str, now: float, busy: bool) -> Action:
        """Busy or not, a restart drains first: waiting for idle while still taking new requests would wait for
        ever behind a balancer. The drain waits for the requests in flight, idle_timeout at the latest."""
        if not self.drain.active:
            log.warning(
                "restart wanted (%s): draining first (%d s, then requests in flight)", reason, self.drain.drain_seconds
            )
        self.draining = True
        step = self.drain.step(now, busy)
        if step != "restart":
            return Action(step, reason)
        waited = now - (self.drain.started or now)
        return Action(
            "restart", reason, detail if not busy else f"still busy {waited:.0f} s into the drain (idle_timeout)"
        )

    def _serve_again(self, still_wanted: bool = False) -> None:
        self.drain.cancel()
        self.claimed = False
        self.in_turn = still_wanted
        self.draining = False

    def _say(self, message: str, level: int = logging.INFO) -> None:
        """Log a turn's state once, not every poll of it."""
        if message != self.said:
            log.log(level, message)
            self.said = message

    def restarted(self, now: float) -> None:
        """The restart happened: the turn is over, and whatever its reason, it is the one a request asked for
        (gone before the restart may stop the daemon)."""
        self.drain.cancel()
        self.draining = self.claimed = self.in_turn = False
        self.said = ""
        self.readiness.restart_wanted(None, claim=False)
        if self.requested is not None:
            self.requests.done()
            self.requested = None
        self.policy.restarted(now)
