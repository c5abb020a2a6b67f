"""Local first, the upstream as the fallback, for real: the demo appliance behind the rendered router (LiteLLM's
proxy from its hash-pinned venv), and an "upstream" that is a second real llama-server, under another model
name, in a network namespace of its own (10.78.0.2, joined to this one by a veth link made here).

- `up` with [fallback] starts the router beside the appliance: answered locally (the openai SDK, streaming
  requests of our own client too), then a draining restart sends new requests to the upstream with none failed,
  and they come back to the local server once it is ready.
- The router as its own unit would run it (`llm-appliance router` from its rendered router.json, beside an `up` of
  the same spec without [fallback]): `kill -9` of llama-server sends requests to the upstream with none failed,
  and they return once `up` has started it again (as the server unit's Restart= would).

Who answered is what the router says in each answer's x-litellm-model-id header ("local" or "fallback"), and
the upstream's answers name its own model. The counts are printed (pytest -s) for the record.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import start_up
from prometheus_client.parser import text_string_to_metric_families
from test_health_daemon import server_pids, wait_ready, wait_until
from test_launch import LOAD_SECONDS, free_port

from appliance.facts.engine_record import EngineRecord, record_file
from appliance.facts.machine import router_missing
from appliance.health.router import LITELLM
from appliance.runtime.server_api import ServerApi, Streamed
from appliance.system import metric_names as metric
from appliance.system import paths

pytestmark = [pytest.mark.engine, pytest.mark.system]

HOST_V4, UPSTREAM_V4, UPSTREAM_PORT = "10.78.0.1", "10.78.0.2", 8000
UPSTREAM_MODEL = "upstream-model"
ANSWERED_BY = "x-litellm-model-id"
ROUTER_START_SECONDS = 300.0  # LiteLLM imports for a while on a busy 2-core box
REQUEST_SECONDS = 120.0


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def upstream(smollm2: Path) -> Iterator[str]:
    """A second llama-server, the demo model under another name, alone in its namespace; its base URL."""
    if not LITELLM.is_file():
        pytest.fail(f"{LITELLM} is missing: `llm-appliance router-install` makes it (.ci/run does)")
    namespace = f"lla-upstream-{os.getpid()}"
    _ip("netns", "add", namespace)
    server: subprocess.Popen[str] | None = None
    try:
        _ip("link", "add", "lla-up0", "type", "veth", "peer", "name", "lla-up1", "netns", namespace)
        _ip("addr", "add", f"{HOST_V4}/24", "dev", "lla-up0")
        _ip("link", "set", "lla-up0", "up")
        _ip("-n", namespace, "addr", "add", f"{UPSTREAM_V4}/24", "dev", "lla-up1")
        _ip("-n", namespace, "link", "set", "lla-up1", "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        binary = paths.engine_binary(paths.ENGINE_DIR)
        argv = [str(binary), "-m", str(smollm2), "--host", UPSTREAM_V4, "--port", str(UPSTREAM_PORT)]
        argv += ["--alias", UPSTREAM_MODEL, "-c", "2048", "-t", "1", "--log-verbosity", "2"]
        # The rung this machine proved (--no-repack where ggml's AMX kernels die while loading).
        record = EngineRecord.read(record_file(binary, paths.ENGINE_DIR))
        argv += record.extra_args if record else ()
        server = subprocess.Popen(
            ["ip", "netns", "exec", namespace, *argv],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "LD_LIBRARY_PATH": str(binary.parent)},
        )
        api = ServerApi(f"http://{UPSTREAM_V4}:{UPSTREAM_PORT}", timeout=2)

        def up() -> bool:
            assert server is not None and server.poll() is None, "the upstream llama-server exited"
            try:
                return api.health() == 200
            except Exception:
                return False

        wait_until(up, LOAD_SECONDS, "the upstream llama-server in its namespace")
        yield f"http://{UPSTREAM_V4}:{UPSTREAM_PORT}/v1"
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
        subprocess.run(["ip", "link", "del", "lla-up0"], capture_output=True)
        subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)


def fallback_spec(example: Callable[..., Path], upstream: str, router_port: int, with_fallback: bool = True) -> Path:
    """The shipped demo-fallback.toml on free ports, checked every second, cooling the local server down 2 s."""
    fallback = f'base_url = "{upstream}"\nmodel = "{UPSTREAM_MODEL}"\nwhen = "both"\nport = {router_port}\ncooldown_seconds = 2'
    edits = {
        "port = 8080": f"port = {free_port()}",
        "port = 9478": f"port = {free_port()}",
        "interval_seconds = 10": "interval_seconds = 1",
        "canary_after_idle_seconds = 60": "canary_after_idle_seconds = 0",
        "cooldown_seconds = 120": "cooldown_seconds = 0\nidle_timeout_seconds = 30",
    }
    spec = example("demo-fallback.toml", edits)
    text = spec.read_text()
    start, end = text.index("[fallback]\n"), text.index("[health]")
    spec.write_text(text[:start] + (f"[fallback]\n{fallback}\n\n" if with_fallback else "") + text[end:])
    return spec


class Traffic:
    """One client sending streamed chat completions through the router back to back, until stopped."""

    def __init__(self, router: ServerApi) -> None:
        self.router, self.answers = router, list[Streamed]()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(REQUEST_SECONDS)

    def _run(self) -> None:
        while not self.stopping.is_set():
            self.answers.append(ask(self.router))

    def count(self, since: int = 0) -> Counter[str]:
        return Counter(a.served_by if a.complete else f"failed: {a.error}" for a in self.answers[since:])

    def wait_for(self, who: str, since: int) -> None:
        wait_until(lambda: self.count(since)[who] > 0, LOAD_SECONDS, lambda: f"an answer by {who}: {self.count(since)}")


def ask(router: ServerApi) -> Streamed:
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
    return router.stream("/v1/chat/completions", body, REQUEST_SECONDS, served_by_header=ANSWERED_BY)


def router_answers(port: int) -> dict[str, float]:
    """The router's answers by backend, from its /metrics/ (LiteLLM's exposition)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics/", timeout=30) as response:
        text = response.read().decode()
    answers: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == metric.ROUTER_ANSWERS_TOTAL:
                model = sample.labels["model_id"]
                answers[model] = answers.get(model, 0.0) + sample.value
    return answers


def wait_router(router: ServerApi, process: subprocess.Popen[bytes] | None = None, log: Path | None = None) -> None:
    def alive() -> bool:
        assert process is None or process.poll() is None, "the router exited:\n" + (log.read_text() if log else "")
        try:
            return router.call("/health/liveliness") is not None
        except Exception:
            return False

    wait_until(alive, ROUTER_START_SECONDS, "the router to answer /health/liveliness")


def test_up_starts_the_router_local_first_and_a_draining_restart_goes_upstream(
    example: Callable[..., Path], upstream: str, tmp_path: Path
) -> None:
    from openai import OpenAI

    router_port = free_port()
    spec = fallback_spec(example, upstream, router_port)
    state = tmp_path / "state"
    process, output = start_up(spec, "--state-dir", state, "--stop-timeout", "5", "--as-current-user")
    try:
        wait_ready(process, output, 1)
        router = ServerApi(f"http://127.0.0.1:{router_port}", timeout=10)
        wait_router(router)
        wait_until(lambda: ask(router).served_by == "local", LOAD_SECONDS, "an answer by the local server")
        # The openai SDK, as a client is told to use it: base URL, key, the local alias.
        client = OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="no-key-asked")
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
        )
        assert raw.headers[ANSWERED_BY] == "local" and raw.parse().model == "smollm2-135m-instruct"

        with Traffic(router) as traffic:
            traffic.wait_for("local", 0)
            restart = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "appliance.cli.main",
                    "restart",
                    "--when-idle",
                    "--reason",
                    "manual",
                    "--state-dir",
                    str(state),
                ],
                capture_output=True,
                text=True,
                timeout=REQUEST_SECONDS,
            )
            assert restart.returncode == 0, restart.stderr
            wait_ready(process, output, 2)  # llama-server loaded again: requests meanwhile went upstream
            traffic.wait_for("fallback", 0)
            back = len(traffic.answers)
            traffic.wait_for("local", back)  # and come home once it is warm and ready
        counts = traffic.count()
        print(f"\nup + router, draining restart: sent {len(traffic.answers)}, {dict(counts)}")
        assert set(counts) == {"local", "fallback"}, counts  # none failed
        # The router's own metrics count the answers by backend, as its Prometheus job scrapes them.
        answered = router_answers(router_port)
        assert answered["local"] >= counts["local"] and answered["fallback"] >= counts["fallback"], answered
        shown = subprocess.run(
            [sys.executable, "-m", "appliance.cli.main", "status", str(spec), "--state-dir", str(state), "--json"],
            capture_output=True,
            text=True,
            timeout=REQUEST_SECONDS,
        )
        share = json.loads(shown.stdout)["fallback_share"]
        assert share == pytest.approx(answered["fallback"] / sum(answered.values()), abs=0.2), shown.stdout
        # The upstream answered as itself; the local server under the alias clients send.
        models = {(a.served_by, a.model) for a in traffic.answers}
        assert models == {("local", "smollm2-135m-instruct"), ("fallback", UPSTREAM_MODEL)}, models
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def test_the_router_unit_sends_upstream_while_llama_server_is_killed(
    example: Callable[..., Path], upstream: str, tmp_path: Path
) -> None:
    router_port = free_port()
    with_router = fallback_spec(example, upstream, router_port)
    rendered = tmp_path / "root"
    render = subprocess.run(
        [sys.executable, "-m", "appliance.cli.main", "render", str(with_router), "--out", str(rendered)],
        capture_output=True,
        text=True,
        timeout=REQUEST_SECONDS,
    )
    assert render.returncode == 0, render.stderr
    config_dir = rendered / paths.ROUTER_DIR.relative_to("/")
    # The same appliance without [fallback] under `up`: the router runs on its own, as its unit does.
    plain = with_router.with_name("plain.toml")
    text = with_router.read_text()
    plain.write_text(text[: text.index("[fallback]\n")] + text[text.index("[health]") :])
    state = tmp_path / "state"
    # As root, as the other tests' `up`: pytest's directories (0700) are closed to the router's user.
    router_log = tmp_path / "router.log"
    router_command = ["router", "--config-dir", str(config_dir), "--as-current-user"]
    with router_log.open("w") as log:
        router_process = subprocess.Popen(
            [sys.executable, "-m", "appliance.cli.main", *router_command], stdout=log, stderr=subprocess.STDOUT
        )
    up, output = start_up(plain, "--state-dir", state, "--stop-timeout", "5", "--as-current-user")
    try:
        wait_ready(up, output, 1)
        router = ServerApi(f"http://127.0.0.1:{router_port}", timeout=10)
        wait_router(router, router_process, router_log)
        wait_until(lambda: ask(router).served_by == "local", LOAD_SECONDS, "an answer by the local server")
        with Traffic(router) as traffic:
            traffic.wait_for("local", 0)
            killed_at = len(traffic.answers)
            os.kill(server_pids(output)[0], signal.SIGKILL)
            traffic.wait_for("fallback", killed_at)
            wait_ready(up, output, 2)  # `up` starts it again RestartSec= later, as the server unit's Restart= would
            back = len(traffic.answers)
            traffic.wait_for("local", back)
        counts = traffic.count()
        print(f"\nrouter unit, kill -9 of llama-server: sent {len(traffic.answers)}, {dict(counts)}")
        # The one request in flight on the killed server may be cut; every one sent after it was answered.
        assert set(traffic.count(killed_at + 1)) <= {"local", "fallback"}, traffic.count(killed_at + 1)
    finally:
        for running in (up, router_process):
            if running.poll() is None:
                running.send_signal(signal.SIGTERM)
                running.wait(60)


def test_validate_knows_whether_the_router_can_start_here(tmp_path: Path) -> None:
    assert router_missing() is None  # .ci/run installed it
    missing = router_missing(tmp_path / "no-venv", "llm-appliance-no-such-user")
    assert missing == f"its virtualenv {tmp_path / 'no-venv'} (LiteLLM's proxy) and its user llm-appliance-no-such-user"


def test_the_litellm_binary_is_the_pinned_one() -> None:
    """The router's venv holds what router-requirements.txt pins (pip refused anything else when it installed)."""
    pip = LITELLM.parent / "pip"
    shown = subprocess.run([str(pip), "show", "litellm"], capture_output=True, text=True, check=True).stdout
    assert "Version: 1.80.0" in shown
    assert shutil.which("litellm") != str(LITELLM)  # not on anyone's PATH: only the router runs it


CLIENT_KEY = "sk-client-5d1e9a"  # server.api_key_file's second key: every key the server takes is a client's
ALIAS = "smollm2-135m-instruct"


def _rendered_router(spec: Path, tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """The router as its unit runs it, from the files `render` wrote for `spec`; its log beside."""
    rendered = tmp_path / "root"
    render = subprocess.run(
        [sys.executable, "-m", "appliance.cli.main", "render", str(spec), "--out", str(rendered)],
        capture_output=True,
        text=True,
        timeout=REQUEST_SECONDS,
    )
    assert render.returncode == 0, render.stderr
    config_dir = rendered / paths.ROUTER_DIR.relative_to("/")
    log_path = tmp_path / "router.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "appliance.cli.main",
                "router",
                "--config-dir",
                str(config_dir),
                "--as-current-user",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return process, log_path


def _post(port: int, path: str, body: dict[str, object] | None, key: str | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_SECONDS) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def _chat(model: str = ALIAS, **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, **extra}


def test_a_client_of_the_router_reaches_the_local_alias_alone_and_is_not_its_admin(
    example: Callable[..., Path], upstream: str, tmp_path: Path, key_file: Callable[..., Path]
) -> None:
    """issue 36, router: the master key was the clients' key (every client the proxy's admin), and any client
    could ask for model "fallback" and go straight to the upstream, private or not."""
    router_port = free_port()
    spec = fallback_spec(example, upstream, router_port)
    keys = key_file("sk-server-first-77aa", CLIENT_KEY)
    scrape = key_file("sk-server-first-77aa", name="scrape-key")
    text = spec.read_text().replace("[server]\n", f'[server]\napi_key_file = "{keys}"\n')
    spec.write_text(text.replace("[prometheus]\n", f'[prometheus]\nscrape_key_file = "{scrape}"\n'))
    process, log = _rendered_router(spec, tmp_path)
    try:
        wait_router(ServerApi(f"http://127.0.0.1:{router_port}", timeout=10), process, log)
        # No llama-server runs: the alias goes upstream, as a client of the router is entitled to.
        status, answer = _post(router_port, "/v1/chat/completions", _chat(), CLIENT_KEY)
        assert status == 200, answer
        assert (
            _post(router_port, "/v1/completions", {"model": ALIAS, "prompt": "Hi", "max_tokens": 2}, CLIENT_KEY)[0]
            == 200
        )
        for key in (None, "sk-not-a-key"):
            assert _post(router_port, "/v1/chat/completions", _chat(), key)[0] == 401
        # The upstream's model group by name, and LiteLLM's own steering, are refused before any backend.
        refused = [
            _chat("fallback"),
            _chat(mock_testing_fallbacks=True),
            _chat(fallbacks=["fallback"]),
            _chat(user_config={"model_list": []}),
            _chat(metadata={"tags": ["x"]}),
        ]
        for body in refused:
            status, answer = _post(router_port, "/v1/chat/completions", body, CLIENT_KEY)
            assert status == 403, (body, answer)
        # An api_base of the client's own: LiteLLM refuses it itself (401), before the clients' door.
        assert _post(router_port, "/v1/chat/completions", _chat(api_base="http://192.0.2.1/v1"), CLIENT_KEY)[0] == 401
        # The admin's routes are no client's, the server's key included.
        for path, body in (
            ("/key/generate", {}),
            ("/model/new", {"model_name": "x", "litellm_params": {"model": "openai/x"}}),
            ("/v1/models", None),
            ("/health", None),
        ):
            for key in (CLIENT_KEY, "sk-server-first-77aa"):
                status, answer = _post(router_port, path, body, key)
                assert status == 403, (path, answer)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def test_a_router_without_a_server_key_has_no_admin_anyone_can_be(
    example: Callable[..., Path], upstream: str, tmp_path: Path
) -> None:
    """issue 36, router: without server.api_key_file LiteLLM had no master key, so anyone local was its admin."""
    router_port = free_port()
    process, log = _rendered_router(fallback_spec(example, upstream, router_port), tmp_path)
    try:
        wait_router(ServerApi(f"http://127.0.0.1:{router_port}", timeout=10), process, log)
        assert _post(router_port, "/v1/chat/completions", _chat())[0] == 200  # no key asked, as the server asks none
        assert _post(router_port, "/v1/chat/completions", _chat("fallback"))[0] == 403
        assert _post(router_port, "/v1/models", None)[0] == 403
        assert _post(router_port, "/key/generate", {})[0] == 403
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
