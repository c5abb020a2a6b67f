"""`llm-appliance status` against the real demo appliance under `up`: healthy, then down while llama-server is
stopped (SIGSTOP: it accepts and never answers), then healthy again, then nothing runs once `up` stopped; how it
tells that an `up` runs (its pid file, never a stale one); and the verdicts on their own. systemd's mode is
tests/test_system_nspawn.py's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import UpProcess, resolved
from test_health_daemon import server_pids, wait_ready, wait_until
from test_launch import free_port

from appliance.cli import commands
from appliance.cli.main import main
from appliance.health.peers import Peer
from appliance.ops.status import EXIT, Status, Unit, assess, format_status
from appliance.runtime.running import (
    ANNOUNCEMENT_FILE,
    PID_FILE,
    Announcement,
    announced,
    announcement,
    is_up,
    running_up,
    start_time,
)
from appliance.system import paths

SYSTEMD_IS_INIT = Path("/run/systemd/system").is_dir()


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
    # What runs is named: the spec `up` was given (runtime/running.py's announcement).
    assert lines[0] == f"llm-appliance: HEALTHY ({spec}, `llm-appliance up`, pid {process.pid})"
    assert "server   /health ok; /ready ready" in lines
    assert any(line.startswith("versions ") and "llama_cpp" in line for line in lines), shown.stdout
    assert not any("systemctl" in line for line in lines), shown.stdout
    document = json.loads(status(spec, state, "--json").stdout)
    assert document["health"] == "healthy" and document["exit_code"] == 0 and document["mode"] == "up"
    assert (document["up_pid"], document["systemd_is_init"]) == (process.pid, SYSTEMD_IS_INIT)
    assert document["ready"]["ready"] is True
    # No traffic: the warm-up completion at most. Either no drafts yet (no acceptance at all), or real ones.
    (draft,) = [line for line in lines if line.startswith("draft    ")]
    if document["acceptance"] is None:
        assert draft == "draft    configured, no drafts yet", shown.stdout
    else:
        assert draft == f"draft    engaged, acceptance {document['acceptance']:.2f}", shown.stdout

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

    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0
    assert not (state / PID_FILE).exists()  # `up` takes its pid file with it
    shown = status(spec, state)
    assert shown.returncode == EXIT["down"], shown.stdout
    assert shown.stdout.startswith(f"llm-appliance: DOWN (/etc/llm-appliance/{spec.name}, nothing runs it)")
    assert "  ! nothing runs the appliance: " in shown.stdout
    assert json.loads(status(spec, state, "--json").stdout)["mode"] is None


@pytest.mark.engine
def test_status_under_an_up_of_another_spec_describes_what_runs_not_the_applied_snapshot(
    example: Callable[..., Path],
    appliance_up: UpProcess,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The issue's case: demo.toml applied, `llm-appliance up OTHER.toml` running, `status` with no arguments.
    The applied snapshot is written where this test keeps it (not in this machine's /etc), its state directory
    the `up`'s, as the default state directory is both under install.sh's demo."""
    state = tmp_path / "state"
    applied = replace(resolved(example("demo.toml")), state_file=state / "health-state.json")
    snapshot = tmp_path / "etc/llm-appliance/rendered/appliance.json"
    snapshot.parent.mkdir(parents=True)
    snapshot.write_text(applied.to_json("applied by the test"))
    monkeypatch.setattr(commands, "SNAPSHOT", snapshot)
    other = calm_demo(example).rename(tmp_path / "other.toml")  # another spec, on other ports
    process, output = appliance_up(other)
    wait_ready(process, output, 1)

    def shown(*options: str) -> tuple[int, str]:
        code = main(["status", *options])
        return code, capsys.readouterr().out

    wait_until(lambda: shown()[0] == EXIT["healthy"], 120, lambda: shown()[1])
    lines = shown()[1].splitlines()
    assert lines[0] == f"llm-appliance: HEALTHY ({other}, `llm-appliance up`, pid {process.pid})", lines
    assert "server   /health ok; /ready ready" in lines  # other.toml's server: nothing listens on demo.toml's
    assert f"spec     {other} is not what is applied ({applied.spec_file} is)" in lines
    assert "spec     is what is applied" not in lines
    document = json.loads(shown("--json")[1])
    assert (document["spec_file"], document["is_applied"], document["applied_spec"]) == (
        str(other),
        False,
        str(applied.spec_file),
    )
    assert document["spec_differences"] == []  # the snapshot is not held against what it does not describe

    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0
    assert not (state / ANNOUNCEMENT_FILE).exists()
    code, text = shown()
    assert code == EXIT["down"] and text.startswith(f"llm-appliance: DOWN ({applied.spec_file}, nothing runs it)")


def test_what_an_up_announces_counts_only_for_the_up_that_runs(tmp_path: Path, example: Callable[..., Path]) -> None:
    appliance = resolved(example("demo.toml"))
    state = tmp_path / "state"
    state.mkdir()
    with announced(state, Announcement("/srv/other.toml", appliance)):
        said = announcement(state, os.getpid())
        assert said == Announcement("/srv/other.toml", appliance)
        assert json.loads((state / ANNOUNCEMENT_FILE).read_text())["pid"] == os.getpid()
        assert announcement(state, os.getppid()) is None  # another process's pid: not its announcement
    assert not (state / ANNOUNCEMENT_FILE).exists() and not (state / PID_FILE).exists()
    # What the service user could leave there: garbage, a link, an appliance no snapshot reads.
    (state / ANNOUNCEMENT_FILE).write_text("{")
    assert announcement(state, os.getpid()) is None
    (state / ANNOUNCEMENT_FILE).unlink()
    (state / ANNOUNCEMENT_FILE).symlink_to(tmp_path / "elsewhere.json")
    assert announcement(state, os.getpid()) is None
    (state / ANNOUNCEMENT_FILE).unlink()
    own: dict[str, object] = {
        "pid": os.getpid(),
        "started": start_time(os.getpid()),
        "spec": "/x.toml",
        "appliance": {"resolved": {}},
    }
    (state / ANNOUNCEMENT_FILE).write_text(json.dumps(own))
    assert announcement(state, os.getpid()) is None


def test_the_spec_line_of_an_appliance_that_is_not_the_applied_one() -> None:
    lines = format_status(_seen(spec_file="/srv/other.toml", is_applied=False, applied_spec="/etc/x.toml"))
    assert "spec     /srv/other.toml is not what is applied (/etc/x.toml is)" in lines.splitlines()
    nothing = format_status(_seen(spec_file="/srv/other.toml", is_applied=False))
    assert "spec     /srv/other.toml is not what is applied (nothing is)" in nothing.splitlines()
    assert "spec     is what is applied" in format_status(_seen()).splitlines()


def test_status_with_nothing_running_is_down(example: Callable[..., Path], tmp_path: Path) -> None:
    spec = calm_demo(example)
    state = tmp_path / "state"
    shown = status(spec, state)
    assert shown.returncode == EXIT["down"]
    why = "systemd is not PID 1 here" if not SYSTEMD_IS_INIT else "the units are not loaded"
    assert (
        f"  ! nothing runs the appliance: {why}, and no `llm-appliance up` runs with state directory {state} "
        f"(`llm-appliance up /etc/llm-appliance/{spec.name} --state-dir {state}` starts one)"
    ) in shown.stdout.splitlines(), shown.stdout
    assert "the health daemon's exporter does not answer" in shown.stdout
    assert "systemctl" not in shown.stdout + shown.stderr or SYSTEMD_IS_INIT


def fake_up(*words: str) -> subprocess.Popen[bytes]:
    """A process whose command line reads as `WORDS...`: what running_up judges, without an engine."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *words])


def test_an_up_is_known_by_its_pid_file_its_start_time_and_its_command_line(tmp_path: Path) -> None:
    process = fake_up("/opt/llm-appliance/venv/bin/llm-appliance", "up", "/etc/llm-appliance/demo.toml")
    other = fake_up("/usr/bin/llm-appliance-lookalike", "up")
    try:
        pid_file = tmp_path / PID_FILE
        wait_until(lambda: start_time(process.pid) is not None, 10, lambda: "no /proc entry")
        pid_file.write_text(f"{process.pid} {start_time(process.pid)}\n")
        assert running_up(tmp_path) == process.pid
        # A pid whose process is gone, or came back as another one (another start time): stale, not running.
        pid_file.write_text(f"{process.pid} {start_time(process.pid) - 1}\n")  # type: ignore[operator]
        assert running_up(tmp_path) is None
        # A live process of the same start time that is no `up` of ours (pytest, a lookalike): not running.
        for pid in (os.getpid(), other.pid):
            pid_file.write_text(f"{pid} {start_time(pid)}\n")
            assert running_up(tmp_path) is None
        # The state directory is the service user's: a link, a FIFO, a big file or garbage are nothing.
        real = tmp_path / "elsewhere"
        real.write_text(f"{process.pid} {start_time(process.pid)}\n")
        pid_file.unlink()
        pid_file.symlink_to(real)
        assert running_up(tmp_path) is None
        pid_file.unlink()
        os.mkfifo(pid_file)
        assert running_up(tmp_path) is None  # and it did not block on the FIFO
        pid_file.unlink()
        pid_file.write_text(f"{process.pid} {start_time(process.pid)}\n" + " " * 100)
        assert running_up(tmp_path) is None
        pid_file.write_text("-1 0\n")
        assert running_up(tmp_path) is None
        pid_file.write_text("up\n")
        assert running_up(tmp_path) is None
    finally:
        for child in (process, other):
            child.kill()
            child.wait()


def test_the_pid_file_is_there_while_up_runs_and_only_its_own_is_removed(tmp_path: Path) -> None:
    pid_file = tmp_path / "state" / PID_FILE
    (tmp_path / "state").mkdir()
    with announced(tmp_path / "state"):
        assert pid_file.read_text() == f"{os.getpid()} {start_time(os.getpid())}\n"
        assert (pid_file.stat().st_mode & 0o777) == 0o644
    assert not pid_file.exists()
    with announced(tmp_path / "state"):
        pid_file.write_text("1 1\n")  # another `up`'s since
    assert pid_file.read_text() == "1 1\n"


@pytest.mark.parametrize(
    ("argv", "up"),
    [
        (["/opt/llm-appliance/venv/bin/python3", "/opt/llm-appliance/venv/bin/llm-appliance", "up", "x.toml"], True),
        (["/usr/bin/python3", "-m", "appliance.cli.main", "up", "x.toml", "--as-current-user"], True),
        (["/opt/llm-appliance/venv/bin/llm-appliance", "install", "--demo"], True),  # ends in `up` without systemd
        (["/opt/llm-appliance/venv/bin/llm-appliance", "status"], False),
        (["/opt/llm-appliance/venv/bin/llm-appliance", "health", "--snapshot", "up"], False),
        (["/usr/bin/python3", "-m", "pytest", "up"], False),
        (["/usr/bin/vim", "up"], False),
        ([], False),
    ],
)
def test_what_reads_as_an_up_of_ours(argv: list[str], up: bool) -> None:
    assert is_up([a.encode() for a in argv] + [b""]) is up


def paths_unit(state: str) -> Unit:
    return Unit(paths.SERVER_UNIT, state, "Thu 2026-12-03 04:00:01 UTC")


def _seen(**overrides: object) -> Status:
    seen = Status("systemd", "/etc/llm-appliance/demo.toml", server="ok", ready=Peer("self", True), decay_ratio=0.7)
    for name, value in overrides.items():
        setattr(seen, name, value)
    return seen


def test_acceptance_is_no_drafts_yet_until_drafts_are_counted() -> None:
    configured = {
        "llm_appliance_draft_configured": [({}, 1.0)],
        "llm_appliance_speculation_configured": [({}, 1.0)],
        "llm_appliance_speculation_engaged": [({}, 1.0)],
        "llm_appliance_speculation_drafted_tokens_total": [({}, 0.0)],
    }
    fresh = _seen(metrics=configured)
    assert "draft    configured, no drafts yet" in format_status(fresh).splitlines()
    assert fresh.document()["acceptance"] is None
    # An exporter from before the gauge was left unset says 0 then; the drafted counter says there is nothing.
    old = _seen(metrics={**configured, "llm_appliance_speculation_acceptance_ratio": [({}, 0.0)]})
    assert "draft    configured, no drafts yet" in format_status(old).splitlines()
    assert old.document()["acceptance"] is None
    drafting = {
        **configured,
        "llm_appliance_speculation_drafted_tokens_total": [({}, 120.0)],
        "llm_appliance_speculation_acceptance_ratio": [({}, 0.0)],
    }
    rejected = _seen(metrics=drafting)  # drafts made, none accepted: a real 0
    assert "draft    engaged, acceptance 0.00" in format_status(rejected).splitlines()
    assert rejected.document()["acceptance"] == 0.0
    stopped = _seen(metrics={**configured, "llm_appliance_speculation_engaged": [({}, 0.0)]})
    assert "draft    NOT ENGAGED" in format_status(stopped).splitlines()
    ngram = {**configured, "llm_appliance_draft_configured": [({}, 0.0)]}
    assert "draft    n-gram lookup (no draft model), no drafts yet" in format_status(_seen(metrics=ngram)).splitlines()
    assert not any(line.startswith("draft") for line in format_status(_seen()).splitlines())


def test_the_share_other_processes_took_is_shown_and_a_shared_box_is_not_degraded() -> None:
    from appliance.ops.status import assess

    quiet = _seen(
        metrics={
            "llm_appliance_contention_share": [({"resource": "cpu"}, 0.04)],
            "llm_appliance_contended": [({}, 0.0)],
            "llm_appliance_decode_contended_samples_total": [({}, 0.0)],
        }
    )
    assert "machine  other processes used 4% of the CPUs; not contended (0 samples so far)" in format_status(quiet)
    assert assess(quiet) == ("healthy", [])
    shared = _seen(
        metrics={
            "llm_appliance_contention_share": [({"resource": "cpu"}, 0.85), ({"resource": "gpu"}, 0.0)],
            "llm_appliance_contended": [({}, 1.0)],
            "llm_appliance_decode_contended_samples_total": [({}, 14.0)],
        }
    )
    assert (
        "machine  other processes used 85% of the CPUs, 0% of the GPU; contended: decode samples not judged "
        "(14 samples so far)" in format_status(shared)
    )
    # A neighbour is the operator's (LlmApplianceBoxShared, once it lasts), not a verdict on the server.
    assert assess(shared) == ("healthy", [])
    assert shared.document()["contention"] == {
        "share": {"cpu": 0.85, "gpu": 0.0},
        "contended": True,
        "contended_samples": 14.0,
    }
    assert not any(line.startswith("machine") for line in format_status(_seen()).splitlines())


def test_the_share_of_answers_the_fallback_gave_is_shown() -> None:
    assert not any(line.startswith("router") for line in format_status(_seen()).splitlines())  # no [fallback]
    assert "router   no answers counted yet" in format_status(_seen(router_answers={})).splitlines()
    seen = _seen(router_answers={"local": 30.0, "fallback": 10.0})
    assert "router   answers since it started: fallback 10, local 30; 25% by the fallback" in format_status(seen)
    assert seen.document()["fallback_share"] == 0.25
    assert assess(seen) == ("healthy", [])  # the fallback answering is what it is for, not a fault


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
