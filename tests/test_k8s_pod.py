"""The pod as the StatefulSet runs it (issue 28), for real on loopback: the container's exact command, as
`k8s render` writes it for the example fleet (`llm-appliance up SPEC --state-dir DIR`; here on this machine's
ports, state directory and python), on the demo spec with the [fleet] table `k8s render` writes, as the
pod's user (its securityContext runs the service user, so `up` becomes no one), reaching /ready 200; the preStop
(`llm-appliance drain --state-dir DIR --timeout N`) under streaming load with no failed request; SIGTERM, what the
kubelet sends next, and a clean exit. And the cluster's restart turn end to end: the daemon evicts its own pod
through tests/fake_eviction_api.py (a FAKE API server with the PDB's logic), serves on at 429 and drains without
restarting llama-server at 201.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from conftest import EXAMPLES, INSTALLED_MODELS
from fake_eviction_api import REFUSED, FakeEvictionApi
from test_health_daemon import lines_with, wait_ready, wait_until
from test_launch import LOAD_SECONDS, free_port
from test_privileges import reachable_directory
from test_ready import get

from appliance.ops.models import SMOLLM2
from appliance.runtime.server_api import ServerApi, Streamed
from appliance.system.users import account, reading

pytestmark = [pytest.mark.engine, pytest.mark.system]
SERVICE = account()
if os.geteuid() != 0 or SERVICE is None:
    pytest.skip("needs root and the llm-appliance user (install.sh creates it)", allow_module_level=True)

NAMESPACE, POD = "llm", "llm-0"
DRAIN_SECONDS = 2
# Long answers (ignore_eos), two at a time against the demo's one slot: one generating, one queued.
TOKENS = 160
WORKERS = 2
FLEET = f"""
[fleet]
host = "llm"
turns = "eviction"
min_ready = 0
drain_seconds = {DRAIN_SECONDS}
"""


@dataclass(frozen=True)
class RenderedPod:
    """The container's command and its preStop, as `k8s render` writes them into the example's StatefulSet."""

    command: list[str]
    pre_stop: list[str]

    def here(self, argv: list[str], spec: Path, state_dir: Path) -> list[str]:
        """`argv` run here: this checkout's CLI for the image's, the test's spec and state directory for the pod's
        paths; every other word as rendered."""
        spec_in_pod, state_in_pod = self.command[2], self.command[4]
        words = [str(spec) if w == spec_in_pod else str(state_dir) if w == state_in_pod else w for w in argv[1:]]
        return as_pod_user(*words)


@pytest.fixture(scope="module")
def rendered_pod(tmp_path_factory: pytest.TempPathFactory) -> RenderedPod:
    out = tmp_path_factory.mktemp("k8s")
    render = subprocess.run(
        [sys.executable, "-m", "appliance.cli.main", "k8s", "render", str(EXAMPLES / "fleet.toml"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert render.returncode == 0, render.stderr
    statefulset = yaml.safe_load((out / "plain" / "statefulset-demo-1.yaml").read_text())
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    rendered = RenderedPod(container["command"], container["lifecycle"]["preStop"]["exec"]["command"])
    # The shapes this test runs: the appliance itself, and its drain with a timeout.
    assert rendered.command[1:] == ["up", "/etc/llm-appliance/demo.toml", "--state-dir", rendered.command[4]]
    assert rendered.pre_stop[:4] == [rendered.command[0], "drain", "--state-dir", rendered.command[4]]
    assert rendered.pre_stop[4] == "--timeout" and int(rendered.pre_stop[5]) > DRAIN_SECONDS
    return rendered


@dataclass
class Pod:
    process: subprocess.Popen[str]
    output: list[str]
    state_dir: Path
    server: str
    ready: str
    env: dict[str, str]
    pre_stop: list[str]  # the rendered preStop, run here
    pre_stop_timeout: float

    def run(self, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        """Another command in the pod's container (a preStop hook, an admin's exec), as its user."""
        return subprocess.run(
            as_pod_user(*args), env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )


def as_pod_user(*args: str | Path) -> list[str]:
    assert SERVICE is not None
    cli = [sys.executable, "-m", "appliance.cli.main", *map(str, args)]
    return ["setpriv", f"--reuid={SERVICE.uid}", f"--regid={SERVICE.gid}", "--clear-groups", *cli]


@pytest.fixture
def fake_api() -> Iterator[FakeEvictionApi]:
    # The StatefulSet's two pods under a PDB of minAvailable 1: this pod may go once the other is ready.
    api = FakeEvictionApi(NAMESPACE, {POD: True, "llm-1": False}, min_available=1)
    yield api
    api.close()


@pytest.fixture
def pod(smollm2: Path, fake_api: FakeEvictionApi, rendered_pod: RenderedPod) -> Iterator[Pod]:
    assert SERVICE is not None
    directory = reachable_directory()  # what the pod's user can read: the spec, the model, the token
    model = smollm2
    if not reading(model, SERVICE):
        model = directory / SMOLLM2
        shutil.copy(smollm2, model)
    server_port, exporter_port = free_port(), free_port()
    text = (EXAMPLES / "demo.toml").read_text().replace(f"{INSTALLED_MODELS}/{SMOLLM2}", str(model))
    text = text.replace("port = 8080", f"port = {server_port}").replace("port = 9478", f"port = {exporter_port}")
    spec = directory / "demo.toml"
    spec.write_text(text + FLEET)
    token = directory / "token"
    token.write_text(fake_api.token + "\n")
    state_dir = directory / "state"  # the pod's volume, writable by its user (fsGroup)
    state_dir.mkdir(mode=0o700)
    os.chown(state_dir, SERVICE.uid, SERVICE.gid)
    # The downward API's names, and the API server: the fake, with the service account token it expects.
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "POD_NAME": POD,
        "POD_NAMESPACE": NAMESPACE,
        "LLM_APPLIANCE_KUBE_API": fake_api.url,
        "LLM_APPLIANCE_KUBE_TOKEN_FILE": str(token),
    }
    process = subprocess.Popen(
        rendered_pod.here(rendered_pod.command, spec, state_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(iter(process.stdout.readline, "")), daemon=True).start()  # type: ignore[union-attr]
    running = Pod(
        process,
        output,
        state_dir,
        f"http://127.0.0.1:{server_port}",
        f"http://127.0.0.1:{exporter_port}/ready",
        env,
        rendered_pod.here(rendered_pod.pre_stop, spec, state_dir),
        float(rendered_pod.pre_stop[5]),
    )
    try:
        wait_ready(process, output, 1)
        wait_until(lambda: get(running.ready)[0] == 200, LOAD_SECONDS, lambda: f"/ready 200, last {get(running.ready)}")
        yield running
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        shutil.rmtree(directory, ignore_errors=True)


def terminate(pod: Pod) -> None:
    """What the kubelet does after the preStop: SIGTERM, and the container must exit on its own, cleanly."""
    pod.process.send_signal(signal.SIGTERM)
    assert pod.process.wait(60) == 0, "".join(pod.output[-30:])


@dataclass
class Answer:
    started: float
    streamed: Streamed
    ended: float


@dataclass
class BalancedLoad:
    """Streaming completions from WORKERS threads, each sent only while /ready says 200, as a balancer does (a
    request checked just before the drain may still come in: the drain's drain_seconds are for those)."""

    pod: Pod
    answers: list[Answer] = field(default_factory=list)
    in_flight: int = 0
    lock: threading.Condition = field(default_factory=threading.Condition)

    def run(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._work, daemon=True) for _ in range(WORKERS)]
        for thread in threads:
            thread.start()
        return threads

    def _work(self) -> None:
        api = ServerApi(self.pod.server)
        body = {"prompt": "def fibonacci(n):", "n_predict": TOKENS, "ignore_eos": True, "temperature": 0}
        while get(self.pod.ready)[0] == 200:
            started = time.monotonic()
            with self.lock:
                self.in_flight += 1
                self.lock.notify_all()
            streamed = api.stream("/completion", body, timeout=LOAD_SECONDS)
            with self.lock:
                self.in_flight -= 1
                self.answers.append(Answer(started, streamed, time.monotonic()))
                self.lock.notify_all()


@dataclass
class ReadyWatch:
    """/ready as the balancer polls it: the first time it said "draining"."""

    url: str
    draining_at: float | None = None
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> threading.Thread:
        def poll() -> None:
            while not self.stop.is_set() and self.draining_at is None:
                if get(self.url) == (503, "not ready: draining\n"):
                    self.draining_at = time.monotonic()
                self.stop.wait(0.05)

        thread = threading.Thread(target=poll, daemon=True)
        thread.start()
        return thread


def test_the_prestop_drain_under_load_fails_no_request_then_sigterm_stops_the_pod(pod: Pod) -> None:
    load = BalancedLoad(pod)
    workers = load.run()
    with load.lock:  # both requests in flight, one generating and one queued for the slot
        assert load.lock.wait_for(lambda: load.in_flight == WORKERS, LOAD_SECONDS), "the load never got going"
    watch = ReadyWatch(pod.ready)
    watcher = watch.run()
    drain_started = time.monotonic()
    # The preStop exactly as rendered (its timeout the balancer's drain and the idle timeout of the example).
    drain = subprocess.run(
        pod.pre_stop, env=pod.env, capture_output=True, text=True, timeout=pod.pre_stop_timeout + 30, check=False
    )
    drained_at = time.monotonic()
    watch.stop.set()
    watcher.join(10)
    for worker in workers:
        worker.join(LOAD_SECONDS)
    assert drain.returncode == 0, drain.stderr
    assert "drained" in drain.stderr
    assert watch.draining_at is not None and drain_started < watch.draining_at < drained_at
    failed = [a.streamed for a in load.answers if not a.streamed.complete]
    assert load.answers and not failed, failed
    # The requests in flight when the drain began finished before it said drained.
    cut_short = [a for a in load.answers if a.started < watch.draining_at and a.ended > drained_at]
    assert not cut_short
    assert any(a.ended > watch.draining_at for a in load.answers), "no request was in flight during the drain"
    # Draining for good: the pod is going away.
    assert get(pod.ready) == (503, "not ready: draining\n")
    terminate(pod)


def test_the_cluster_takes_the_restart_turn_refused_it_serves_on_evicted_it_drains(
    pod: Pod, fake_api: FakeEvictionApi
) -> None:
    asked = pod.run("restart", "--when-idle", "--state-dir", str(pod.state_dir), timeout=90)
    assert asked.returncode == 0, asked.stderr
    assert fake_api.wait_for_answers(1, LOAD_SECONDS) == [(POD, 429)]
    wait_until(
        lambda: bool(lines_with(pod.output, "not this pod's turn yet: eviction refused")),
        LOAD_SECONDS,
        lambda: "the refusal logged\n" + "".join(pod.output[-20:]),
    )
    assert REFUSED in lines_with(pod.output, "eviction refused")[0]
    assert get(pod.ready) == (200, "ready\n")  # refused: serving on
    fake_api.set_ready("llm-1", True)  # the other pod is ready: the budget allows one disruption
    assert fake_api.wait_for_answers(2, LOAD_SECONDS)[1] == (POD, 201)
    wait_until(
        lambda: bool(lines_with(pod.output, "drained: no request in flight")),
        LOAD_SECONDS,
        lambda: "the drain after the eviction\n" + "".join(pod.output[-20:]),
    )
    assert lines_with(pod.output, "restarting llama-server: manual")
    assert get(pod.ready) == (503, "not ready: draining\n")
    # The cluster restarts the pod: llama-server was not restarted here, and still answers until SIGTERM.
    assert len(lines_with(pod.output, "llama-server is ready after")) == 1
    assert ServerApi(pod.server).health() == 200
    # The kubelet's preStop finds the pod drained already.
    drain = pod.run("drain", "--state-dir", str(pod.state_dir), "--timeout", "30", timeout=60)
    assert drain.returncode == 0, drain.stderr
    terminate(pod)
