"""`llm-appliance status` against the real demo appliance under `up`: healthy, then down while llama-server is
stopped (SIGSTOP: it accepts and never answers), then healthy again; and the verdicts on their own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import UpProcess
from test_health_daemon import server_pids, wait_ready, wait_until
from test_launch import free_port

from appliance.health.peers import Peer
from appliance.ops.status import EXIT, Status, Unit, assess, format_status
from appliance.system import paths


def calm_demo(example: Callable[..., Path]) -> Path:
    """The demo on free ports, checked every 2 s, no canary: no traffic, so no decode window and no restart."""
    return example(
        "demo-draft.toml",
        {
            "port = 8080": f"port = {free_port()}",
            "port = 9478": f"port = {free_port()}",
            "interval_seconds = 10": "interval_seconds = 2",
            "canary_after_idle_seconds = 60": "canary_after_idle_seconds = 0",
        },
    )


def status(spec: Path, state: Path, *options: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "appliance.cli.main", "status", str(spec), "--state-dir", str(state), *options]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.mark.engine
def test_status_of_the_real_demo_healthy_then_down_then_healthy(
    example: Callable[..., Path], appliance_up: UpProcess, tmp_path: Path
) -> None:
    spec = calm_demo(example)
    process, output = appliance_up(spec)
    wait_ready(process, output, 1)
    state = tmp_path / "state"
    # The daemon's first check (its warm-up completion) makes /ready say 200.
    wait_until(lambda: status(spec, state).returncode == EXIT["healthy"], 120, lambda: status(spec, state).stdout)
    shown = status(spec, state)
    lines = shown.stdout.splitlines()
    assert lines[0] == f"llm-appliance: HEALTHY (/etc/llm-appliance/{spec.name}, up, no systemd)", shown.stdout
    assert "server   /health ok; /ready ready" in lines
    assert any(line.startswith("versions ") and "llama_cpp" in line for line in lines), shown.stdout
    assert any(line.startswith("draft    engaged") for line in lines), shown.stdout
    document = json.loads(status(spec, state, "--json").stdout)
    assert document["health"] == "healthy" and document["exit_code"] == 0 and document["mode"] == "up"
    assert document["ready"]["ready"] is True

    server = server_pids(output)[0]
    os.kill(server, signal.SIGSTOP)
    try:
        shown = status(spec, state)
        assert shown.returncode == EXIT["down"], shown.stdout
        assert shown.stdout.startswith("llm-appliance: DOWN"), shown.stdout
        assert "  ! llama-server /health: unreachable" in shown.stdout
    finally:
        os.kill(server, signal.SIGCONT)
    wait_until(lambda: status(spec, state).returncode == EXIT["healthy"], 120, lambda: status(spec, state).stdout)


def test_status_with_nothing_running_is_down(example: Callable[..., Path], tmp_path: Path) -> None:
    spec = calm_demo(example)
    shown = status(spec, tmp_path / "state")
    assert shown.returncode == EXIT["down"]
    assert "the health daemon's exporter does not answer" in shown.stdout


def paths_unit(state: str) -> Unit:
    return Unit(paths.SERVER_UNIT, state, "Thu 2026-12-03 04:00:01 UTC")


def _seen(**overrides: object) -> Status:
    seen = Status("systemd", "/etc/llm-appliance/demo.toml", server="ok", ready=Peer("self", True), decay_ratio=0.7)
    for name, value in overrides.items():
        setattr(seen, name, value)
    return seen


def test_energy_per_token_is_shown_where_a_meter_was_read() -> None:
    seen = _seen(metrics={"llm_appliance_energy_per_token_joules": [({"source": "nvml"}, 0.42)]})
    assert "energy   nvml 0.42 J/token" in format_status(seen).splitlines()
    assert not any(line.startswith("energy") for line in format_status(_seen()).splitlines())


def test_speculations_gain_is_shown_beside_the_decode_rate() -> None:
    metrics = {
        "llm_appliance_decode_tokens_per_second": [({"bucket": "ctx<=1K"}, 60.0), ({"bucket": "canary"}, 70.0)],
        "llm_appliance_speculation_speedup": [({"bucket": "ctx<=1K"}, 0.43)],
    }
    seen = _seen(metrics=metrics)
    lines = format_status(seen).splitlines()
    assert "decode   ctx<=1K: 60.0 tok/s (learning baseline), 0.43x the rate without speculation" in lines
    assert "decode   canary: 70.0 tok/s (learning baseline)" in lines  # no no-speculation rate for it
    assert seen.document()["speculation_speedup"] == {"ctx<=1K": 0.43}


@pytest.mark.parametrize(
    ("overrides", "health", "words"),
    [
        ({}, "healthy", ""),
        ({"ready": Peer("self", False, "draining")}, "degraded", "not ready for a balancer: draining"),
        ({"ready": None}, "degraded", "exporter does not answer"),
        ({"spec_differences": ["server.ctx_size: 4096 -> 8192"]}, "degraded", "differs from what is applied"),
        ({"metrics": {"llm_appliance_version_mismatch": [({}, 1.0)]}}, "degraded", "versions differ"),
        (
            {
                "metrics": {
                    "llm_appliance_decode_tokens_per_second": [({"bucket": "ctx<=1K"}, 60.0)],
                    "llm_appliance_decode_baseline_tokens_per_second": [({"bucket": "ctx<=1K"}, 159.0)],
                }
            },
            "degraded",
            "decode 60 tok/s in ctx<=1K",
        ),
        ({"server": "unreachable (refused)"}, "down", "llama-server /health: unreachable"),
        ({"units": [paths_unit("failed (failed)")]}, "down", "is failed"),
    ],
)
def test_the_verdict(overrides: dict[str, object], health: str, words: str) -> None:
    seen = _seen(**overrides)
    found, problems = assess(seen)
    assert found == health
    assert words in " ".join(problems)
    seen.health, seen.problems = found, problems
    assert format_status(seen).startswith(f"llm-appliance: {health.upper()}")


def test_what_the_exporter_says_cannot_drive_roots_terminal() -> None:
    hostile = {"llm_appliance_version_info": [({"llama_cpp": "b1\x1b]0;owned\x07\x1b[2J"}, 1.0)]}
    seen = _seen(metrics=hostile, ready=Peer("self", False, "draining\x1b[31m"))
    shown = format_status(seen)
    assert "\x1b" not in shown and "\x07" not in shown
    assert "llama_cpp b1?]0;owned??[2J" in shown


def test_an_exposition_no_exporter_of_ours_writes_reads_as_nothing() -> None:
    import http.server
    import threading

    from appliance.ops.status import _scrape

    class Garbage(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'llm_appliance_ready{x="\n 1 2 3 junk\n'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert _scrape(f"http://127.0.0.1:{server.server_port}/metrics") == {}
    finally:
        server.shutdown()
        server.server_close()
