"""`sudo ./install.sh --demo` inside a freshly booted, real systemd (systemd-nspawn, recipe in
shared/FACTS.md), then the appliance driven the way an admin drives it: systemctl, the journal, kill -9,
a second install, uninstall. The container has its own network namespace (loopback only): pip installs
from a wheelhouse built here, the engine comes from the host's build cache.

The tests in this module run in order against one container.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO

from appliance.engine import CACHE_DIR
from appliance.models import SMOLLM2

pytestmark = [pytest.mark.system, pytest.mark.engine]
VENV_PIP = Path("/opt/llm-appliance/venv/bin/pip")
WHEELS_CACHE = CACHE_DIR / "test-wheels"
SECURITY_BOUND = 2.0


@dataclass
class Machine:
    root: Path
    nspawn: subprocess.Popen[bytes]
    init_pid: int

    def run(
        self, command: str, timeout: float = 120, check: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """A shell command inside the container, in all its namespaces."""
        exports = " ".join(f"{k}={v}" for k, v in (env or {}).items())
        argv = [
            "nsenter",
            "-t",
            str(self.init_pid),
            "-a",
            "/usr/bin/env",
            "-i",
            "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME=/root",
            *exports.split(),
            "/bin/bash",
            "-c",
            command,
        ]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise AssertionError(
                f"`{command}` exited {result.returncode}\nstdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
            )
        return result

    def wait_for(self, command: str, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while True:
            result = self.run(command, check=False, timeout=30)
            if result.returncode == 0:
                return result.stdout
            if time.monotonic() > deadline:
                journal = self.run("journalctl --no-pager -n 80 -u 'llm-appliance-*'", check=False).stdout
                raise AssertionError(
                    f"timed out waiting for {what}: {result.stdout[-500:]} {result.stderr[-500:]}\njournal:\n{journal}"
                )
            time.sleep(1)

    def completion(self) -> dict[str, object]:
        body = json.dumps(
            {
                "messages": [{"role": "user", "content": "Write a Python function that adds two numbers."}],
                "max_tokens": 48,
                "temperature": 0,
            }
        )
        out = self.run(
            f"curl -sf --max-time 60 http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'"
        ).stdout
        return json.loads(out)  # type: ignore[no-any-return]

    def server_pid(self) -> int:
        """llama-server's pid inside the container (the launcher is the unit's MainPID)."""
        return int(self.run("pgrep -u llm-appliance -x llama-server").stdout.split()[0])


def _wheelhouse(target: Path) -> None:
    """The project and its dependencies as wheels, so install.sh's pip works without a network."""
    WHEELS_CACHE.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CMAKE_ARGS": "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"}
    # The project's build backend too: pip builds the checkout in an isolated environment.
    subprocess.run(
        [
            str(VENV_PIP),
            "wheel",
            "-q",
            "--disable-pip-version-check",
            "--find-links",
            str(WHEELS_CACHE),
            "-w",
            str(WHEELS_CACHE),
            str(REPO),
            "hatchling",
        ],
        check=True,
        env=env,
        timeout=900,
    )
    shutil.copytree(WHEELS_CACHE, target)


def _checkout(target: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory, smollm2: Path, engine_binary: Path) -> Iterator[Machine]:
    if shutil.which("systemd-nspawn") is None:
        pytest.fail("systemd-nspawn is missing: apt-get install systemd-container (tests/run does this)")
    root = tmp_path_factory.mktemp("machine")
    root.chmod(0o755)  # mktemp's 0700 would give non-root services EACCES
    for name in ("usr", "var", "tmp", "root", "opt", "home", "srv", "var/lib"):
        (root / name).mkdir(exist_ok=True)
    (root / "tmp").chmod(0o1777)
    subprocess.run(["cp", "-a", "/etc", str(root / "etc")], check=True)
    subprocess.run(["cp", "-a", "/var/lib/dpkg", str(root / "var/lib/dpkg")], check=True)
    for stale in ("os-release", "machine-id"):
        (root / "etc" / stale).unlink(missing_ok=True)
    shutil.copy("/usr/lib/os-release", root / "etc/os-release")
    subprocess.run(["systemd-machine-id-setup", f"--root={root}"], check=True, capture_output=True)
    for wants in (root / "etc/systemd/system").glob("*.wants"):
        shutil.rmtree(wants)  # boot systemd's own units, not the host's services
    # A host that ran install.sh itself must not hand its installation to the fresh machine.
    shutil.rmtree(root / "etc/llm-appliance", ignore_errors=True)
    units = (root / "etc/systemd/system").glob("llm-appliance-*")
    for leftover in [*units, *(root / "etc/polkit-1/rules.d").glob("*llm-appliance*")]:
        leftover.unlink()
    for link in ("bin", "sbin", "lib", "lib64"):
        (root / link).symlink_to(f"usr/{link}")
    models = root / "var/lib/llm-appliance/models"
    models.mkdir(parents=True)
    shutil.copy(smollm2, models / SMOLLM2)
    _checkout(root / "root/src")
    _wheelhouse(root / "root/wheels")
    log = (root.parent / "boot.log").open("wb")
    nspawn = subprocess.Popen(
        [
            "systemd-nspawn",
            "--register=no",
            "--keep-unit",
            "--overlay=/usr::/usr",
            "-D",
            str(root),
            "-b",
            "-q",
            "--private-network",
            f"--bind={CACHE_DIR}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        init_pid = _container_init(nspawn.pid)
        machine = Machine(root, nspawn, init_pid)
        state = machine.run("timeout 120 systemctl is-system-running --wait", check=False, timeout=150).stdout.strip()
        assert state in ("running", "degraded"), f"the container did not boot: {state}"
        yield machine
    finally:
        nspawn.terminate()
        try:
            nspawn.wait(60)
        except subprocess.TimeoutExpired:
            nspawn.kill()
            nspawn.wait()


def _container_init(nspawn_pid: int) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        children = subprocess.run(
            ["ps", "-o", "pid=,args=", "--ppid", str(nspawn_pid)], capture_output=True, text=True
        ).stdout
        for line in children.splitlines():
            pid, _, args = line.strip().partition(" ")
            # nspawn's own helper child is named systemd-nspawn too: wait for the exec of init.
            if "/lib/systemd/systemd" in args and "nspawn" not in args:
                return int(pid)
        time.sleep(0.2)
    raise AssertionError("the container's init never appeared")


OFFLINE_PIP = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "/root/wheels"}


def test_install_sh_brings_up_the_demo_appliance(machine: Machine) -> None:
    result = machine.run("cd /root/src && ./install.sh --demo", timeout=900, env=OFFLINE_PIP)
    assert "started llm-appliance-server.service" in result.stdout
    assert (
        machine.run("systemctl is-active llm-appliance-server.service").stdout.strip() == "active"
    )  # start waited for READY
    machine.wait_for(
        "systemctl is-active llm-appliance-health.service", 60, "the health unit (READY after its first check)"
    )
    assert machine.run("systemctl is-active llm-appliance-restart.timer").stdout.strip() == "active"


def test_a_chat_completion_drafts_through_the_installed_appliance(machine: Machine) -> None:
    answer = machine.completion()
    timings = answer["timings"]
    assert isinstance(timings, dict)
    assert timings["draft_n"] > 0 and timings["draft_n_accepted"] > 0


def test_the_restart_timer_is_listed(machine: Machine) -> None:
    timers = machine.run("systemctl list-timers --all --no-pager").stdout
    assert "llm-appliance-restart.timer" in timers


def test_the_health_unit_reports_a_sensible_status(machine: Machine) -> None:
    status = machine.wait_for(
        "systemctl show -p StatusText --value llm-appliance-health.service | grep -E 'decode [0-9]+ tok/s|server up'",
        90,
        "a health STATUS line",
    )
    assert "acceptance" in status or "no decode measured yet" in status
    metrics = machine.run("curl -sf http://127.0.0.1:9478/metrics").stdout
    assert "llm_appliance_server_up 1.0" in metrics


def test_stop_and_start_through_systemctl(machine: Machine) -> None:
    machine.run("systemctl stop llm-appliance-server.service", timeout=90)
    assert machine.run("systemctl is-active llm-appliance-server.service", check=False).stdout.strip() == "inactive"
    assert (
        machine.run("systemctl is-active llm-appliance-health.service", check=False).stdout.strip() == "inactive"
    )  # bound to it
    assert machine.run("pgrep -x llama-server", check=False).returncode == 1
    started = time.monotonic()
    machine.run("systemctl start llm-appliance-server.service", timeout=300)
    # Type=notify through the launcher: start returned, so the model is loaded and /health answers now.
    assert machine.run("curl -sf http://127.0.0.1:8080/health").stdout.strip() == '{"status":"ok"}'
    assert time.monotonic() - started < 300
    machine.wait_for("systemctl is-active llm-appliance-health.service", 60, "the health unit to follow the server")


def test_a_killed_llama_server_comes_back_ready(machine: Machine) -> None:
    before = machine.server_pid()
    machine.run(f"kill -9 {before}")
    machine.wait_for(
        f"pgrep -u llm-appliance -x llama-server | grep -vx {before} && curl -sf http://127.0.0.1:8080/health",
        120,
        "a new, ready llama-server",
    )
    assert machine.server_pid() != before
    journal = machine.run("journalctl --no-pager -u llm-appliance-server.service").stdout
    assert "llama-server exited unexpectedly" in journal


def test_a_second_install_changes_nothing(machine: Machine) -> None:
    pid = machine.server_pid()
    result = machine.run("cd /root/src && ./install.sh --demo", timeout=600, env=OFFLINE_PIP)
    assert "nothing to change" in result.stdout, result.stdout[-2000:]
    assert machine.server_pid() == pid


@pytest.mark.parametrize("unit", ["llm-appliance-server.service", "llm-appliance-health.service"])
def test_security_exposure_is_at_most_2(machine: Machine, unit: str) -> None:
    out = machine.run(f"systemd-analyze security --no-pager {unit}").stdout
    score = float(re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out).group(1))  # type: ignore[union-attr]
    assert score <= SECURITY_BOUND, out[-3000:]


def test_a_health_triggered_restart_is_seen_through_systemd(machine: Machine) -> None:
    spec = machine.root / "etc/llm-appliance/demo.toml"
    text = spec.read_text()
    fast = (
        text.replace(
            "interval_seconds = 10", "interval_seconds = 1\nconsecutive = 2\nbaseline_windows = 3\ndecay_ratio = 0.7"
        )
        .replace("canary_after_idle_seconds = 60", "canary_after_idle_seconds = 0")
        .replace("cooldown_seconds = 120", "cooldown_seconds = 0\nidle_timeout_seconds = 3")
    )
    assert fast != text
    spec.write_text(fast)
    machine.run(
        "/opt/llm-appliance/venv/bin/llm-appliance apply /etc/llm-appliance/demo.toml && systemctl restart llm-appliance-server.service",
        timeout=300,
    )
    machine.wait_for("systemctl is-active llm-appliance-health.service", 60, "the health unit")
    first = machine.server_pid()
    (machine.root / "root/traffic.sh").write_text(
        "while true; do curl -s --max-time 30 http://127.0.0.1:8080/completion "
        '-d \'{"prompt":"def add(a, b):","n_predict":24,"temperature":0,"ignore_eos":true}\' >/dev/null; done\n'
    )
    (machine.root / "root/throttle.sh").write_text(
        f"while kill -STOP {first}; do sleep 0.2; kill -CONT {first}; sleep 0.1; done\n"
    )
    machine.run("systemd-run --unit=test-traffic /bin/bash /root/traffic.sh")
    try:
        machine.wait_for(
            "curl -sf http://127.0.0.1:9478/metrics | grep -E '^llm_appliance_decode_baseline_tokens_per_second.* [0-9.]*[1-9]'",
            90,
            "a learned decode baseline",
        )
        machine.run("systemd-run --unit=test-throttle /bin/bash /root/throttle.sh")
        machine.wait_for(
            "journalctl --no-pager -u llm-appliance-health.service | grep 'restarting llama-server: decay'",
            120,
            "the health daemon's restart",
        )
        machine.wait_for(
            f"pgrep -u llm-appliance -x llama-server | grep -vx {first} && curl -sf http://127.0.0.1:8080/health",
            120,
            "the restarted server",
        )
    finally:
        machine.run("systemctl stop test-traffic test-throttle", check=False)
        machine.run(f"kill -CONT {first}", check=False)
    journal = machine.run("journalctl --no-pager -u llm-appliance-server.service").stdout
    assert journal.count("Started llm-appliance-server.service") >= 2
    machine.wait_for(
        "curl -sf http://127.0.0.1:9478/metrics | grep -x 'llm_appliance_restarts_total{reason=\"decay\"} 1.0'",
        60,
        "the restart counter",
    )


def test_uninstall_leaves_no_unit_ruleset_or_process(machine: Machine) -> None:
    machine.run("cd /root/src && ./install.sh --uninstall", timeout=300)
    assert "llm-appliance" not in machine.run("systemctl list-unit-files --no-pager").stdout
    assert machine.run("nft list table inet llm_appliance", check=False).returncode != 0
    assert machine.run("pgrep -u llm-appliance", check=False).returncode == 1
    assert machine.run("test -e /opt/llm-appliance/venv", check=False).returncode != 0
    assert machine.run("test -f /etc/llm-appliance/demo.toml", check=False).returncode == 0  # kept without --purge
