"""Root runs nothing of the appliance's: `llm-appliance up` started by root (what install.sh does where systemd
is not PID 1) becomes the service user before it starts anything, and the API key goes nowhere but to the
server. Run for real: the demo appliance, with an API key file, started by root."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import EXAMPLES, INSTALLED_MODELS, KeyFile, start_up
from test_health_daemon import server_pids, wait_ready
from test_launch import free_port

from appliance.cli.main import main
from appliance.health import privileges
from appliance.health.privileges import NOT_ENFORCED
from appliance.ops.models import SMOLLM2
from appliance.system.users import Account, account, reading

pytestmark = [pytest.mark.engine, pytest.mark.system]
SERVICE = account()
if os.geteuid() != 0 or SERVICE is None:
    pytest.skip("needs root and the llm-appliance user (install.sh creates it)", allow_module_level=True)
KEY = "sk-test-4f1c2b9e7d0a"  # one of the two keys of the file
OTHER_KEY = "sk-other-8e2d"


@dataclass
class Running:
    process: subprocess.Popen[str]
    output: list[str]
    spec: Path
    directory: Path  # what the service user can reach: the spec, the key, the state
    keys: Path


def reachable_directory() -> Path:
    """Like /var/lib/llm-appliance: root's, and open to the service user; not pytest's own (0700, and in /tmp,
    which validate refuses: the units' PrivateTmp= hides it)."""
    directory = Path(tempfile.mkdtemp(prefix="llm-appliance-privileges-", dir="/var/lib"))
    directory.chmod(0o755)
    return directory


def demo_spec(directory: Path, model: Path, keys: Path, scrape_key: Path) -> Path:
    text = (EXAMPLES / "demo.toml").read_text().replace(f"{INSTALLED_MODELS}/{SMOLLM2}", str(model))
    text = text.replace("port = 8080", f"port = {free_port()}").replace("port = 9478", f"port = {free_port()}")
    text = text.replace('host = "127.0.0.1"', f'host = "127.0.0.1"\napi_key_file = "{keys}"')
    text = text.replace("[prometheus]\n", f'[prometheus]\nscrape_key_file = "{scrape_key}"\n')
    spec = directory / "demo.toml"
    spec.write_text(text)
    return spec


@pytest.fixture(scope="module")
def up_as_root(smollm2: Path, key_file: KeyFile) -> Iterator[Running]:
    assert SERVICE is not None
    directory = reachable_directory()
    model = smollm2
    if reading(model, SERVICE):
        model = directory / SMOLLM2
        shutil.copy(smollm2, model)
    keys = key_file(KEY, OTHER_KEY)
    spec = demo_spec(directory, model, keys, key_file(OTHER_KEY, name="scrape-key", group=0))
    process, output = start_up(spec, "--state-dir", directory / "state")
    try:
        wait_ready(process, output, 1)
        yield Running(process, output, spec, directory, keys)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
        shutil.rmtree(directory, ignore_errors=True)


def credentials(pid: int) -> dict[str, str]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {name: " ".join(fields[name].split()) for name in ("Uid", "Gid", "Groups", "NoNewPrivs", "CapEff")}


def as_service_user(who: Account) -> dict[str, str]:
    return {
        "Uid": " ".join([str(who.uid)] * 4),
        "Gid": " ".join([str(who.gid)] * 4),
        "Groups": " ".join(str(g) for g in sorted(who.groups)),
        "NoNewPrivs": "1",
        "CapEff": "0000000000000000",
    }


def test_up_started_by_root_runs_llama_server_as_the_service_user(up_as_root: Running) -> None:
    assert SERVICE is not None
    [server] = server_pids(up_as_root.output)
    assert credentials(server) == as_service_user(SERVICE)
    # `up` itself (the launcher, the health daemon and the exporter) dropped before it started anything.
    assert credentials(up_as_root.process.pid) == as_service_user(SERVICE)
    state = up_as_root.directory / "state"
    assert (state.stat().st_uid, state.stat().st_mode & 0o777) == (SERVICE.uid, 0o700)
    assert os.readlink(f"/proc/{server}/cwd") == str(state)


def test_up_says_once_what_it_cannot_enforce_without_systemd(up_as_root: Running) -> None:
    said = [line for line in up_as_root.output if "without systemd" in line]
    assert len(said) == 1, said
    assert said[0].startswith(NOT_ENFORCED.split("{")[0])
    assert "no system call filter, no private /tmp or /dev" in said[0]
    assert "no IP address policy beyond the nftables table (none is applied" in said[0]


def test_the_api_key_reaches_no_command_line_environment_log_or_written_file(
    up_as_root: Running, tmp_path: Path
) -> None:
    assert f"--api-key-file {up_as_root.keys}" in Path(
        f"/proc/{server_pids(up_as_root.output)[0]}/cmdline"
    ).read_text().replace("\0", " ")
    leaks = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        for name in ("cmdline", "environ"):
            try:
                if any(key.encode() in (proc / name).read_bytes() for key in (KEY, OTHER_KEY)):
                    leaks.append(f"{proc}/{name}")
            except OSError:
                pass  # gone, or a kernel thread
    assert leaks == []
    assert not [line for line in up_as_root.output if KEY in line or OTHER_KEY in line]
    # Every file render and apply write for this spec, and every file `up` wrote.
    assert main(["apply", str(up_as_root.spec), "--root", str(tmp_path / "root")]) == 0
    written = [
        p for p in [*(tmp_path / "root").rglob("*"), *(up_as_root.directory / "state").rglob("*")] if p.is_file()
    ]
    assert any(p.name == "appliance.json" for p in written)
    assert [p for p in written if KEY.encode() in p.read_bytes() or OTHER_KEY.encode() in p.read_bytes()] == []


def test_up_refuses_without_the_service_user(
    up_as_root: Running, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(privileges, "account", lambda: None)
    assert main(["up", str(up_as_root.spec)]) == 2
    said = capsys.readouterr().err
    assert re.search(r"up: the service user llm-appliance does not exist, .*install.sh creates the user", said)
    assert "--as-current-user" in said
    assert os.geteuid() == 0  # refused before anything was dropped or started
