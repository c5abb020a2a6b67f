"""The daemon's parts on their own: the probe's reading, the readiness function, the restart turn's steps.

The whole daemon is driven in test_daemon_logic.py; these pin each part's contract, with the same fakes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from test_daemon_logic import INTERVAL, FakeApi, FakeClock, FakeControl, make_spec

from appliance.facts.contention import CpuUse, contention
from appliance.health.exporter import Metrics, Readiness
from appliance.health.peers import Peer
from appliance.health.probe import (
    CANARY_PROMPT,
    CANARY_TOKENS,
    MIN_RATE_TOKENS,
    WARMUP_PROMPT,
    Saturation,
    ServerProbe,
    canary_timeout,
)
from appliance.health.requests import RestartRequests
from appliance.health.turn import RestartTurn, ready_reason
from appliance.health.watch import Observation
from appliance.runtime.server_api import ServerUnreachable


def probe_of(api: FakeApi, clock: FakeClock) -> ServerProbe:
    return ServerProbe(api, FakeControl(api), Metrics(CollectorRegistry()), clock, timeout=60)  # type: ignore[arg-type]


# -- the probe --


def test_the_probe_reads_a_window_of_traffic_after_one_warm_up() -> None:
    api, clock = FakeApi(), FakeClock()
    probe = probe_of(api, clock)
    first = probe.read(warm_up=True, canary_after=0, canary_timeout=5)
    assert first.up and first.window is None  # the first counters start the first window
    assert [c[0] for c in api.completions] == [WARMUP_PROMPT] and probe.warm
    api.decode(100.0, tokens=1000)
    api.slot_list = [{"n_prompt_tokens": 700, "next_token": [{"n_decoded": 300}]}]
    clock.advance()
    second = probe.read(warm_up=True, canary_after=0, canary_timeout=5)
    assert second.window is not None and second.window.decode_tps == pytest.approx(100.0)
    assert second.rated and second.context_tokens == 1000
    assert len(api.completions) == 1  # warmed up once


def test_a_few_tokens_are_not_a_rate_and_a_hung_health_check_is_told_from_a_refusal() -> None:
    api, clock = FakeApi(), FakeClock()
    probe = probe_of(api, clock)
    probe.read(warm_up=False, canary_after=0, canary_timeout=5)
    api.decode(1e6, tokens=MIN_RATE_TOKENS - 1)
    few = probe.read(warm_up=False, canary_after=0, canary_timeout=5)
    assert few.window is not None and not few.rated and few.context_tokens is None
    api.health_error = ServerUnreachable("GET /health: timed out")
    assert probe.read(warm_up=False, canary_after=0, canary_timeout=5).hung
    api.health_error = ServerUnreachable("GET /health: connection refused")
    refused = probe.read(warm_up=False, canary_after=0, canary_timeout=5)
    assert not refused.hung and not refused.up and refused.status is None


def test_the_canary_runs_only_on_an_idle_server_and_its_tokens_are_not_traffic() -> None:
    api, clock = FakeApi(), FakeClock()
    probe = probe_of(api, clock)
    probe.read(warm_up=False, canary_after=60, canary_timeout=5)
    clock.advance(61)
    api.processing = 1
    assert probe.read(warm_up=False, canary_after=60, canary_timeout=5).canary_tps is None  # busy: no canary
    api.processing = 0
    idle = probe.read(warm_up=False, canary_after=60, canary_timeout=5)
    assert idle.canary_tps == api.canary_tps and [c[0] for c in api.completions] == [CANARY_PROMPT]
    clock.advance(INTERVAL)
    after = probe.read(warm_up=False, canary_after=60, canary_timeout=5)
    assert after.window is not None and after.window.tokens == 0  # the next window starts after the canary
    assert after.canary_tps is None  # generated 30 s ago: not idle for 60 yet


# -- readiness --


@pytest.mark.parametrize(
    ("status", "warm", "draining", "action", "reason", "expected"),
    [
        (200, True, False, "none", None, None),
        (200, False, False, "none", None, "warming"),
        (200, True, True, "drain", None, "draining"),
        (503, False, False, "none", None, "loading"),
        (None, False, False, "none", None, "down"),
        (None, False, True, "drain", None, "draining"),
        (200, True, False, "restart", "decay", "restarting"),
        # Serving, slower than it should, until its restart: a router or balancer sends elsewhere meanwhile.
        (200, True, False, "wait", "decay", "degraded"),
        (200, True, False, "claim", "not_on_gpu", "degraded"),
        # A restart for VRAM creep or a schedule does not make the server slower meanwhile.
        (200, True, False, "wait", "creep", None),
        (200, True, False, "wait", "scheduled", None),
    ],
)
def test_ready_reason(
    status: int | None, warm: bool, draining: bool, action: str, reason: str | None, expected: str | None
) -> None:
    seen = Observation(up=status == 200, health_status=status, reason=reason)
    assert ready_reason(seen, warm, draining, action) == expected


def test_a_fleet_host_serves_on_slow_until_its_turn() -> None:
    """Its peers count it toward min_ready: out of the rotation early, it would leave the fleet short while
    another host takes its turn (and a fleet-wide decay would become an outage)."""
    seen = Observation(up=True, health_status=200, reason="decay")
    assert ready_reason(seen, True, False, "wait", alone=False) is None
    assert ready_reason(seen, True, True, "drain", alone=False) == "draining"


def test_saturated_is_every_slot_busy_and_more_queued_than_allowed_read_at_most_once_a_ttl() -> None:
    api, clock = FakeApi(), FakeClock()
    saturated = Saturation(api, parallel=2, max_queued=1, clock=clock, ttl=1.0)  # type: ignore[arg-type]
    api.processing, api.deferred = 2, 1
    assert not saturated()  # every slot busy, one queued: within what the spec allows
    api.deferred = 2
    assert not saturated()  # the answer of a moment ago holds for the ttl: a balancer's checks cost one read
    clock.advance(1.0)
    assert saturated()
    api.processing, api.deferred = 1, 5  # a free slot takes the next request at once, whatever the queue says
    clock.advance(1.0)
    assert not saturated()
    api.processing, api.deferred = 2, 5
    api.metrics_error = ServerUnreachable("timed out")
    clock.advance(1.0)
    assert not saturated()  # too busy to answer its gauges is the daemon's to judge, not /ready's guess


# -- the restart turn --


class Peers:
    def __init__(self, *peers: Peer) -> None:
        self.peers = list(peers)
        self.reads = 0

    def __call__(self, urls: Mapping[str, str]) -> list[Peer]:
        self.reads += 1
        return self.peers


def turn_of(tmp_path: Path, **sections: object) -> RestartTurn:
    spec = make_spec(tmp_path, **sections)
    metrics = Metrics(CollectorRegistry())
    return RestartTurn(spec, RestartRequests(tmp_path), metrics, Readiness(metrics))


def test_alone_a_wanted_restart_drains_for_the_requests_in_flight_then_restarts(tmp_path: Path) -> None:
    turn = turn_of(tmp_path)
    idle_timeout = turn.drain.idle_timeout_seconds
    peers = Peers()
    assert turn.step(0, Observation(up=True), peers).kind == "none"
    busy = Observation(up=True, busy=True, reason="decay")
    assert turn.step(10, busy, peers).kind == "wait" and turn.draining
    assert turn.step(10 + idle_timeout - 1, busy, peers).kind == "wait"
    action = turn.step(10 + idle_timeout, busy, peers)
    assert (action.kind, action.reason) == ("restart", "decay") and "still busy" in action.detail
    assert peers.reads == 0  # alone, no peers to read
    turn.restarted(10 + idle_timeout)
    assert not turn.draining and turn.policy.history == [10 + idle_timeout]
    cooldown = turn.step(20 + idle_timeout, Observation(up=True, reason="decay"), peers)
    assert cooldown.kind == "cooldown"


def test_in_a_fleet_the_turn_claims_first_and_waits_while_too_few_peers_serve(tmp_path: Path) -> None:
    fleet = {
        "host": "b",
        "peers": {"a": "http://a/ready", "c": "http://c/ready"},
        "key_file": "/etc/llm-appliance/fleet-key",
        "min_ready": 1,
        "drain_seconds": 10,
    }
    turn = turn_of(tmp_path, fleet=fleet)
    serving = Peer("a", True, ready_seconds=1e6)
    peers = Peers(serving, Peer("c", False, "down"))
    wanted = Observation(up=True, reason="creep")
    assert turn.step(0, wanted, peers).kind == "claim" and turn.claimed
    peers.peers = [Peer("a", False, "restarting"), Peer("c", False, "down")]
    assert turn.step(1, wanted, peers).kind == "wait" and not turn.claimed
    peers.peers = [serving, Peer("c", False, "down")]
    assert turn.step(2, wanted, peers).kind == "claim"
    assert turn.step(3, wanted, peers).kind == "drain" and turn.draining
    # No longer wanted: the drain ends and the host serves again.
    assert turn.step(4, Observation(up=True), peers).kind == "none"
    assert not turn.draining and not turn.in_turn


def test_a_fleet_decaying_at_once_is_held(tmp_path: Path) -> None:
    fleet = {
        "host": "b",
        "peers": {"a": "http://a/ready", "c": "http://c/ready"},
        "key_file": "/etc/llm-appliance/fleet-key",
        "min_ready": 1,
    }
    turn = turn_of(tmp_path, fleet=fleet)
    peers = Peers(Peer("a", True, ready_seconds=1e6, wants="decay"), Peer("c", True, ready_seconds=1e6))
    assert turn.step(0, Observation(up=True, reason="decay"), peers).kind == "held"
    assert turn.metrics.fleet_decay._value.get() == 1  # type: ignore[attr-defined]


# -- the canary's timeout --


def test_the_canary_may_take_as_long_as_a_quarter_of_a_decayed_rate_within_the_interval(tmp_path: Path) -> None:
    health = make_spec(tmp_path).health  # interval 30, probe timeout 5, decay_ratio 0.8
    assert canary_timeout(health, None) == 0.8 * health.interval_seconds  # no baseline: the check's share
    slowest = 53 * health.decay_ratio / 4
    assert canary_timeout(health, 53) == pytest.approx(health.probe_timeout_seconds + CANARY_TOKENS / slowest)
    assert canary_timeout(health, 1) == 0.8 * health.interval_seconds  # capped: a check ends before the next


# -- what else used the machine --


def cpu_use(
    total: float, busy: float, processes: dict[int, tuple[str, float]], **threads: tuple[float, float]
) -> CpuUse:
    return CpuUse(total, busy, processes, {int(tid.removeprefix("t")): v for tid, v in threads.items()})


def test_contention_is_the_others_share_of_all_cpus_with_the_top_consumer_and_our_wait() -> None:
    # 2 CPUs for 10 s: 20 CPU-seconds. The server (pid 10) used 6, a hog (pid 20) 9, a shell (pid 30) 1.
    before = cpu_use(100, 50, {10: ("llama-server", 5), 20: ("stress", 1), 30: ("bash", 2)}, t10=(5, 1), t11=(3, 0))
    after = cpu_use(120, 66, {10: ("llama-server", 11), 20: ("stress", 10), 30: ("bash", 3)}, t10=(8, 4), t11=(6, 3))
    found = contention(before, after, {10})
    assert found is not None
    assert found.share == pytest.approx(10 / 20)
    assert (found.top, found.top_share) == ("stress[20] 45%", pytest.approx(9 / 20))
    assert found.waited == pytest.approx(6 / 12)  # runnable 12 s: ran 6, waited 6
    assert "50% of the CPUs" in found.describe() and "stress[20]" in found.describe()
    assert contention(None, after, {10}) is None and contention(after, after, {10}) is None


def test_a_process_that_started_in_between_counts_with_all_its_time() -> None:
    before = cpu_use(100, 10, {10: ("llama-server", 5)})
    after = cpu_use(120, 25, {10: ("llama-server", 10), 40: ("cc1plus", 9)})
    found = contention(before, after, {10})
    assert found is not None and found.top == "cc1plus[40] 45%" and found.waited is None


def test_the_real_proc_sees_a_busy_child_as_another_process() -> None:
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        before = CpuUse.read({os.getpid()})
        deadline = time.monotonic() + 60
        while True:  # until the hog has used a CPU-second: the event, not a guess of how long that takes
            after = CpuUse.read({os.getpid()})
            assert before is not None and after is not None
            if after.processes.get(hog.pid, ("", 0.0))[1] - before.processes.get(hog.pid, ("", 0.0))[1] >= 1:
                break
            assert time.monotonic() < deadline, "the hog never ran"
            time.sleep(0.2)
        found = contention(before, after, {os.getpid()})
        hog_share = (after.processes[hog.pid][1] - before.processes.get(hog.pid, ("", 0.0))[1]) / (
            after.total - before.total
        )
        # The hog is another's (other work on this machine may be busier still: the top is not asserted).
        assert found is not None and found.share >= hog_share * 0.9 > 0
        assert any(tid == os.getpid() for tid in after.threads)  # our own threads' schedstat was read
    finally:
        hog.kill()
        hog.wait()
