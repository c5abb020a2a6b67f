"""The health daemon against the real llama-server on the demo pair: real /metrics, real acceptance,
a real decay (the server process throttled with SIGSTOP/SIGCONT) leading to a real restart."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import UpProcess, resolved
from prometheus_client import CollectorRegistry
from test_launch import LOAD_SECONDS, free_port, pid_alive

from appliance.facts.gpu import Pynvml
from appliance.health.daemon import DaemonConfig, HealthDaemon
from appliance.health.detectors import DecayDetector
from appliance.health.exporter import Metrics
from appliance.runtime.server_api import ServerApi, ServerUnreachable
from appliance.spec.load import load_spec

pytestmark = pytest.mark.engine


def fast_demo(example: Callable[..., Path], server_port: int, exporter_port: int, health: str = "") -> Path:
    return example(
        "demo-draft.toml",
        {
            "port = 8080": f"port = {server_port}",
            "port = 9478": f"port = {exporter_port}",
            "interval_seconds = 10": health
            + "interval_seconds = 1\nconsecutive = 2\nbaseline_windows = 3\ndecay_ratio = 0.7",
            "canary_after_idle_seconds = 60": "canary_after_idle_seconds = 0",
            "cooldown_seconds = 120": "cooldown_seconds = 0\nidle_timeout_seconds = 3",
        },
    )


# Traffic's per-request limit; no request completing for twice as long means the traffic, not the daemon, is stuck.
REQUEST_SECONDS = 60.0
# How many times over the daemon gets what the spec says it needs before a missing event counts as a failure.
SLACK = 3


class Traffic:
    """Back-to-back short completions from a thread, until stopped; errors during a restart are expected."""

    def __init__(self, api: ServerApi) -> None:
        self.api, self.stop, self.done = api, threading.Event(), 0
        self.last_done = time.monotonic()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.api.completion(
                    "def add(a, b):", n_predict=16, temperature=0, ignore_eos=True, timeout=REQUEST_SECONDS
                )
                self.done += 1
                self.last_done = time.monotonic()
            except ServerUnreachable:
                time.sleep(0.2)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=REQUEST_SECONDS + 10)


class Windows:
    """A budget counted in the daemon's own windows: one per check (every interval_seconds) that saw at least one
    completed request. It is spent only once both SLACK x `count` intervals (plus `then_seconds`) have passed and
    the traffic has completed SLACK x `count` requests since it was made, so a slow machine lengthens the wait
    instead of failing it; traffic that completes nothing for long is reported as such."""

    def __init__(self, traffic: Traffic, interval: float, count: int, then_seconds: float = 0.0) -> None:
        self.traffic = traffic
        self.requests = traffic.done + SLACK * count
        self.until = time.monotonic() + SLACK * count * interval + then_seconds

    def __call__(self) -> bool:
        stalled = time.monotonic() - self.traffic.last_done
        assert stalled < 2 * REQUEST_SECONDS, f"no request completed for {stalled:.0f} s: the traffic is stuck"
        return time.monotonic() >= self.until and self.traffic.done >= self.requests


def scrape(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def metric(text: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def server_pids(output: list[str]) -> list[int]:
    return [int(m.group(1)) for line in list(output) if (m := re.search(r"started llama-server \(pid (\d+)\)", line))]


def lines_with(output: list[str], text: str) -> list[str]:
    return [line for line in list(output) if text in line]


def wait_until(
    condition: Callable[[], bool], budget: float | Callable[[], bool], what: str | Callable[[], str]
) -> None:
    """Poll `condition`; fail when the budget is spent: seconds, or a predicate that says when."""
    deadline = time.monotonic() + (0.0 if callable(budget) else budget)
    while not condition():
        spent = budget() if callable(budget) else time.monotonic() >= deadline
        assert not spent, f"timed out waiting for {what() if callable(what) else what}"
        time.sleep(0.25)


def wait_ready(process: subprocess.Popen[str], output: list[str], count: int) -> None:
    """The launcher's own event: its `count`-th "llama-server is ready" line; `up` exiting fails at once."""

    def ready() -> bool:
        assert process.poll() is None, "`up` exited:\n" + "".join(output[-40:])
        return len(lines_with(output, "llama-server is ready after")) >= count

    wait_until(ready, LOAD_SECONDS, lambda: f"llama-server to be ready ({count})\n" + "".join(output[-40:]))


def test_induced_decay_restarts_the_real_server(
    example: Callable[..., Path], appliance_up: UpProcess, tmp_path: Path
) -> None:
    server_port, exporter_port = free_port(), free_port()
    spec_path = fast_demo(example, server_port, exporter_port)
    spec = load_spec(spec_path).spec
    health, restart = spec.health, spec.restart
    median_of = DecayDetector(health.decay_ratio, health.consecutive, health.baseline_windows).median_of
    process, output = appliance_up(spec_path)
    api = ServerApi(f"http://127.0.0.1:{server_port}", timeout=5)
    wait_ready(process, output, 1)
    first = server_pids(output)[0]
    bucket = '{bucket="ctx<=1K"}'

    def daemon_state() -> str:
        text = scrape(exporter_port)
        seen = {
            name: metric(text, f"llm_appliance_{name}{bucket}")
            for name in ("decode_tokens_per_second", "decode_baseline_tokens_per_second", "decode_decay_breaches")
        }
        return f"{seen}, {traffic.done} requests done\n" + "".join(output[-40:])

    traffic = Traffic(api)
    try:
        # The first check only sets the counters' start; baseline_windows windows after it learn the baseline.
        wait_until(
            lambda: (
                (metric(scrape(exporter_port), f"llm_appliance_decode_baseline_tokens_per_second{bucket}") or 0) > 0
            ),
            Windows(traffic, health.interval_seconds, health.baseline_windows + 1),
            lambda: "a learned baseline: " + daemon_state(),
        )
        baseline = metric(scrape(exporter_port), f"llm_appliance_decode_baseline_tokens_per_second{bucket}")
        assert baseline is not None and baseline > 0
        acceptance = metric(scrape(exporter_port), "llm_appliance_speculation_acceptance_ratio")
        assert acceptance is not None and acceptance > 0.9  # the self-draft is accepted under greedy sampling

        # Throttle the real server: stopped about nine tenths of the time, its decode rate falls to about a
        # tenth, far below decay_ratio x any baseline a busy box could have learned. The stops are short, so
        # /health and /metrics still answer within the probe timeout (0.8 x interval_seconds).
        throttle = threading.Event()
        throttled_at = time.time()

        def bursts() -> None:
            try:
                while not throttle.is_set():
                    os.kill(first, signal.SIGSTOP)
                    time.sleep(0.2)
                    os.kill(first, signal.SIGCONT)
                    time.sleep(0.02)
            except ProcessLookupError:
                pass  # restarted: the throttled process is gone

        threading.Thread(target=bursts, daemon=True).start()
        try:
            # median_of windows turn the median low, `consecutive` breaches want the restart, which waits for
            # idle (the traffic never is) at most idle_timeout_seconds and happens at the next check.
            wait_until(
                lambda: bool(lines_with(output, "restarting llama-server:")),
                Windows(
                    traffic,
                    health.interval_seconds,
                    median_of + health.consecutive,
                    restart.idle_timeout_seconds + health.interval_seconds,
                ),
                lambda: "a restart of the throttled server: " + daemon_state(),
            )
        finally:
            throttle.set()
            if pid_alive(first):
                os.kill(first, signal.SIGCONT)
        assert "restarting llama-server: decay" in lines_with(output, "restarting llama-server:")[0]
        # The launcher stops the old server (stop_timeout at most) before it starts the new one.
        wait_ready(process, output, 2)
    finally:
        traffic.close()
    pids = server_pids(output)
    assert len(pids) == 2 and pids[0] == first
    assert not pid_alive(first)
    assert _healthy(api)
    text = scrape(exporter_port)
    assert metric(text, 'llm_appliance_restarts_total{reason="decay"}') == 1.0
    assert (metric(text, "llm_appliance_last_restart_timestamp_seconds") or 0) >= throttled_at
    state = json.loads((tmp_path / "state" / "health-state.json").read_text())
    assert state["totals"] == {"decay": 1}
    assert process.poll() is None


def _healthy(api: ServerApi) -> bool:
    try:
        return api.health() == 200
    except ServerUnreachable:
        return False


def test_a_draft_that_never_drafts_is_reported(example: Callable[..., Path], engine_binary: Path) -> None:
    server_port, exporter_port = free_port(), free_port()
    spec_path = fast_demo(example, server_port, exporter_port)
    argv = list(resolved(spec_path).argv)
    at = argv.index("--spec-type")
    del argv[at : at + 2]  # what an older spec or a wrong dialect would run
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        api = ServerApi(f"http://127.0.0.1:{server_port}", timeout=5)
        wait_until(lambda: _healthy(api), LOAD_SECONDS, "the server to be ready")

        class Direct:
            def main_pid(self) -> int | None:
                return server.pid

            def active(self) -> bool:
                return server.poll() is None

            def restart(self, reason: str) -> None:
                raise AssertionError(f"no restart expected, got {reason}")

        metrics = Metrics(CollectorRegistry())
        config = DaemonConfig(resolved(spec_path, state_file=spec_path.parent / "state.json"))
        daemon = HealthDaemon(config, Direct(), Pynvml(), metrics)
        daemon.check()
        api.completion("def add(a, b):", n_predict=24, temperature=0, ignore_eos=True)
        seen = daemon.check()
        assert metrics.registry.get_sample_value("llm_appliance_speculation_engaged") == 0.0
        assert metrics.registry.get_sample_value("llm_appliance_draft_configured") == 1.0
        assert metrics.registry.get_sample_value("llm_appliance_speculation_configured") == 1.0
        assert "SPECULATION NOT ENGAGED" in seen.status()
        assert seen.decode_tps is None or seen.decode_tps > 0
    finally:
        server.terminate()
        server.wait(20)


def test_restart_under_up_goes_through_the_running_daemon(
    example: Callable[..., Path], appliance_up: UpProcess, tmp_path: Path
) -> None:
    """`llm-appliance restart` without systemd: the request reaches the daemon of `up` through its state
    directory, and the launcher restarts llama-server (no systemctl anywhere)."""
    spec_path = fast_demo(example, free_port(), free_port())
    process, output = appliance_up(spec_path)
    wait_ready(process, output, 1)
    command = [sys.executable, "-m", "appliance.cli.main", "restart", "--when-idle", "--state-dir", tmp_path / "state"]
    asked = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert asked.returncode == 0, asked.stderr
    assert "the health daemon took the manual restart" in asked.stderr
    wait_ready(process, output, 2)
    assert "restarting llama-server: manual" in lines_with(output, "restarting llama-server:")[0]
    state = json.loads((tmp_path / "state" / "health-state.json").read_text())
    assert state["totals"] == {"manual": 1}
    assert not list((tmp_path / "state").glob("restart-*.json")), "the request is gone once carried out"


def test_restart_without_a_daemon_to_take_it_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.health import service

    monkeypatch.setattr(service, "ADOPT_TIMEOUT_SECONDS", 0.5)
    (tmp_path / "state").mkdir()
    assert service.request_restart(tmp_path / "state", "manual", None) == 3
    assert not list((tmp_path / "state").iterdir()), "the unanswered request is withdrawn"


def test_restart_by_someone_who_may_not_write_the_state_directory_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from appliance.health import service

    # Not a directory anyone could write in (what a 0700 directory of another user is to an admin).
    (tmp_path / "a-file").write_text("")
    assert service.request_restart(tmp_path / "a-file" / "state", "manual", None) == 2
    assert "cannot leave the restart request in" in caplog.text
