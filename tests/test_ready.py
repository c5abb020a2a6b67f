"""/ready on the health exporter, through the real HTTP server: 200 when llama-server is up and not draining,
503 with the reason and a Retry-After otherwise; /metrics still served beside it, with the ready and draining
gauges; and the real demo saying it is saturated while a request waits for its one slot."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import UpProcess
from prometheus_client import CollectorRegistry
from test_health_daemon import REQUEST_SECONDS, fast_demo, wait_ready, wait_until
from test_launch import LOAD_SECONDS, free_port

from appliance.health import serving
from appliance.health.exporter import Metrics, Readiness, serve
from appliance.plan.router import NOT_READY
from appliance.runtime.server_api import ServerApi, Streamed


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


def _half_sent(port: int, count: int) -> list[socket.socket]:
    """The attack: connections that send half a request head, and wait."""
    held = []
    for _ in range(count):
        connection = socket.create_connection(("127.0.0.1", port), timeout=5)
        connection.sendall(b"GET /ready HTTP/1.1\r\nHost: the-exporter\r\n")  # no blank line: no end to the head
        held.append(connection)
    return held


def _closed_by_the_server(connection: socket.socket) -> bool:
    connection.setblocking(True)  # with a timeout, Python would wait for data before MSG_DONTWAIT counts
    try:
        return connection.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:  # still open, nothing sent
        return False
    except ConnectionResetError:
        return True


def test_half_sent_requests_hold_no_thread_and_ready_still_answers(exporter: tuple[str, Readiness]) -> None:
    """300 half-sent requests held 302 threads of the old exporter, and past the file limit /ready died: now they
    hold no thread, the oldest past serving.MAX_READING are closed, and /ready answers at once beside them."""
    url, readiness = exporter
    readiness.set(None)
    before = threading.active_count()
    held = _half_sent(int(url.rsplit(":", 1)[1]), 300)
    try:
        time.sleep(0.5)
        assert threading.active_count() <= before + serving.WORKERS
        started = time.monotonic()
        assert get(f"{url}/ready") == (200, "ready\n")
        assert time.monotonic() - started < 2
        assert get(f"{url}/metrics")[0] == 200
        assert threading.active_count() <= before + serving.WORKERS
        time.sleep(0.2)
        # The oldest made room for the newest (the two requests beside them too).
        closed = [_closed_by_the_server(c) for c in held]
        assert all(closed[: 300 - serving.MAX_READING]), closed
        assert not any(closed[-200:]), closed
    finally:
        for connection in held:
            connection.close()


def test_a_head_that_does_not_end_is_closed_in_time(
    exporter: tuple[str, Readiness], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serving, "HEAD_SECONDS", 1.0)
    url, _ = exporter
    (held,) = _half_sent(int(url.rsplit(":", 1)[1]), 1)
    try:
        started = time.monotonic()
        held.settimeout(5)
        assert held.recv(1) == b""  # closed, unanswered
        assert 0.5 < time.monotonic() - started < 3
    finally:
        held.close()


def test_an_unknown_reason_is_a_bug() -> None:
    with pytest.raises(AssertionError):
        Readiness(Metrics(CollectorRegistry())).set("sleepy")


def get_retry_after(url: str) -> tuple[int, str | None]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.headers.get("Retry-After")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Retry-After")


def test_a_503_says_when_to_ask_again_and_a_saturated_server_is_asked_live(exporter: tuple[str, Readiness]) -> None:
    url, readiness = exporter
    asked: list[bool] = []
    saturated = False

    def slots_full() -> bool:
        asked.append(saturated)
        return saturated

    readiness.refuse_when_saturated(slots_full, {"saturated": 1, "draining": 40, "loading": 10})
    readiness.set("draining")
    assert get_retry_after(f"{url}/ready") == (503, "40")
    assert asked == []  # not ready anyway: the slots are not asked
    readiness.set(None)
    assert get_retry_after(f"{url}/ready") == (200, None)
    saturated = True
    assert get(f"{url}/ready") == (503, "not ready: saturated\n")
    assert get_retry_after(f"{url}/ready") == (503, "1")
    assert asked == [False, True, True]
    # Saturation is /ready's own answer, not the daemon's verdict: the ready gauge stays the daemon's.
    assert readiness.reason is None
    saturated = False
    assert get(f"{url}/ready") == (200, "ready\n")


@pytest.mark.engine
def test_the_real_demo_says_saturated_while_a_request_waits_for_its_one_slot(
    example: Callable[..., Path], appliance_up: UpProcess
) -> None:
    """`server.parallel = 1`: two requests at once, and the second waits in llama-server's queue. /ready says
    so (a router or balancer sends the next request elsewhere, before its first byte), and says ready again
    once the queue is gone."""
    server_port, exporter_port = free_port(), free_port()
    process, output = appliance_up(fast_demo(example, server_port, exporter_port))
    wait_ready(process, output, 1)
    ready = f"http://127.0.0.1:{exporter_port}/ready"
    wait_until(lambda: get(ready)[0] == 200, LOAD_SECONDS, lambda: f"/ready 200, last {get(ready)}")
    api = ServerApi(f"http://127.0.0.1:{server_port}")
    # Long enough (ignore_eos) that the second request is still queued while /ready is asked.
    body = {"prompt": "Once upon a time", "n_predict": 300, "ignore_eos": True, "temperature": 0}
    answers: list[Streamed] = []
    senders = [threading.Thread(target=lambda: answers.append(api.stream("/completion", body))) for _ in range(2)]
    for sender in senders:
        sender.start()
    wait_until(
        lambda: get(ready) == (503, "not ready: saturated\n") or len(answers) == 2,
        LOAD_SECONDS,
        lambda: f"/ready saturated, last {get(ready)}",
    )
    assert len(answers) < 2, "both requests ended before /ready was asked while one waited"
    assert get_retry_after(ready) in ((503, "1"), (200, None))  # (the queue may have just emptied)
    for sender in senders:
        sender.join(REQUEST_SECONDS * 2)
    assert [a.complete for a in answers] == [True, True], [a.error for a in answers]
    wait_until(lambda: get(ready)[0] == 200, LOAD_SECONDS, lambda: f"/ready 200 again, last {get(ready)}")
