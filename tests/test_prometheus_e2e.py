"""End to end: a real Prometheus, configured with the rendered scrape jobs and alert rules, scrapes the real
health daemon and the real llama-server of `llm-appliance up` (demo spec). Conditions are induced for real
and the alerts are watched through Prometheus's HTTP API until they fire, then until they resolve:

- llama-server stopped (SIGSTOP): /health stops answering, LlmApplianceServerDown fires; SIGCONT resolves it.
- the health daemon's process stopped (SIGSTOP of `up`, llama-server left running): its metrics are absent,
  LlmApplianceHealthDaemonDown fires; SIGCONT resolves it.

The spec's own [prometheus] settings make it fast: 1 s scrapes and a 2 s `for:` for the two alerts; the test's
prometheus.yml evaluates the rules every second.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import KeyFile, UpProcess
from test_health_daemon import server_pids, wait_ready, wait_until
from test_launch import free_port

from appliance.plan.resolved import resolve
from appliance.plan.validate import validate
from appliance.render.render import render
from appliance.runtime.server_api import ServerApi, ServerUnreachable

pytestmark = [pytest.mark.engine, pytest.mark.system]

PROMETHEUS = Path(os.environ.get("PROMETHEUS", "/usr/bin/prometheus"))
RULES = "etc/llm-appliance/rendered/prometheus/llm-appliance.rules.yml"
SCRAPE = "etc/llm-appliance/rendered/prometheus/scrape.yml"
FOR_SECONDS = 2
INTERVAL_SECONDS = 1  # the daemon's checks, Prometheus's scrapes and its rule evaluations alike
# Prometheus applies its scrape targets only this long after it starts (its discovery manager's fixed update
# period) while it evaluates rules at once.
TARGETS_SECONDS = 5
# One alert's way, firing or resolving: a check of the daemon, a scrape, the rule's `for:`, an evaluation. A busy
# 2-core box may stretch each several times over; every wait ends at its event, so only a failure waits this long.
ALERT_SECONDS = 10 * (INTERVAL_SECONDS + INTERVAL_SECONDS + FOR_SECONDS + INTERVAL_SECONDS)


def fast_spec(example: Callable[..., Path], server_port: int, exporter_port: int) -> Path:
    return example(
        "demo-draft.toml",
        {
            "port = 8080": f"port = {server_port}",
            "port = 9478": f"port = {exporter_port}",
            # A stopped server is down, not hung: `consecutive` high enough that no restart cures it for us.
            # Contention off (1.0): what these tests prove needs decode samples, and on a busy box each would
            # be contended and left unjudged (the daemon's contention has tests of its own).
            # The engine's own proof, whatever this machine's record says of its last change, judges nothing here
            # (the engine's regression is tested in test_engine_changes.py): these tests wait for no alert at all.
            "interval_seconds = 10": f"interval_seconds = {INTERVAL_SECONDS}\nconsecutive = 100\n"
            "contention_max_share = 1.0\nengine_regression = 0.99",
            "canary_after_idle_seconds = 60": "canary_after_idle_seconds = 0",
            'labels = { appliance = "demo" }': 'labels = { appliance = "demo" }\n'
            f"scrape_interval_seconds = {INTERVAL_SECONDS}\n"
            f"alert_for_seconds = {{ server_down = {FOR_SECONDS}, health_daemon_down = {FOR_SECONDS} }}",
        },
    )


def prometheus_config(spec: Path, directory: Path) -> Path:
    """prometheus.yml: the rendered scrape jobs under scrape_configs, the rendered rules, 1 s evaluation."""
    files = render(resolve(validate(spec).plan, spec))
    for relative in (RULES, SCRAPE):
        (directory / relative).parent.mkdir(parents=True, exist_ok=True)
        (directory / relative).write_text(files[relative])
    jobs = "".join(f"  {line}\n" for line in files[SCRAPE].splitlines() if line.strip())
    config = directory / "prometheus.yml"
    config.write_text(
        f"global:\n  scrape_interval: {INTERVAL_SECONDS}s\n  evaluation_interval: {INTERVAL_SECONDS}s\n"
        f"rule_files:\n  - {directory / RULES}\nscrape_configs:\n{jobs}"
    )
    return config


class Prometheus:
    def __init__(self, config: Path, directory: Path) -> None:
        if not PROMETHEUS.exists():
            pytest.fail(f"{PROMETHEUS} is missing (apt-get install prometheus; tests/run installs it)")
        self.port = free_port()
        self.log = directory / "prometheus.log"
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [
                    str(PROMETHEUS),
                    f"--config.file={config}",
                    f"--storage.tsdb.path={directory / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def get(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as response:
            body = response.read().decode()
        return json.loads(body)["data"] if path.startswith("/api/") else body

    def ready(self) -> bool:
        assert self.process.poll() is None, f"prometheus exited:\n{self.log.read_text()}"
        try:
            self.get("/-/ready")
            return True
        except OSError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/query", query=expr)["result"])

    def alerts(self, name: str | None = None) -> list[dict[str, Any]]:
        """Active alerts (pending or firing); a resolved alert is no longer listed."""
        found = list(self.get("/api/v1/alerts")["alerts"])
        return [a for a in found if name is None or a["labels"]["alertname"] == name]

    def firing(self, name: str) -> list[dict[str, Any]]:
        return [a for a in self.alerts(name) if a["state"] == "firing"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def healthy(api: ServerApi) -> bool:
    try:
        return api.health() == 200
    except ServerUnreachable:
        return False


class Timeline:
    """What happened when, seconds since the start: printed, and in every assertion message."""

    def __init__(self) -> None:
        self.start, self.events = time.monotonic(), list[str]()

    def __call__(self, what: str) -> float:
        now = time.monotonic() - self.start
        self.events.append(f"{now:6.1f} s  {what}")
        print(self.events[-1])
        return now

    def __str__(self) -> str:
        return "\n".join(self.events)


def test_alerts_fire_and_resolve_in_a_real_prometheus(
    example: Callable[..., Path],
    appliance_up: UpProcess,
    tmp_path: Path,
) -> None:
    t = Timeline()
    server_port, exporter_port = free_port(), free_port()
    spec = fast_spec(example, server_port, exporter_port)
    config = prometheus_config(spec, tmp_path / "prometheus")
    up, output = appliance_up(spec)
    api = ServerApi(f"http://127.0.0.1:{server_port}", timeout=2)
    wait_ready(up, output, 1)
    server = server_pids(output)[0]
    t(f"appliance up: llama-server pid {server}, `up` pid {up.pid}")

    prometheus = Prometheus(config, tmp_path / "prometheus")
    try:
        wait_until(prometheus.ready, 60, "prometheus to be ready")
        t("prometheus ready")

        # Both rendered jobs scrape: the health exporter and llama-server's own /metrics.
        wait_until(
            lambda: (
                bool(prometheus.query('up{job="llm-appliance-health", appliance="demo"} == 1'))
                and bool(prometheus.query('up{job="llm-appliance-llama-server", appliance="demo"} == 1'))
                and bool(prometheus.query('llm_appliance_server_up{appliance="demo"} == 1'))
            ),
            TARGETS_SECONDS + ALERT_SECONDS,
            lambda: f"both jobs scraped\n{t}",
        )
        assert prometheus.query('count({job="llm-appliance-llama-server", __name__=~"llamacpp:.+"}) > 0')
        rules = prometheus.get("/api/v1/rules")["groups"][0]["rules"]
        assert {r["name"] for r in rules} >= {"LlmApplianceServerDown", "LlmApplianceHealthDaemonDown"}
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
        # A healthy appliance pages for nothing. Prometheus applies its scrape targets only ~5 s after it
        # starts while it evaluates rules at once: with this test's 2 s `for:`, LlmApplianceHealthDaemonDown
        # may fire (nothing scraped yet) and resolve with the first scrape; the default 5m never sees it.
        seen: set[tuple[str, str]] = set()

        def quiet() -> bool:
            active = prometheus.alerts()
            seen.update((a["labels"]["alertname"], a["state"]) for a in active)
            return active == []

        wait_until(quiet, TARGETS_SECONDS + ALERT_SECONDS, lambda: f"no active alerts: {prometheus.alerts()}\n{t}")
        if seen:
            t(f"while Prometheus started: {sorted(seen)}")
        t("both jobs scraped, no active alerts")

        # -- llama-server stopped: LlmApplianceServerDown fires, and resolves once it answers again --
        os.kill(server, signal.SIGSTOP)
        stopped = t("llama-server SIGSTOPped")
        try:
            wait_until(
                lambda: bool(prometheus.firing("LlmApplianceServerDown")),
                ALERT_SECONDS,
                lambda: f"ServerDown firing\n{t}",
            )
            alert = prometheus.firing("LlmApplianceServerDown")[0]
            fired = t(f"LlmApplianceServerDown firing (job {alert['labels']['job']}, active since {alert['activeAt']})")
        finally:
            os.kill(server, signal.SIGCONT)
        t("llama-server SIGCONTed")
        assert alert["labels"]["severity"] == "critical"
        assert alert["labels"]["appliance"] == "demo"
        assert alert["annotations"]["summary"] == f"llama-server has not been ready for {FOR_SECONDS}s"
        assert fired - stopped >= FOR_SECONDS
        assert prometheus.firing("LlmApplianceHealthDaemonDown") == []  # the daemon is scraped all along
        wait_until(
            lambda: prometheus.alerts("LlmApplianceServerDown") == [],
            ALERT_SECONDS,
            lambda: f"ServerDown resolved\n{t}",
        )
        t("LlmApplianceServerDown resolved")
        assert healthy(api)

        # -- the health daemon's process stopped, llama-server still serving: HealthDaemonDown --
        os.kill(up.pid, signal.SIGSTOP)
        t("`up` (launcher, health daemon, exporter) SIGSTOPped; llama-server keeps running")
        try:
            wait_until(
                lambda: bool(prometheus.firing("LlmApplianceHealthDaemonDown")),
                ALERT_SECONDS,
                lambda: f"HealthDaemonDown firing\n{t}",
            )
            alert = prometheus.firing("LlmApplianceHealthDaemonDown")[0]
            t("LlmApplianceHealthDaemonDown firing")
            assert prometheus.firing("LlmApplianceServerDown") == []  # the server itself still answers
        finally:
            os.kill(up.pid, signal.SIGCONT)
        t("`up` SIGCONTed")
        assert alert["labels"] == {
            "alertname": "LlmApplianceHealthDaemonDown",
            "severity": "critical",
            "appliance": "demo",
        }
        wait_until(
            lambda: prometheus.alerts("LlmApplianceHealthDaemonDown") == [],
            ALERT_SECONDS,
            lambda: f"HealthDaemonDown resolved\n{t}",
        )
        t("LlmApplianceHealthDaemonDown resolved")
        wait_until(
            lambda: prometheus.alerts() == [],
            ALERT_SECONDS,
            lambda: f"no active alerts at the end: {prometheus.alerts()}\n{t}",
        )
        assert server_pids(output) == [server]  # nothing was cured by a restart: the alerts followed the real state
        assert up.poll() is None
    finally:
        prometheus.stop()


def test_a_server_of_several_keys_is_scraped_with_the_scrape_key_not_the_whole_key_file(
    example: Callable[..., Path], key_file: KeyFile, tmp_path: Path
) -> None:
    """llama-server takes one key per line; Prometheus sends a credentials file whole, as one bearer token.
    The rendered job sends prometheus.scrape_key_file and is answered; the job as rendered before (the whole
    key file of two keys) is not, and LlmApplianceServerDown would fire on a healthy server."""
    keys = key_file("sk-clients-1f2e", "sk-prometheus-9c8b")
    scrape_key = key_file("sk-prometheus-9c8b", name="scrape-key", group=0)  # Prometheus runs as root here
    server_port, exporter_port = free_port(), free_port()
    spec = fast_spec(example, server_port, exporter_port)
    spec.write_text(
        spec.read_text()
        .replace("[server]\n", f'[server]\napi_key_file = "{keys}"\n')
        .replace("[prometheus]\n", f'[prometheus]\nscrape_key_file = "{scrape_key}"\n')
    )
    config = prometheus_config(spec, tmp_path / "prometheus")
    rendered = config.read_text()
    assert f'credentials_file: "{scrape_key}"' in rendered
    before = rendered.split("  - job_name: llm-appliance-llama-server\n")[1]
    before = "  - job_name: as-rendered-before\n" + before.replace(str(scrape_key), str(keys))
    config.write_text(rendered + before)
    appliance = resolve(validate(spec).plan, spec)
    server = subprocess.Popen(appliance.argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    prometheus = Prometheus(config, tmp_path / "prometheus")
    try:
        api = ServerApi(f"http://127.0.0.1:{server_port}", timeout=2)
        wait_until(lambda: healthy(api), 120, "llama-server to load")
        for key in ("sk-clients-1f2e", "sk-prometheus-9c8b"):
            assert ServerApi(api.base_url, key, timeout=5).metrics(), key  # each line is a key of its own
        with pytest.raises(ServerUnreachable, match="answered 401"):
            ServerApi(api.base_url, "sk-clients-1f2e sk-prometheus-9c8b", timeout=5).metrics()
        wait_until(prometheus.ready, 60, "prometheus to be ready")

        def scraped() -> dict[str, float]:
            return {r["metric"]["job"]: float(r["value"][1]) for r in prometheus.query('up{appliance="demo"}')}

        def errors() -> dict[str, str]:
            return {t["labels"]["job"]: t["lastError"] for t in prometheus.get("/api/v1/targets")["activeTargets"]}

        wait_until(
            lambda: scraped().get("llm-appliance-llama-server") == 1.0 and "as-rendered-before" in scraped(),
            TARGETS_SECONDS + ALERT_SECONDS,
            lambda: f"the rendered job to scrape llama-server: {errors()}",
        )
        assert scraped()["as-rendered-before"] == 0.0  # the bug: a healthy server reads as down
        # Go refuses to send the two lines as one header: the scrape fails before it reaches the server.
        assert 'invalid header field value for "Authorization"' in errors()["as-rendered-before"]
    finally:
        prometheus.stop()
        server.terminate()
        server.wait(30)
