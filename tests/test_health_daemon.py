"""The health daemon against the real llama-server on the demo pair: real /metrics, real acceptance,
a real decay (the server process throttled with SIGSTOP/SIGCONT) leading to a real restart."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import UpProcess
from prometheus_client import CollectorRegistry
from test_launch import free_port, pid_alive

from appliance.gpu import Pynvml
from appliance.load import load_spec
from appliance.render import launch_document
from appliance.server_api import ServerApi, ServerUnreachable
from appliance.validate import validate
from health.daemon import DaemonConfig, HealthDaemon
from health.exporter import Metrics

pytestmark = pytest.mark.engine


def fast_demo(example: Callable[..., Path], server_port: int, exporter_port: int) -> Path:
    return example(
        "demo.toml",
        {
            "port = 8080": f"port = {server_port}",
            "port = 9478": f"port = {exporter_port}",
            "interval_seconds = 10": "interval_seconds = 1\nconsecutive = 2\nbaseline_windows = 3\ndecay_ratio = 0.7",
            "canary_after_idle_seconds = 60": "canary_after_idle_seconds = 0",
            "cooldown_seconds = 120": "cooldown_seconds = 0\nidle_timeout_seconds = 3",
        },
    )


class Traffic:
    """Back-to-back short completions from a thread, until stopped; errors during a restart are expected."""

    def __init__(self, api: ServerApi) -> None:
        self.api, self.stop, self.done = api, threading.Event(), 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.api.completion("def add(a, b):", n_predict=24, temperature=0, ignore_eos=True, timeout=30)
                self.done += 1
            except ServerUnreachable:
                time.sleep(0.2)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=40)


def scrape(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def metric(text: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def server_pids(output: list[str]) -> list[int]:
    return [int(m.group(1)) for line in list(output) if (m := re.search(r"started llama-server \(pid (\d+)\)", line))]


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def test_induced_decay_restarts_the_real_server(example: Callable[..., Path], appliance_up: UpProcess) -> None:
    server_port, exporter_port = free_port(), free_port()
    process, output = appliance_up(fast_demo(example, server_port, exporter_port))
    api = ServerApi(f"http://127.0.0.1:{server_port}", timeout=5)
    wait_until(lambda: len(server_pids(output)) == 1 and _healthy(api), 60, "the server to be ready")
    first = server_pids(output)[0]
    traffic = Traffic(api)
    try:
        wait_until(
            lambda: (
                (
                    metric(scrape(exporter_port), 'llm_appliance_decode_baseline_tokens_per_second{bucket="ctx<=1K"}')
                    or 0
                )
                > 0
            ),
            60,
            "a learned baseline",
        )
        baseline = metric(scrape(exporter_port), 'llm_appliance_decode_baseline_tokens_per_second{bucket="ctx<=1K"}')
        assert baseline is not None and baseline > 0
        acceptance = metric(scrape(exporter_port), "llm_appliance_speculation_acceptance_ratio")
        assert acceptance is not None and acceptance > 0.9  # the self-draft is accepted under greedy sampling

        # Throttle the real server: stopped two thirds of the time, its decode rate falls to about a third.
        throttle = threading.Event()

        def bursts() -> None:
            try:
                while not throttle.is_set():
                    os.kill(first, signal.SIGSTOP)
                    time.sleep(0.2)
                    os.kill(first, signal.SIGCONT)
                    time.sleep(0.1)
            except ProcessLookupError:
                pass  # restarted: the throttled process is gone

        threading.Thread(target=bursts, daemon=True).start()
        try:
            wait_until(
                lambda: len(server_pids(output)) >= 2,
                90,
                "a restart of the throttled server:\n" + "".join(output[-40:]),
            )
        finally:
            throttle.set()
            if pid_alive(first):
                os.kill(first, signal.SIGCONT)
    finally:
        traffic.close()
    text = scrape(exporter_port)
    assert metric(text, 'llm_appliance_restarts_total{reason="decay"}') == 1.0
    assert (metric(text, "llm_appliance_last_restart_timestamp_seconds") or 0) > time.time() - 300
    assert any("restarting llama-server: decay" in line for line in output)
    wait_until(lambda: not pid_alive(first), 15, "the old server to be gone")
    wait_until(lambda: _healthy(api), 60, "the restarted server to be ready")
    assert process.poll() is None


def _healthy(api: ServerApi) -> bool:
    try:
        return api.health() == 200
    except ServerUnreachable:
        return False


def test_a_draft_that_never_drafts_is_reported(example: Callable[..., Path], engine_binary: Path) -> None:
    server_port, exporter_port = free_port(), free_port()
    spec_path = fast_demo(example, server_port, exporter_port)
    argv = list(launch_document(validate(spec_path).plan)["argv"])
    at = argv.index("--spec-type")
    del argv[at : at + 2]  # what an older spec or a wrong dialect would run
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        api = ServerApi(f"http://127.0.0.1:{server_port}", timeout=5)
        wait_until(lambda: _healthy(api), 60, "the server to be ready")

        class Direct:
            def main_pid(self) -> int | None:
                return server.pid

            def active(self) -> bool:
                return server.poll() is None

            def restart(self, reason: str) -> None:
                raise AssertionError(f"no restart expected, got {reason}")

        metrics = Metrics(CollectorRegistry())
        config = DaemonConfig.from_spec(load_spec(spec_path).spec, state_file=spec_path.parent / "state.json")
        daemon = HealthDaemon(config, Direct(), Pynvml(), metrics)
        daemon.check()
        api.completion("def add(a, b):", n_predict=24, temperature=0, ignore_eos=True)
        seen = daemon.check()
        assert metrics.registry.get_sample_value("llm_appliance_speculation_engaged") == 0.0
        assert metrics.registry.get_sample_value("llm_appliance_draft_configured") == 1.0
        assert "SPECULATION NOT ENGAGED" in seen.status()
        assert seen.decode_tps is None or seen.decode_tps > 0
    finally:
        server.terminate()
        server.wait(20)
