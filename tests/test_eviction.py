"""The cluster takes the turns ([fleet] turns = "eviction"): the daemon evicts its own pod through the Eviction
API, serves on while the PodDisruptionBudget refuses (429) and asks again an interval later, and once evicted
(201) counts the restart and drains for good instead of restarting llama-server itself. And `llm-appliance drain`
(a pod's preStop): a drain for good asked for through the state directory.

The API server is tests/fake_eviction_api.py, a FAKE that answers over real HTTP as the PDB logic does; the
daemons are the real HealthDaemon with the fakes of tests/test_daemon_logic.py (the server, NVML, the clock).
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import pytest
from fake_eviction_api import REFUSED, FakeEvictionApi
from test_daemon_logic import INTERVAL, Rig, make_spec
from test_drain import decay, step
from test_ready import get

from appliance.health.eviction import Evictor, InCluster, NotInCluster
from appliance.health.exporter import serve
from appliance.health.peers import Peer
from appliance.health.requests import ADOPTED, DRAINED, DrainRequests, RestartRequests
from appliance.health.service import request_drain
from appliance.health.state import RestartLog

NAMESPACE = "llm"
POD = "llm-0"
DRAIN = 6
FLEET = {"host": "llm", "min_ready": 0, "drain_seconds": DRAIN, "turns": "eviction"}


@pytest.fixture
def fake() -> Iterator[FakeEvictionApi]:
    # Two pods, minAvailable 1: llm-0 may go only while llm-1 is ready too.
    api = FakeEvictionApi(NAMESPACE, {POD: True, "llm-1": False}, min_available=1)
    yield api
    api.close()


def cluster(tmp_path: Path, api: FakeEvictionApi, pod: str = POD, token: str | None = None) -> InCluster:
    token_file = tmp_path / "token"
    token_file.write_text((token or api.token) + "\n")
    return InCluster(pod, NAMESPACE, api.url, token_file, None)


def eviction_rig(tmp_path: Path, api: FakeEvictionApi, **parts: object) -> Rig:
    spec = make_spec(tmp_path, fleet=FLEET, restart={"cooldown_seconds": 0})
    return Rig(tmp_path, spec, evictor=Evictor(cluster(tmp_path, api)), **parts)


# -- the client against the fake API server --


def test_the_evictor_reads_the_answers_the_budget_gives(tmp_path: Path, fake: FakeEvictionApi) -> None:
    refused = Evictor(cluster(tmp_path, fake)).evict()
    assert refused.outcome == "refused"
    assert REFUSED in refused.detail and "needs 1 healthy pods and has 1" in refused.detail
    unknown = Evictor(cluster(tmp_path, fake, pod="llm-9")).evict()
    assert unknown.outcome == "failed" and unknown.detail == 'HTTP 404: pods "llm-9" not found'
    fake.set_ready("llm-1", True)
    granted = Evictor(cluster(tmp_path, fake)).evict()
    assert granted.outcome == "granted" and granted.detail == "HTTP 201: Success"
    # Evicted, the pod is gone: asking again finds no such pod.
    assert Evictor(cluster(tmp_path, fake)).evict().outcome == "failed"
    assert fake.answers == [(POD, 429), ("llm-9", 404), (POD, 201), (POD, 404)]


def test_a_wrong_token_or_no_api_server_is_a_failure_not_a_refusal(tmp_path: Path, fake: FakeEvictionApi) -> None:
    wrong = Evictor(cluster(tmp_path, fake, token="stale")).evict()
    assert (wrong.outcome, wrong.detail) == ("failed", "HTTP 401: Unauthorized")
    gone = InCluster(POD, NAMESPACE, "http://127.0.0.1:1", tmp_path / "token", None)
    answer = Evictor(gone, timeout=5).evict()
    assert answer.outcome == "failed" and "not reached" in answer.detail
    missing = InCluster(POD, NAMESPACE, fake.url, tmp_path / "no-token", None)
    assert "cannot read the service account token" in Evictor(missing).evict().detail


def test_over_https_the_api_server_is_trusted_through_the_service_accounts_ca_only(tmp_path: Path) -> None:
    cert, key = tmp_path / "ca.crt", tmp_path / "key.pem"
    certificate = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kubernetes"]
    names = ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)]
    subprocess.run([*certificate, *names], check=True, capture_output=True)
    api = FakeEvictionApi(NAMESPACE, {POD: True}, min_available=1, tls=(cert, key))
    try:
        trusted = Evictor(replace(cluster(tmp_path, api), ca_file=cert)).evict()
        assert trusted.outcome == "refused" and REFUSED in trusted.detail
        untrusted = Evictor(cluster(tmp_path, api)).evict()  # the system's CAs: not the cluster's
        assert untrusted.outcome == "failed" and "CERTIFICATE_VERIFY_FAILED" in untrusted.detail
        assert api.answers == [(POD, 429)]
    finally:
        api.close()


def test_the_in_cluster_configuration_is_the_pods_own(tmp_path: Path) -> None:
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "namespace").write_text("llm\n")
    (account / "ca.crt").write_text("a CA\n")
    env = {"POD_NAME": POD, "KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    found = InCluster.from_env(env, account)
    assert found == InCluster(POD, "llm", "https://10.96.0.1:443", account / "token", account / "ca.crt")
    v6 = InCluster.from_env({**env, "KUBERNETES_SERVICE_HOST": "fd00::1", "POD_NAMESPACE": "other"}, account)
    assert (v6.api_url, v6.namespace) == ("https://[fd00::1]:443", "other")
    fake = InCluster.from_env(
        {**env, "LLM_APPLIANCE_KUBE_API": "http://127.0.0.1:9/", "LLM_APPLIANCE_KUBE_CA_FILE": "/none"}, account
    )
    assert (fake.api_url, fake.ca_file) == ("http://127.0.0.1:9", None)
    with pytest.raises(NotInCluster, match="POD_NAME, POD_NAMESPACE, API"):
        InCluster.from_env({}, tmp_path)


# -- the turn: the daemon with the fake API server --


def test_refused_the_pod_serves_on_then_evicted_it_drains_and_restarts_nothing_itself(
    tmp_path: Path, fake: FakeEvictionApi, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "llm-appliance.health")
    rig = eviction_rig(tmp_path, fake)
    exporter = serve(rig.metrics, "127.0.0.1", 0, rig.daemon.readiness)
    ready = f"http://127.0.0.1:{exporter.server_port}/ready"
    try:
        assert decay(rig) == "wait"
        assert fake.answers == [(POD, 429)]
        assert get(ready) == (200, "ready\n")  # serving on, slow, as a fleet host does until its turn
        assert f"not this pod's turn yet: eviction refused, HTTP 429: {REFUSED}" in caplog.text
        assert rig.value("llm_appliance_evictions_total", outcome="refused") == 1
        assert rig.value("llm_appliance_restart_pending") == 1
        # Polled every second meanwhile; the API server is asked again only an interval later.
        assert step(rig, 1) == "wait" and len(fake.answers) == 1
        fake.set_ready("llm-1", True)
        assert step(rig, INTERVAL) == "evicted"
        assert fake.answers[-1] == (POD, 201)
        assert rig.value("llm_appliance_evictions_total", outcome="granted") == 1
        # Counted and logged as every restart; carried out by the cluster, not here.
        assert rig.restarts("decay") == 1 and rig.control.restarts == []
        assert "restarting llama-server: decay" in caplog.text and "pod llm-0 evicted" in caplog.text
        assert RestartLog(rig.state_file).read()[-1][1] == "decay"
        assert get(ready) == (503, "not ready: draining\n")
        rig.api.processing = 1
        assert step(rig, DRAIN) == "wait"  # a request still in flight
        rig.api.processing = 0
        assert step(rig, 1) == "drained"
        assert step(rig, 3600) == "drained" and get(ready) == (503, "not ready: draining\n")
        assert rig.control.restarts == [] and len(fake.answers) == 2
    finally:
        exporter.shutdown()
        exporter.server_close()


def test_an_asked_for_restart_takes_the_clusters_turn_and_is_done_once_evicted(
    tmp_path: Path, fake: FakeEvictionApi
) -> None:
    fake.set_ready("llm-1", True)
    rig = eviction_rig(tmp_path, fake)
    rig.check(None)
    RestartRequests(rig.state_file.parent).submit("manual")
    assert step(rig, 1) == "evicted" and fake.answers == [(POD, 201)]
    # A request left behind would restart the next pod too (the state directory may be a volume).
    assert not (rig.state_file.parent / ADOPTED).exists()
    assert rig.restarts("manual") == 1 and rig.control.restarts == []


class Reader:
    def __init__(self, *peers: Peer) -> None:
        self.peers = list(peers)
        self.asked: list[str] = []

    def __call__(self, urls: Mapping[str, str]) -> list[Peer]:
        self.asked += sorted(urls)
        return self.peers


def test_a_fleet_decaying_at_once_is_held_before_the_cluster_is_asked(tmp_path: Path, fake: FakeEvictionApi) -> None:
    # One spec for every pod of the StatefulSet: the peers name them all, this one among them.
    peers = {name: f"http://{name}.llm.llm.svc:9478/ready" for name in (POD, "llm-1", "llm-2")}
    spec = make_spec(tmp_path, fleet={**FLEET, "peers": peers}, restart={"cooldown_seconds": 0})
    reader = Reader(Peer("llm-1", True, ready_seconds=1e6, wants="decay"), Peer("llm-2", True, ready_seconds=1e6))
    rig = Rig(tmp_path, spec, evictor=Evictor(cluster(tmp_path, fake)), peers=reader)
    assert decay(rig) == "held"
    assert set(reader.asked) == {"llm-1", "llm-2"} and fake.answers == []
    assert rig.value("llm_appliance_fleet_decay") == 1


def test_a_pod_that_cannot_ask_says_why_and_restarts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ("POD_NAME", "POD_NAMESPACE", "KUBERNETES_SERVICE_HOST", "LLM_APPLIANCE_KUBE_API"):
        monkeypatch.delenv(name, raising=False)
    rig = Rig(tmp_path, make_spec(tmp_path, fleet=FLEET, restart={"cooldown_seconds": 0}))
    assert decay(rig) == "wait" and step(rig, INTERVAL) == "wait"
    assert 'this pod cannot ask for its turn: [fleet] turns = "eviction" needs POD_NAME' in caplog.text
    assert rig.control.restarts == []


# -- `llm-appliance drain` --


def test_a_drain_asked_for_waits_drain_seconds_then_the_requests_in_flight_and_stays(tmp_path: Path) -> None:
    rig = Rig(tmp_path, make_spec(tmp_path, fleet={**FLEET, "turns": "peers"}))
    rig.check(None)
    assert rig.daemon.readiness.reason is None
    drains = DrainRequests(rig.state_file.parent)
    asked = drains.submit()
    assert rig.daemon._asked()  # the daemon's wait for its next check ends at once
    rig.api.processing = 2
    assert step(rig, 1) == "drain" and rig.daemon.readiness.reason == "draining"
    assert drains.taken(asked) and not drains.done(asked)
    # Past drain_seconds, busy: no idle_timeout, a drain waits for the requests in flight however long.
    assert step(rig, DRAIN) == "wait" and step(rig, 3600) == "wait" and not drains.done(asked)
    rig.api.processing, rig.api.deferred = 0, 1  # one slot free, a request still queued for the next
    assert step(rig, 1) == "wait" and not drains.done(asked)
    rig.api.deferred = 0
    assert step(rig, 1) == "drained" and drains.done(asked)
    # Drained for good: no restart (asked for or wanted) is carried out, and a restart request wakes nothing.
    RestartRequests(rig.state_file.parent).submit("manual")
    assert not rig.daemon._asked()
    assert step(rig, 1) == "drained" and rig.control.restarts == [] and rig.daemon.readiness.reason == "draining"
    # A daemon started again (the pod, the unit) drains only when asked again.
    rig.new_daemon()
    assert not (rig.state_file.parent / DRAINED).exists()


def test_drain_returns_once_the_daemon_says_drained(tmp_path: Path) -> None:
    rig = Rig(tmp_path, make_spec(tmp_path, fleet={**FLEET, "turns": "peers"}))
    rig.check(None)
    codes: list[int] = []
    command = threading.Thread(target=lambda: codes.append(request_drain(rig.state_file.parent, timeout=120)))
    command.start()
    deadline = time.monotonic() + 60
    while not rig.daemon._asked():  # the command's request, as the daemon's wait sees it
        assert time.monotonic() < deadline, "drain never asked"
        time.sleep(0.05)
    assert step(rig, 1) == "drain"
    assert step(rig, DRAIN) == "drained"
    command.join(60)
    assert codes == [0]


def test_drain_without_a_daemon_gives_up_at_its_timeout_and_takes_its_request_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert request_drain(tmp_path, timeout=0.5) == 1
    assert "not drained after 0 s: no health daemon took the request" in caplog.text
    assert not DrainRequests(tmp_path).pending()
