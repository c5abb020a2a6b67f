"""`llm-appliance up` supervises as the units do, for real: the demo appliance (the real llama-server), and with
[fallback] the real router (LiteLLM) beside it.

- A `kill -9` of llama-server: a new one answers, `up` goes on, the health daemon watches throughout.
- Killed past the server unit's start limit: `up` exits non-zero with one line, and leaves no llama-server, no
  router and no router directory in /tmp, checked by pid and by path; so for every other way `up` ends (Ctrl-C
  to its process group, SIGTERM, SIGKILL of `up` itself, an error after the router started).
- Started by root from a Python the service user cannot read: refused before it drops, in one line.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pydantic
import pytest
from conftest import UpProcess, start_up
from prometheus_client.parser import text_string_to_metric_families
from test_health_daemon import server_pids, wait_ready, wait_until
from test_launch import LOAD_SECONDS, free_port, pid_alive

import appliance
from appliance.health.peers import read_peer
from appliance.health.privileges import PrivilegeError, interpreter_paths, require_usable_interpreter
from appliance.plan.start_limit import SERVER_START_LIMIT, StartLimit, StartWindow
from appliance.runtime.server_api import ServerApi
from appliance.system import metric_names as metric
from appliance.system.users import account

SERVICE = account()
AS_ROOT = os.geteuid() == 0 and SERVICE is not None
ROUTER_DIR = re.compile(r"router --config-dir (/\S+)")
# `up` stops the router and waits for its keeper; a busy 2-core box gets this long for it.
EXIT_SECONDS = 120.0


def demo(example: Callable[..., Path], name: str = "demo.toml", router_port: int | None = None) -> Path:
    """A shipped demo on free ports, checked every second, no canary (no traffic of the daemon's own)."""
    edits = {
        "port = 8080": f"port = {free_port()}",
        "port = 9478": f"port = {free_port()}",
        "interval_seconds = 10": "interval_seconds = 1",
        "canary_after_idle_seconds = 60": "canary_after_idle_seconds = 0",
    }
    if router_port is not None:
        edits["port = 8000 "] = f"port = {router_port} "
    return example(name, edits)


def exported(url: str) -> dict[str, float] | None:
    """The exporter's unlabelled series; None when it does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
            text = answer.read().decode()
    except OSError:
        return None
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def unit_active(url: str) -> float | None:
    return (exported(url) or {}).get(metric.SERVER_UNIT_ACTIVE)


def exporter_url(spec: Path) -> str:
    port = re.findall(r"^port = (\d+)", spec.read_text().split("[prometheus]")[1], re.MULTILINE)[0]
    return f"http://127.0.0.1:{port}"


def server_url(spec: Path) -> str:
    port = re.findall(r"^port = (\d+)", spec.read_text().split("[server]")[1], re.MULTILINE)[0]
    return f"http://127.0.0.1:{port}"


@pytest.mark.engine
def test_a_killed_llama_server_is_started_again_and_the_daemon_watches_throughout(
    example: Callable[..., Path], appliance_up: UpProcess
) -> None:
    spec = demo(example)
    process, output = appliance_up(spec)
    wait_ready(process, output, 1)
    exporter = exporter_url(spec)
    wait_until(lambda: unit_active(exporter) == 1, 60, "the daemon to see the server")
    [first] = server_pids(output)
    os.kill(first, signal.SIGKILL)
    # Until the second start is ready: the exporter answers all along, and the daemon's checks see the server
    # gone while the launcher waits RestartSec= (5 s, with checks every second).
    seen: list[dict[str, float] | None] = []
    deadline = time.monotonic() + LOAD_SECONDS
    while len([line for line in list(output) if "llama-server is ready after" in line]) < 2:
        assert process.poll() is None, "`up` exited:\n" + "".join(output[-40:])
        assert time.monotonic() < deadline, "no second start:\n" + "".join(output[-40:])
        seen.append(exported(exporter))
        time.sleep(0.25)
    [_, second] = server_pids(output)
    assert second != first and pid_alive(second) and not pid_alive(first)
    assert ServerApi(server_url(spec), timeout=10).health() == 200
    assert process.poll() is None
    said = [line for line in output if "restarting llama-server in" in line]
    assert len(said) == 1 and f"start 2 of {SERVER_START_LIMIT.burst} allowed" in said[0], said
    assert None not in seen, "the exporter stopped answering while llama-server restarted"
    assert any(series.get(metric.SERVER_UNIT_ACTIVE) == 0 for series in seen if series), "no check saw it down"
    # ...and on: it sees the server back, and /ready says ready again.
    wait_until(lambda: unit_active(exporter) == 1, 60, "the daemon to see it back")
    wait_until(lambda: read_peer("self", f"{exporter}/ready", 10).ready, 120, "/ready once it is back")


def router_processes(directory: str) -> list[int]:
    """Every process whose command line names the router's directory: its launcher, LiteLLM."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and directory.encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            pass  # gone meanwhile
    return [pid for pid in found if pid_alive(pid)]


def keeper_of(up: subprocess.Popen[str]) -> int:
    """The pid of the router's keeper, `up`'s child."""
    for proc in Path("/proc").iterdir():
        try:
            parent = int((proc / "stat").read_text().rpartition(")")[2].split()[1]) if proc.name.isdigit() else 0
            if parent == up.pid and b"--beside-up" in (proc / "cmdline").read_bytes():
                return int(proc.name)
        except OSError:
            pass
    raise AssertionError("no keeper of the router runs beside `up`")


def with_router(example: Callable[..., Path], tmp_path: Path) -> tuple[subprocess.Popen[str], list[str], str]:
    """`up` of the fallback demo (its upstream a documentation address no one answers: the router starts all the
    same), in a process group of its own, once LiteLLM runs; with the router's directory."""
    spec = demo(example, "demo-fallback.toml", router_port=free_port())
    process, output = start_up(
        spec, "--state-dir", tmp_path / "state", "--stop-timeout", "5", "--as-current-user", new_session=True
    )
    wait_ready(process, output, 1)

    def router_runs() -> bool:
        assert process.poll() is None, "".join(output[-40:])
        found = [m.group(1) for line in list(output) if (m := ROUTER_DIR.search(line))]
        return bool(found) and bool(router_processes(f"{found[0]}/config.yaml"))  # LiteLLM's own argv

    wait_until(router_runs, LOAD_SECONDS, lambda: "LiteLLM to run:\n" + "".join(output[-40:]))
    [directory] = {m.group(1) for line in list(output) if (m := ROUTER_DIR.search(line))}
    return process, output, directory


def assert_nothing_left(process: subprocess.Popen[str], output: list[str], directory: str, keeper: int) -> None:
    text = "".join(output[-40:])
    # The kernel kills llama-server with `up` (its parent-death signal); a 400 MB process takes a moment to go.
    wait_until(lambda: not any(pid_alive(pid) for pid in server_pids(output)), 30, "llama-server to exit:\n" + text)
    wait_until(lambda: not pid_alive(keeper), 30, "the keeper to exit")  # SIGKILL of `up`: it works on alone
    assert router_processes(directory) == [], text
    assert not Path(directory).exists(), text


@pytest.mark.engine
@pytest.mark.system
def test_past_the_start_limit_up_exits_in_one_line_and_leaves_nothing(
    example: Callable[..., Path], tmp_path: Path
) -> None:
    process, output, directory = with_router(example, tmp_path)
    keeper = keeper_of(process)
    try:
        for death in range(1, SERVER_START_LIMIT.burst + 1):
            os.kill(server_pids(output)[-1], signal.SIGKILL)
            if death < SERVER_START_LIMIT.burst:
                wait_ready(process, output, death + 1)
        assert process.wait(LOAD_SECONDS) == 128 + signal.SIGKILL
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    said = [line for line in output if "start limit" in line]
    assert len(said) == 1, "".join(output[-40:])
    assert (
        f"after {SERVER_START_LIMIT.burst} starts within {SERVER_START_LIMIT.interval_seconds} s, the server "
        "unit's start limit" in said[0]
    )
    assert len(server_pids(output)) == SERVER_START_LIMIT.burst
    assert "Traceback" not in "".join(output)
    assert_nothing_left(process, output, directory, keeper)


def _taken_exporter_port(example: Callable[..., Path], tmp_path: Path) -> tuple[subprocess.Popen[str], list[str]]:
    spec = demo(example, "demo-fallback.toml", router_port=free_port())
    holder = socket.socket()
    holder.bind(("127.0.0.1", int(exporter_url(spec).rsplit(":", 1)[1])))
    holder.listen()
    try:
        process, output = start_up(spec, "--state-dir", tmp_path / "state", "--as-current-user", new_session=True)
        process.wait(EXIT_SECONDS)
    finally:
        holder.close()
    return process, output


@pytest.mark.engine
@pytest.mark.system
@pytest.mark.parametrize("how", ["Ctrl-C", "SIGTERM", "SIGKILL of up"])
def test_however_up_ends_it_leaves_no_process_or_directory(
    example: Callable[..., Path], tmp_path: Path, how: str
) -> None:
    process, output, directory = with_router(example, tmp_path)
    keeper = keeper_of(process)
    try:
        if how == "Ctrl-C":
            os.killpg(process.pid, signal.SIGINT)  # what the terminal sends the foreground job
        else:
            process.send_signal(signal.SIGTERM if how == "SIGTERM" else signal.SIGKILL)
        code = process.wait(EXIT_SECONDS)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert code == (-signal.SIGKILL if how == "SIGKILL of up" else 0), "".join(output[-40:])
    assert_nothing_left(process, output, directory, keeper)


@pytest.mark.engine
@pytest.mark.system
def test_an_error_after_the_router_started_leaves_nothing(example: Callable[..., Path], tmp_path: Path) -> None:
    process, output = _taken_exporter_port(example, tmp_path)
    text = "".join(output)
    assert process.returncode == 3 and "up: " in text and "Traceback" not in text, text
    # The keeper got to start the router, or `up` was gone first: either way, nothing of it is left.
    wait_until(lambda: "router stopped" in "".join(output), 30, lambda: "the keeper's last line:\n" + text)
    for directory in {m.group(1) for line in output if (m := ROUTER_DIR.search(line))}:
        assert router_processes(directory) == [] and not Path(directory).exists(), text


def test_the_start_limit_counts_starts_in_a_window_as_systemd_does() -> None:
    window = StartWindow(StartLimit(interval_seconds=900, burst=3, delay_seconds=5))
    assert [window.allows(t) for t in (0.0, 10.0, 20.0, 30.0)] == [True, True, True, False]
    assert window.allows(899.0) is False  # the window opened at 0 holds until 900
    assert window.allows(901.0) is True  # a new one opens at its first start
    assert [window.allows(t) for t in (902.0, 903.0, 904.0)] == [True, True, False]


def test_the_server_unit_and_up_read_the_same_start_limit(example: Callable[..., Path]) -> None:
    from conftest import resolved, service_settings

    from appliance.render.render import render

    rendered = render(resolved(example("demo.toml")))["etc/systemd/system/llm-appliance-server.service"]
    assert service_settings(rendered)["RestartSec"] == [f"{SERVER_START_LIMIT.delay_seconds}s"]
    assert f"StartLimitIntervalSec={SERVER_START_LIMIT.interval_seconds}\n" in rendered
    assert f"StartLimitBurst={SERVER_START_LIMIT.burst}\n" in rendered


# -- a Python the service user cannot read --


def test_what_up_reads_after_it_drops_is_its_interpreter_and_the_directories_it_imports_from() -> None:
    needed = interpreter_paths()
    assert needed[0] == Path(sys.executable)
    assert Path(os.__file__).parent in needed  # the standard library
    for package in (pydantic, appliance):  # the virtualenv's site-packages, the appliance's source
        assert any(Path(str(package.__file__)).is_relative_to(p) for p in needed[1:]), (package, needed)


@pytest.mark.skipif(not AS_ROOT, reason="needs root and the llm-appliance user (install.sh creates it)")
def test_a_python_under_a_closed_directory_is_refused_in_one_line(tmp_path: Path) -> None:
    assert SERVICE is not None
    require_usable_interpreter(SERVICE)  # this one (the tests' venv of /usr/bin/python3) is fine
    closed = tmp_path / "pyenv"  # pytest's directories are root's, 0700
    (closed / "lib").mkdir(parents=True)
    with pytest.raises(PrivilegeError) as refused:
        require_usable_interpreter(SERVICE, [Path(sys.executable), closed / "lib"])
    said = str(refused.value)
    assert "\n" not in said
    assert f"a directory it imports from, {closed / 'lib'}: " in said
    assert "(mode 0700) does not let llm-appliance reach it" in said
    assert said.endswith("or pass --as-current-user") and "/usr/bin/python3 -m venv" in said


@pytest.mark.skipif(not AS_ROOT, reason="needs root and the llm-appliance user (install.sh creates it)")
def test_up_from_a_virtualenv_the_service_user_cannot_read_refuses_before_dropping(
    example: Callable[..., Path], tmp_path: Path
) -> None:
    venv = tmp_path / "closed" / "venv"  # under pytest's 0700 directories: as a Python under /root is
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--copies", "--without-pip", str(venv)], check=True)
    # The appliance and its packages from where the tests' own run has them; the interpreter is the closed one.
    search = [str(Path(str(appliance.__file__)).parent.parent), sysconfig.get_paths()["purelib"]]
    state = tmp_path / "state"
    shown = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "appliance.cli.main", "up", str(demo(example)), "--state-dir", str(state)],
        capture_output=True,
        text=True,
        timeout=EXIT_SECONDS,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(search)},
    )
    refusals = [line for line in shown.stderr.splitlines() if line.startswith("up: ")]
    assert shown.returncode == 2 and len(refusals) == 1, shown.stderr
    assert f"its interpreter, {venv / 'bin' / 'python'}: " in refusals[0]
    assert "run `up` from a virtualenv of /usr/bin/python3" in refusals[0]
    assert "Traceback" not in shown.stderr
    assert not state.exists()  # refused before anything was made or started


@pytest.mark.engine
@pytest.mark.parametrize(("priority", "nice"), [("high", -10), ("low", 10)])
def test_up_runs_llama_server_at_the_spec_s_priority(
    example: Callable[..., Path], tmp_path: Path, priority: str, nice: int
) -> None:
    """server.priority reaches llama-server under `up` as the unit's Nice= would (plan/priority.py)."""
    spec = demo(example)
    spec.write_text(spec.read_text().replace("[server]\n", f'[server]\npriority = "{priority}"\n', 1))
    process, output = start_up(spec, "--state-dir", tmp_path / "state", "--stop-timeout", "5", "--as-current-user")
    try:
        wait_ready(process, output, 1)
        (server,) = server_pids(output)
        # /proc/PID/stat: the 19th field is the nice value (after the name, which may hold spaces).
        assert int(Path(f"/proc/{server}/stat").read_text().rpartition(")")[2].split()[16]) == nice
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
