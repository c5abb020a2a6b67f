"""The fleet's restart turns: one host at a time, only while min_ready others serve, a fleet-wide decay held,
and restarts asked for from outside (the timer, an admin) taking the same path.

The peers are real exporters (health/exporter.py) on loopback whose readiness each test sets; the daemons are
the real HealthDaemon with the fakes of tests/test_daemon_logic.py (the server, NVML, the clock).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from test_daemon_logic import FakeClock, Rig, make_spec
from test_drain import decay as want_decay

from appliance.health.drain import restart_turn
from appliance.health.exporter import Metrics, Readiness, serve
from appliance.health.peers import Peer, read_peer
from appliance.health.requests import ADOPTED, REQUEST, RestartRequests
from appliance.runtime.server_api import ServerUnreachable

DRAIN = 4
SETTLE = 6
FLEET_KEY = b"the-fleet-key-of-these-tests"
# Every peer exporter made here, by URL: a rig's fleet names each one, which then proves its /ready as that host.
SERVED: dict[str, Exporter] = {}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Exporter:
    """A peer's /ready, served for real; its readiness on a clock of its own (how long it has been ready)."""

    def __init__(self, port: int | None = None, readiness: Readiness | None = None) -> None:
        self.clock = FakeClock(0.0)
        self.readiness = readiness or Readiness(Metrics(CollectorRegistry()), clock=self.clock)
        self.server = serve(Metrics(CollectorRegistry()), "127.0.0.1", port or 0, self.readiness)
        self.url = f"http://127.0.0.1:{self.server.server_port}/ready"
        SERVED[self.url] = self

    def ready(self, for_seconds: float = 3600) -> Exporter:
        self.readiness.set(None)
        self.clock.advance(for_seconds)
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def exporters() -> Iterator[list[Exporter]]:
    made: list[Exporter] = []
    yield made
    for exporter in made:
        exporter.close()


def fleet_rig(
    tmp_path: Path, me: str, peers: dict[str, str], min_ready: int, settle: int = SETTLE, **sections: Any
) -> Rig:
    key = tmp_path / "fleet-key"
    tmp_path.mkdir(parents=True, exist_ok=True)
    key.write_bytes(FLEET_KEY + b"\n")
    for name, url in peers.items():
        if url in SERVED:
            SERVED[url].readiness.prove_with(FLEET_KEY, name)
    fleet = {"host": me, "peers": peers, "min_ready": min_ready, "drain_seconds": DRAIN, "settle_seconds": settle}
    fleet["key_file"] = str(key)
    return Rig(tmp_path, make_spec(tmp_path, fleet=fleet, restart={"cooldown_seconds": 0}, **sections))


def poll(rig: Rig, seconds: float = 1.0) -> str:
    rig.clock.advance(seconds)
    return rig.daemon.check().action


# -- whose turn: the pure rule --


def peer(name: str, state: str = "ready", claim: bool = False, ready_seconds: float = 60, wants: str = "") -> Peer:
    return Peer(name, state == "ready", None if state == "ready" else state, ready_seconds, claim, wants or None)


@pytest.mark.parametrize(
    ("peers", "claimed", "draining", "turn"),
    [
        ([peer("a"), peer("c")], False, False, "claim"),
        ([peer("a"), peer("c")], True, False, "go"),
        ([peer("a", claim=True), peer("c")], True, False, "wait"),  # a claimed too, and goes first
        ([peer("a"), peer("c", claim=True)], True, False, "go"),  # c claimed too, and waits for b
        ([peer("a", "draining"), peer("c")], False, False, "wait"),
        ([peer("a", "warming"), peer("c")], False, False, "wait"),
        ([peer("a", ready_seconds=2), peer("c")], False, False, "wait"),  # back, not yet in HAProxy's rotation
        ([peer("a", "unreachable"), peer("c")], False, False, "wait"),  # one serving, min_ready 2
        ([peer("a", "draining"), peer("c")], True, True, "yield"),  # both draining: a goes first
        ([peer("a"), peer("c", "draining")], True, True, "hold"),  # c gives way; b holds until it has
        ([peer("a", "unreachable"), peer("c")], True, True, "yield"),  # a died mid-drain: serve again
        ([peer("a"), peer("c")], True, True, "go"),
    ],
)
def test_whose_turn(peers: list[Peer], claimed: bool, draining: bool, turn: str) -> None:
    assert restart_turn("b", 2, SETTLE, peers, claimed, draining).turn == turn


def test_min_ready_zero_lets_a_lone_host_go() -> None:
    assert restart_turn("b", 0, SETTLE, [peer("a", "unreachable")], True, False).turn == "go"


# -- /ready as a peer reads it --


def test_a_peer_is_read_through_its_real_ready_endpoint(exporters: list[Exporter]) -> None:
    exporter = Exporter()
    exporters.append(exporter)
    assert read_peer("a", exporter.url, 5) == Peer("a", False, "loading", 0.0, False, None)
    exporter.ready(for_seconds=42)
    exporter.readiness.restart_wanted("decay", claim=True)
    assert read_peer("a", exporter.url, 5) == Peer("a", True, None, 42.0, True, "decay")
    exporter.readiness.set("draining")
    assert read_peer("a", exporter.url, 5) == Peer("a", False, "draining", 0.0, True, "decay")
    port = exporter.server.server_port
    exporter.close()
    exporters.remove(exporter)
    gone = read_peer("a", f"http://127.0.0.1:{port}/ready", 5)
    assert not gone.ready and gone.reason is not None and gone.reason.startswith("unreachable")


# -- one daemon among real peers --


def test_a_restart_claims_first_then_drains_then_restarts(tmp_path: Path, exporters: list[Exporter]) -> None:
    exporters += [Exporter().ready(), Exporter().ready()]
    rig = fleet_rig(tmp_path, "b", {"a": exporters[0].url, "c": exporters[1].url}, min_ready=2)
    own = Exporter(readiness=rig.daemon.readiness)
    exporters.append(own)
    assert want_decay(rig) == "claim"
    # Still serving while it claims; the claim is what its peers see.
    assert read_peer("b", own.url, 5) == Peer("b", True, None, pytest.approx(0, abs=60), True, "decay")
    assert poll(rig) == "drain"
    assert read_peer("b", own.url, 5).reason == "draining"
    assert poll(rig, DRAIN) == "restart"
    assert rig.control.restarts == ["decay"]
    assert rig.value("llm_appliance_fleet_peers_ready") == 2


def test_a_restart_waits_while_another_host_restarts_and_settles(tmp_path: Path, exporters: list[Exporter]) -> None:
    a, c = Exporter().ready(), Exporter().ready()
    exporters += [a, c]
    rig = fleet_rig(tmp_path, "b", {"a": a.url, "c": c.url}, min_ready=2)
    a.readiness.set("restarting")
    assert want_decay(rig) == "wait"
    assert rig.daemon.readiness.reason is None, "a host waiting for its turn keeps serving"
    assert rig.daemon.next_check_in() == 1.0
    a.readiness.set(None)  # back, but HAProxy has not counted `rise` good checks yet
    assert poll(rig) == "wait"
    a.clock.advance(SETTLE)
    assert poll(rig) == "claim"
    assert poll(rig) == "drain"
    assert rig.control.restarts == []


def test_a_host_whose_name_sorts_first_goes_first(tmp_path: Path, exporters: list[Exporter]) -> None:
    """Two daemons that want a restart at the same moment, each the other's peer: never both out at once."""
    ports = {name: free_port() for name in "ab"}
    c = Exporter().ready()
    exporters.append(c)
    urls = {name: f"http://127.0.0.1:{port}/ready" for name, port in ports.items()}
    # settle 0: a host back from its restart counts at once (the daemons' readiness runs on the real clock).
    rigs = {
        name: fleet_rig(tmp_path / name, name, {**{n: u for n, u in urls.items() if n != name}, "c": c.url}, 2, 0)
        for name in "ba"
    }
    for name, rig in rigs.items():
        exporters.append(Exporter(ports[name], rig.daemon.readiness))
        rig.check(None)  # up and warm: ready
    # Asked at once (two decaying of three would be a fleet-wide decay, held).
    for name in "ba":
        RestartRequests(rigs[name].state_file.parent).submit("scheduled")
    assert poll(rigs["b"]) == "claim"
    assert poll(rigs["a"]) == "claim", "b's claim does not stop a: its name sorts first"
    order: list[str] = []
    for _ in range(40):
        for name, rig in rigs.items():
            if rig.control.restarts == [] and poll(rig) == "restart":
                order.append(name)
                rig.daemon.readiness.set(None)  # back at once, as a fast restart would be
            out = [n for n, r in rigs.items() if r.daemon.readiness.reason is not None]
            assert len(out) <= 1, f"{out} out of the rotation at once"
        if len(order) == 2:
            break
    assert order == ["a", "b"]


def test_a_restart_that_would_leave_too_few_serving_waits(tmp_path: Path, exporters: list[Exporter]) -> None:
    a = Exporter().ready()
    exporters.append(a)
    rig = fleet_rig(tmp_path, "b", {"a": a.url, "c": "http://127.0.0.1:9/ready"}, min_ready=2)
    assert want_decay(rig) == "wait"
    assert rig.value("llm_appliance_restart_pending") == 1 and rig.control.restarts == []


def test_a_fleet_wide_decay_alerts_instead_of_restarting(tmp_path: Path, exporters: list[Exporter]) -> None:
    a, c = Exporter().ready(), Exporter().ready()
    exporters += [a, c]
    rig = fleet_rig(tmp_path, "b", {"a": a.url, "c": c.url}, min_ready=1)
    a.readiness.restart_wanted("decay", claim=False)
    assert want_decay(rig) == "held"
    assert rig.value("llm_appliance_fleet_decay") == 1
    assert rig.daemon.readiness.reason is None and rig.control.restarts == []
    a.readiness.restart_wanted(None, claim=False)  # b alone decays: its own fault, restarted
    assert poll(rig) == "claim"
    assert rig.value("llm_appliance_fleet_decay") == 0


# -- restarts asked for --


def test_an_asked_restart_takes_the_turn_and_the_drain(tmp_path: Path, exporters: list[Exporter]) -> None:
    exporters += [Exporter().ready(), Exporter().ready()]
    rig = fleet_rig(tmp_path, "b", {"a": exporters[0].url, "c": exporters[1].url}, min_ready=2)
    rig.check(None)
    state = rig.state_file.parent
    requests = RestartRequests(state)
    wanted = requests.submit("scheduled")
    assert not requests.taken(wanted)
    assert poll(rig) == "claim"
    assert requests.taken(wanted) and (state / ADOPTED).exists() and not (state / REQUEST).exists()
    assert poll(rig) == "drain"
    # Stopped mid-drain (a crash, a stop): the next daemon finds the adopted request and carries it out.
    rig.new_daemon()
    assert poll(rig) == "claim"
    assert poll(rig) == "drain"
    assert poll(rig, DRAIN) == "restart"
    assert rig.control.restarts == ["scheduled"] and not (state / ADOPTED).exists()
    assert rig.restarts("scheduled") == 1


def test_an_asked_restart_is_not_the_policys_to_refuse(tmp_path: Path) -> None:
    rig = Rig(tmp_path, make_spec(tmp_path, restart={"max_per_hour": 1, "cooldown_seconds": 3600}))
    rig.check(None)
    for reason in ("manual", "scheduled"):
        RestartRequests(rig.state_file.parent).submit(reason)  # type: ignore[arg-type]
        assert poll(rig) == "restart"
    assert rig.control.restarts == ["manual", "scheduled"]


def test_a_garbled_request_is_dropped_not_obeyed(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.check(None)
    rig.state_file.parent.mkdir(exist_ok=True)
    (rig.state_file.parent / REQUEST).write_text('{"reason": "rm -rf /", "requested_at": 1, "id": "x"}')
    assert poll(rig) == "none"
    assert rig.control.restarts == [] and not (rig.state_file.parent / ADOPTED).exists()


def test_the_loop_wakes_for_a_request_between_checks(tmp_path: Path) -> None:
    rig = Rig(tmp_path, make_spec(tmp_path, health={"interval_seconds": 3600}))
    stop = threading.Event()
    loop = threading.Thread(target=rig.daemon.run, args=(stop,), daemon=True)
    loop.start()
    try:
        assert rig.daemon.readiness.wait_for(lambda reason: reason is None, timeout=60)
        RestartRequests(rig.state_file.parent).submit("manual")
        # Not an hour later: within the second the loop looks for requests.
        assert rig.daemon.readiness.wait_for(lambda reason: reason == "restarting", timeout=60)
        assert rig.control.restarts == ["manual"]
    finally:
        stop.set()
        loop.join(timeout=60)


def test_a_hung_host_restarts_without_waiting_for_its_turn(tmp_path: Path, exporters: list[Exporter]) -> None:
    a = Exporter()  # loading: no other host serves
    exporters.append(a)
    rig = fleet_rig(tmp_path, "b", {"a": a.url}, min_ready=1)
    rig.check(None)
    rig.api.health_error = ServerUnreachable("timed out")  # accepts, never answers
    actions = [poll(rig, 30) for _ in range(rig.spec.health.consecutive)]
    assert actions[-1] == "drain", actions  # out of the rotation already: no claim, only the drain's own wait
    assert poll(rig, DRAIN) == "restart"
    assert rig.control.restarts == ["hang"]


# -- peers prove their /ready; a claim or a restart does not hold the turn for ever --


def test_a_peer_is_believed_only_with_the_fleet_key(exporters: list[Exporter]) -> None:
    honest, impostor, stranger = Exporter().ready(), Exporter().ready(), Exporter().ready()
    exporters += [honest, impostor, stranger]
    honest.readiness.prove_with(FLEET_KEY, "a")
    impostor.readiness.prove_with(b"not-the-fleet-key", "a")
    stranger.readiness.restart_wanted("decay", claim=True)  # no key at all: a host anyone could run
    assert read_peer("a", honest.url, 5, FLEET_KEY) == Peer("a", True, None, 3600.0, False, None)
    for fake in (impostor, stranger):
        answer = read_peer("a", fake.url, 5, FLEET_KEY)
        assert not answer.ready and not answer.claim and answer.wants is None, answer
        assert answer.reason is not None and answer.reason.startswith("unauthenticated"), answer
    # The honest host's own proof, for another host's name: not that host's answer.
    assert read_peer("c", honest.url, 5, FLEET_KEY).reason.startswith("unauthenticated")  # type: ignore[union-attr]


def test_a_peer_without_the_key_blocks_no_restart(tmp_path: Path, exporters: list[Exporter]) -> None:
    """The attack: a host at a peer's address says "draining" for ever, which held every other host's restart."""
    a, c = Exporter().ready(), Exporter()
    exporters += [a, c]
    rig = fleet_rig(tmp_path, "b", {"a": a.url, "c": c.url}, min_ready=1)
    c.readiness.prove_with(b"a-key-of-its-own", "c")
    c.readiness.set("draining")
    c.readiness.restart_wanted("decay", claim=True)
    assert want_decay(rig) == "claim"
    assert poll(rig) == "drain"
    assert poll(rig, DRAIN) == "restart"
    assert rig.value("llm_appliance_fleet_peers_ready") == 1  # a alone: c's word counts for nothing


def test_a_claim_held_too_long_is_ignored(tmp_path: Path, exporters: list[Exporter]) -> None:
    """a (sorting first) claims and never drains: b waits a few checks, then takes its turn."""
    a, c = Exporter().ready(), Exporter().ready()
    exporters += [a, c]
    rig = fleet_rig(tmp_path, "b", {"a": a.url, "c": c.url}, min_ready=1)
    a.readiness.restart_wanted("creep", claim=True)
    assert want_decay(rig) == "wait"
    expiry = rig.daemon.turn.clocks.claim_seconds
    waited = 0.0
    while waited + 5 <= expiry:
        waited += 5
        assert poll(rig, 5) == "wait", f"{waited:.0f} s into a's claim"
    assert poll(rig, 10) == "claim"


def test_a_restart_that_never_ends_stops_holding_the_turn(tmp_path: Path, exporters: list[Exporter]) -> None:
    a, c = Exporter().ready(), Exporter().ready()
    exporters += [a, c]
    rig = fleet_rig(tmp_path, "b", {"a": a.url, "c": c.url}, min_ready=1)
    a.readiness.set("draining")
    assert want_decay(rig) == "wait"
    clocks = rig.daemon.turn.clocks
    step = clocks.claim_seconds / 2  # read often enough to count as one unbroken drain
    waited = 0.0
    while waited + step <= clocks.turn_seconds:
        waited += step
        assert poll(rig, step) == "wait", f"{waited:.0f} s into a's drain"
    assert poll(rig, step) == "claim"
