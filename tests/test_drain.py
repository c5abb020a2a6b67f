"""Drain-first restarts: not-ready first, drain_seconds for the balancer, requests in flight (idle_timeout at the
latest), restart, one warm-up completion, ready again. Driven by the daemon's fakes and fake clock
(tests/test_daemon_logic.py), and /ready read through the real exporter HTTP server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_daemon_logic import RATE, Rig, learn_baseline, make_spec
from test_ready import get

from appliance.health.daemon import DRAIN_POLL_SECONDS, WARMUP_PROMPT
from appliance.health.drain import Drain
from appliance.health.exporter import serve
from appliance.runtime.server_api import ServerUnreachable

DRAIN = 6
IDLE_TIMEOUT = 120
FLEET = {"host": "gpu-1", "peers": {}, "min_ready": 0, "drain_seconds": DRAIN}


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path, make_spec(tmp_path, fleet=FLEET, restart={"idle_timeout_seconds": IDLE_TIMEOUT}))


@pytest.fixture
def ready_url(rig: Rig) -> Iterator[str]:
    server = serve(rig.metrics, "127.0.0.1", 0, rig.daemon.readiness)
    yield f"http://127.0.0.1:{server.server_port}/ready"
    server.shutdown()
    server.server_close()


def decay(rig: Rig) -> str:
    """Slow windows until the decay verdict stands; the action of the check that first wants the restart."""
    learn_baseline(rig)
    for _ in range(7):
        seen = rig.check(0.7 * RATE)
        if seen.action != "none":
            return seen.action
    raise AssertionError("decay never wanted a restart")


def step(rig: Rig, seconds: float) -> str:
    rig.clock.advance(seconds)
    return rig.daemon.check().action


def test_a_decayed_host_drains_before_it_restarts_and_is_ready_after_a_warm_up(rig: Rig, ready_url: str) -> None:
    assert get(ready_url) == (503, "not ready: loading\n")  # nothing seen yet
    rig.check(None)
    assert get(ready_url) == (200, "ready\n")  # up, and its warm-up completion done
    assert decay(rig) == "drain"
    assert rig.control.restarts == []
    assert get(ready_url) == (503, "not ready: draining\n")
    assert rig.value("llm_appliance_draining") == 1 and rig.value("llm_appliance_restart_pending") == 1
    assert rig.daemon.next_check_in() == DRAIN_POLL_SECONDS
    assert step(rig, DRAIN - 1) == "drain"
    assert rig.control.restarts == []
    assert step(rig, 1) == "restart"
    assert rig.control.restarts == ["decay"]
    assert get(ready_url) == (503, "not ready: restarting\n")
    warmups = sum(1 for c in rig.api.completions if c[0] == WARMUP_PROMPT)
    rig.api.health_status = 503  # loading the model
    step(rig, 1)
    assert get(ready_url) == (503, "not ready: loading\n")
    rig.api.health_status = 200
    step(rig, 30)
    assert sum(1 for c in rig.api.completions if c[0] == WARMUP_PROMPT) == warmups + 1
    assert get(ready_url) == (200, "ready\n")
    assert rig.value("llm_appliance_draining") == 0 and rig.daemon.next_check_in() == 30


def test_requests_in_flight_are_waited_for_after_the_drain(rig: Rig) -> None:
    rig.api.processing = 1
    assert decay(rig) == "drain"
    assert step(rig, DRAIN) == "wait"
    assert step(rig, IDLE_TIMEOUT - 1) == "wait"
    rig.api.processing = 0
    assert step(rig, 0.5) == "restart"
    assert rig.control.restarts == ["decay"]


def test_a_host_busy_past_the_idle_timeout_is_restarted_anyway(rig: Rig) -> None:
    rig.api.processing = 3
    decay(rig)
    assert step(rig, DRAIN) == "wait"
    assert step(rig, IDLE_TIMEOUT - 1) == "wait"
    assert step(rig, 1) == "restart"


def test_a_failed_warm_up_keeps_the_host_out_until_one_succeeds(rig: Rig, ready_url: str) -> None:
    calls: list[str] = []
    completion = rig.api.completion

    def failing(prompt: str, n_predict: int, timeout: float = 600.0, **params: object) -> dict[str, object]:
        calls.append(prompt)
        if len(calls) == 1:
            raise ServerUnreachable("timed out")
        return completion(prompt, n_predict, timeout, **params)

    rig.api.completion = failing  # type: ignore[method-assign]
    rig.check(None)
    assert get(ready_url) == (503, "not ready: warming\n")
    rig.check(None)
    assert get(ready_url) == (200, "ready\n")
    assert calls == [WARMUP_PROMPT, WARMUP_PROMPT]


def test_a_single_appliance_restarts_at_once_when_idle(tmp_path: Path) -> None:
    # No [fleet]: no balancer to wait for, so the drain is empty and an idle server restarts in the same check.
    rig = Rig(tmp_path)
    assert decay(rig) == "restart"


def test_the_drain_on_its_own() -> None:
    drain = Drain(drain_seconds=4, idle_timeout_seconds=10)
    assert not drain.active and drain.remaining(100) == 0
    assert drain.step(100, busy=True) == "drain" and drain.remaining(101) == 3
    assert drain.step(104, busy=True) == "wait"
    assert drain.step(113.9, busy=True) == "wait"
    assert drain.step(114, busy=True) == "restart"
    drain.cancel()
    assert not drain.active
