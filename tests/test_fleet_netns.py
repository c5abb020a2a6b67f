"""The fleet for real: three demo appliances (`llm-appliance up`) in three network namespaces, the real HAProxy
on the rendered haproxy.cfg in a fourth, a client streaming chat completions through it, and a real
Prometheus on the rendered file_sd targets and rules (tests/fleet_netns.py builds it, tests/fleet_traffic.py
drives it). One fleet serves the whole module; each test starts by making it whole again.

    pytest -s -m fleet tests/test_fleet_netns.py     # -s prints each scenario's timeline and counts

bench/fleet.py runs the same scenarios with more load and prints a table.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from fleet_netns import (
    API_KEY,
    BALANCER,
    DECAY_HOST,
    HOSTS,
    MIN_READY,
    ROUTER_PORT,
    ROUTER_START_SECONDS,
    Fleet,
    Prometheus,
    missing_tools,
    wait_until,
)
from fleet_traffic import (
    KILL_HOST,
    REQUEST_SECONDS,
    Load,
    LoadShape,
    Outcome,
    induced_decay,
    kill_server,
    rolling_restart,
    run_scenario,
)

from appliance.runtime.server_api import ServerApi, Streamed

pytestmark = [pytest.mark.fleet, pytest.mark.system, pytest.mark.engine]

# Three clients for three hosts of one slot each (server.parallel = 1: HAProxy's maxconn 1 per host), so every
# host is busy when something happens to it; short generations, bounded in count and time.
LOAD = LoadShape(workers=3, max_requests=600, max_seconds=240, max_tokens=16)
# The daemon's decode windows come from llama-server's counters, which count a request's tokens when it ends: a
# throttled host yields about one window per completed request, and a window of fewer than 16 tokens sets no
# rate (health/daemon.py, MIN_RATE_TOKENS): each request asks for a few more, in case one ends early.
DECAY_LOAD = LoadShape(workers=3, max_requests=600, max_seconds=240, max_tokens=20)
SLOTS_PER_HOST = 1  # demo.toml's server.parallel
JOBS = ("llm-appliance-health", "llm-appliance-llama-server")
BALANCER_JOB = "llm-appliance-haproxy"
BELOW_MIN_READY = "LlmApplianceFleetBelowMinReady"
ALERT_SECONDS = 60.0  # a scrape, an evaluation (1 s each) and `for: 0s`, many times over on a busy box


@pytest.fixture(scope="module")
def whole_fleet(
    outside_tmp: Path, fixture_models: Path, engine_binary: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    missing = missing_tools()
    if missing:
        pytest.skip(
            f"{', '.join(missing)} not installed (Debian: iproute2, haproxy, prometheus; tests/run installs them)"
        )
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    # In /var/lib, not pytest's 0700 /tmp directories: the service user must reach the API key file.
    work = outside_tmp / "fleet"
    work.mkdir(mode=0o755)
    try:
        with Fleet(work, fixture_models) as fleet:
            yield fleet
    finally:
        # outside_tmp goes at the end of the session; pytest keeps its own directories for a while.
        kept = tmp_path_factory.mktemp("fleet-logs")
        shutil.copytree(work / "logs", kept, dirs_exist_ok=True)
        for name in ("fleet.toml", "out/balancer/etc/haproxy/haproxy.cfg"):
            if (work / name).exists():
                shutil.copy(work / name, kept)
        print(f"\nthe fleet's logs (every host's `up`, HAProxy's requests, Prometheus) and its files: {kept}")


@pytest.fixture
def fleet(whole_fleet: Fleet) -> Fleet:
    whole_fleet.ensure_whole()
    return whole_fleet


def drained_first(outcome: Outcome, host: str) -> None:
    """The host said "draining" on /ready before it went down for its restart."""
    seen = outcome.sequences[host]
    assert "draining" in seen, f"{host} never drained: {seen}"
    down = [i for i, answer in enumerate(seen) if answer in ("restarting", "loading", "down")]
    assert down and seen.index("draining") < down[0], f"{host} restarted before draining: {seen}"


def test_rolling_scheduled_restart_under_load_loses_nothing(fleet: Fleet) -> None:
    """`restart --when-idle --reason scheduled` on all three hosts at once: the daemons take turns (min_ready),
    each drains before it restarts, and not one request fails or is cut."""
    outcome = run_scenario(fleet, "rolling scheduled restart", LOAD, rolling_restart)
    report = outcome.report(fleet)
    assert outcome.notes["scheduled restarts"] == dict.fromkeys(HOSTS, 1), report
    assert outcome.failed == 0 and outcome.cut == 0, report
    assert outcome.min_ready >= MIN_READY, report
    for host in HOSTS:
        drained_first(outcome, host)


def test_induced_decay_drains_then_restarts_without_a_failure(fleet: Fleet) -> None:
    """DECAY_HOST's llama-server throttled (SIGSTOP/SIGCONT) under load: its daemon sees the decay, drains,
    restarts it; the clients see nothing."""
    outcome = run_scenario(fleet, "induced decay", DECAY_LOAD, induced_decay)
    report = outcome.report(fleet)
    assert outcome.notes["decay restarts"] == 1, report
    assert outcome.failed == 0 and outcome.cut == 0, report
    assert outcome.min_ready >= MIN_READY, report
    drained_first(outcome, DECAY_HOST)
    assert all(outcome.sequences[host] == ["ready"] for host in HOSTS if host != DECAY_HOST), report


def test_kill_9_loses_only_the_streams_in_flight(fleet: Fleet) -> None:
    """kill -9 of KILL_HOST's llama-server under load: the streams it was generating are lost (at most its
    slots), and every request started after the kill is served by another host (HAProxy retries it)."""
    outcome = run_scenario(fleet, "kill -9 llama-server", LOAD, kill_server)
    report = outcome.report(fleet)
    before, after = outcome.split(outcome.notes["_killed_at"])
    assert after and all(r.outcome == "ok" for r in after), report
    assert all(r.outcome == "ok" for r in before if r.outcome != "cut"), report
    assert outcome.cut <= SLOTS_PER_HOST, report
    assert outcome.min_ready >= len(HOSTS) - 1, report


def test_prometheus_sees_the_fleet_and_alerts_below_min_ready(fleet: Fleet) -> None:
    """A real Prometheus on the rendered scrape jobs, targets and rules: every host's two jobs and the balancer
    are up; two hosts stopped fire LlmApplianceFleetBelowMinReady, and their return resolves it."""
    prometheus = Prometheus(fleet)
    try:
        wait_until(prometheus.ready, 60, "prometheus to be ready")
        expected = {(job, host) for job in JOBS for host in HOSTS} | {(BALANCER_JOB, "balancer")}
        wait_until(
            lambda: prometheus.targets_up() >= expected,
            ALERT_SECONDS,
            lambda: f"every target up: {sorted(expected - prometheus.targets_up())} are not",
            poll=0.5,
        )
        rules = [r for group in prometheus.get("/api/v1/rules")["groups"] for r in group["rules"]]
        assert BELOW_MIN_READY in {r["name"] for r in rules}
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
        # Before the first scrapes nothing is ready and the alert may fire (for: 0s); it resolves once all are seen.
        wait_until(
            lambda: (
                not prometheus.alerts(BELOW_MIN_READY)
                and bool(prometheus.query('sum(llm_appliance_ready{appliance="demo"}) == 3'))
            ),
            ALERT_SECONDS,
            lambda: f"3 hosts ready and no {BELOW_MIN_READY}: {prometheus.alerts(BELOW_MIN_READY)}",
            poll=0.5,
        )
        assert prometheus.query('haproxy_backend_active_servers{host="balancer", proxy="llm-appliance"} == 3')

        stopped = [name for name in HOSTS if name != KILL_HOST][:2]
        for name in stopped:
            fleet.stop_host(name)
        wait_until(
            lambda: bool(prometheus.firing(BELOW_MIN_READY)),
            ALERT_SECONDS,
            lambda: f"{BELOW_MIN_READY} to fire: {prometheus.alerts(BELOW_MIN_READY)}",
            poll=0.5,
        )
        fleet.say(f"prometheus: {BELOW_MIN_READY} firing with {', '.join(stopped)} stopped")
        fleet.ensure_whole()
        wait_until(
            lambda: not prometheus.alerts(BELOW_MIN_READY),
            ALERT_SECONDS,
            lambda: f"{BELOW_MIN_READY} to resolve: {prometheus.alerts(BELOW_MIN_READY)}",
            poll=0.5,
        )
        fleet.say(f"prometheus: {BELOW_MIN_READY} resolved")
    finally:
        prometheus.stop()


ANSWERED_BY = "x-litellm-model-id"  # the router's header: "local" (HAProxy) or "fallback" (the upstream)


class RouterClient:
    """One client in the client's namespace sending streamed chat completions to the fleet's router, back to back
    (bounded in count and time), as an IDE pointed at the router would."""

    def __init__(self, fleet: Fleet, max_requests: int = 400, max_seconds: float = 900.0) -> None:
        self.fleet, self.max_requests, self.max_seconds = fleet, max_requests, max_seconds
        self.answers: list[Streamed] = []
        self.stopping = threading.Event()
        self.thread = fleet.client.thread(self._run, "router-client")

    def __enter__(self) -> RouterClient:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(REQUEST_SECONDS + 10)

    def _run(self) -> None:
        router = ServerApi(f"http://{BALANCER}:{ROUTER_PORT}", API_KEY)
        body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
        started = time.monotonic()
        while not self.stopping.is_set() and len(self.answers) < self.max_requests:
            if time.monotonic() - started > self.max_seconds:
                return
            self.answers.append(router.stream("/v1/chat/completions", body, REQUEST_SECONDS, ANSWERED_BY))

    def count(self, since: int = 0) -> Counter[str]:
        return Counter(a.served_by if a.complete else f"failed: {a.status} {a.error}" for a in self.answers[since:])

    def wait_for(self, who: str, since: int) -> None:
        def seen() -> bool:
            if not self.thread.is_alive():
                raise AssertionError(f"the router client ended: {self.count()}")
            return self.count(since)[who] > 0

        wait_until(
            seen, ROUTER_START_SECONDS, lambda: f"an answer by {who}: {self.count(since)}\n{self.fleet.timeline()}"
        )
        self.fleet.say(f"router: answered by {who} ({dict(self.count(since))} since request {since})")


def test_the_fleet_router_falls_back_while_the_fleet_is_saturated_or_down(fleet: Fleet, engine_binary: Path) -> None:
    """The fleet's [fallback]: the router on the balancer sends to HAProxy while its /ready says ready, to the
    upstream while every host's slot is taken and requests queue (saturated) or no host is up (down), and back."""
    fleet.start_fallback(engine_binary)
    with RouterClient(fleet) as client:
        client.wait_for("local", 0)
        # Busy: six clients straight to HAProxy keep its three slots taken and its queue non-empty.
        with Load(fleet, workers=6, max_requests=600, max_seconds=240, max_tokens=64):
            busy = len(client.answers)
            client.wait_for("fallback", busy)
        client.wait_for("local", len(client.answers))
        # Down: every host stopped. A request in flight on a host when it stops may be cut; none after.
        for name in HOSTS:
            fleet.stop_host(name)
        down = len(client.answers)
        client.wait_for("fallback", down)
        fleet.ensure_whole()
        back = len(client.answers)
        client.wait_for("local", back)
    counts = client.count()
    sent = len(client.answers)
    print(f"\nfleet router: sent {sent}, {dict(counts)} (busy from {busy}, down from {down}, back from {back})")
    # After the stops every request was answered, by one side or the other; before them, at most the one in
    # flight on each host as it stopped was lost.
    assert set(client.count(down + 1)) <= {"local", "fallback"}, client.count(down + 1)
    assert sum(n for who, n in counts.items() if who not in ("local", "fallback")) <= len(HOSTS), counts
