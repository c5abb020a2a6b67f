"""/ready on the health exporter, through the real HTTP server: 200 when llama-server is up and not draining,
503 with the reason otherwise; /metrics still served beside it, with the ready and draining gauges."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from appliance.health.exporter import NOT_READY, Metrics, Readiness, serve


@pytest.fixture
def exporter() -> Iterator[tuple[str, Readiness]]:
    metrics = Metrics(CollectorRegistry())
    readiness = Readiness(metrics)
    server = serve(metrics, "127.0.0.1", 0, readiness)
    yield f"http://127.0.0.1:{server.server_port}", readiness
    server.shutdown()
    server.server_close()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_fresh_daemon_is_not_ready_until_a_check_saw_the_server(exporter: tuple[str, Readiness]) -> None:
    url, _ = exporter
    assert get(f"{url}/ready") == (503, "not ready: loading\n")


@pytest.mark.parametrize("reason", NOT_READY)
def test_not_ready_answers_503_with_the_reason(exporter: tuple[str, Readiness], reason: str) -> None:
    url, readiness = exporter
    readiness.set(None)
    assert get(f"{url}/ready") == (200, "ready\n")
    readiness.set(reason)
    assert get(f"{url}/ready") == (503, f"not ready: {reason}\n")


def test_metrics_are_still_served_with_the_ready_and_draining_gauges(exporter: tuple[str, Readiness]) -> None:
    url, readiness = exporter
    readiness.set("draining")
    status, text = get(f"{url}/metrics")
    assert status == 200
    assert "llm_appliance_ready 0.0" in text and "llm_appliance_draining 1.0" in text
    readiness.set(None)
    _, text = get(f"{url}/metrics")
    assert "llm_appliance_ready 1.0" in text and "llm_appliance_draining 0.0" in text


def test_an_unknown_reason_is_a_bug() -> None:
    with pytest.raises(AssertionError):
        Readiness(Metrics(CollectorRegistry())).set("sleepy")
