"""The README's first command on a new machine: a pristine Debian 12 (debootstrap, booted in nspawn) with
nothing of the project's on it. Every cold step of the install really runs: OS packages from a local
mirror of Debian's real packages, the venv, pip from a wheelhouse of PyPI's real files, the engine's
source fetched, verified, unpacked, configured, built (ccache, shared from the host, only makes the
compiler fast) and installed, the demo model fetched, the units started. Then a chat completion with
drafted tokens, and `install.sh --uninstall --purge` leaves nothing behind.

`pytest -m fresh` runs this alone; `bench/fresh_install.py` times the same path.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from machines import REPO, Machine, checkout, edit_messages, fresh_machine, host_ccache_dir

pytestmark = [pytest.mark.fresh, pytest.mark.system]
VENV_PIP = Path("/opt/llm-appliance/venv/bin/pip")
CHECKOUT = "/root/llm-appliance"
APPLIANCE_PATHS = ("/opt/llm-appliance", "/etc/llm-appliance", "/var/lib/llm-appliance", "/var/cache/llm-appliance")


def readme_commands() -> list[str]:
    """The set-up commands of README.md, as a user copies them: the shell block under "## Set up"."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Set up", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "README.md's Set up section has no ```sh block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_readme_gives_exactly_two_commands() -> None:
    commands = readme_commands()
    assert len(commands) == 2, commands
    assert commands[0].startswith("./install.sh"), commands
    assert "tests/run" in commands[1], commands
    assert "tests/run" in (REPO / ".ci/run").read_text()  # CI runs the README's test command


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Machine]:
    root = tmp_path_factory.mktemp("fresh") / "root"
    root.mkdir()
    with fresh_machine(root, VENV_PIP, host_ccache_dir()) as machine:
        checkout(root / CHECKOUT.lstrip("/"))  # what `git clone` leaves
        yield machine


def test_the_machine_is_pristine(fresh: Machine) -> None:
    for path in APPLIANCE_PATHS:
        assert fresh.run(f"test -e {path}", check=False).returncode == 1, f"{path} exists before the install"
    for tool in ("python3", "cmake", "g++", "nft", "sudo"):
        assert fresh.run(f"command -v {tool}", check=False).returncode == 1, f"{tool} is already installed"
    assert fresh.run("id llm-appliance", check=False).returncode == 1


def test_the_readme_install_command_serves_drafted_completions(fresh: Machine) -> None:
    install = readme_commands()[0]
    result = fresh.run(f"cd {CHECKOUT} && {install}", timeout=3600)
    output = result.stdout + result.stderr
    cold_steps = (
        "== OS packages",
        "Setting up python3-venv",
        "== virtualenv /opt/llm-appliance/venv",
        "created the system user llm-appliance",
        "engine: downloading llama-cpp-python==0.3.36",
        "engine: unpacking llama_cpp_python-0.3.36.tar.gz",
        "engine: configuring (cpu)",
        "engine: building llama-server",
        "engine: installed /opt/llm-appliance/engine/bin/llama-server",
        "models: fetching SmolLM2-135M-Instruct.Q4_1.gguf",
        "started llm-appliance-server.service",
    )
    for step in cold_steps:
        assert step in output, f"{step!r} did not run:\n{output[-6000:]}"
    assert fresh.run("systemctl is-active llm-appliance-server.service").stdout.strip() == "active"
    # No engine serves before its proof on this machine: the ladder's choice is said once, and status names it.
    assert "engine: /opt/llm-appliance/engine/bin/llama-server is proven before it serves" in output, output[-6000:]
    (chosen,) = re.findall(r"engine: serving from rung ([a-z-]+)", output)
    status = fresh.run("/opt/llm-appliance/venv/bin/llm-appliance status", check=False).stdout
    assert f"engine   rung: {chosen}, proven " in status, status
    # The demo drafts by n-gram lookup: from text seen before, so an edit asked twice drafts the second time.
    fresh.chat(edit_messages(), 128)
    timings = fresh.chat(edit_messages(), 128)["timings"]
    assert timings["draft_n"] > 0 and timings["draft_n_accepted"] > 0, timings


def test_a_second_install_changes_nothing(fresh: Machine) -> None:
    result = fresh.run(f"cd {CHECKOUT} && {readme_commands()[0]}", timeout=1800)
    output = result.stdout + result.stderr
    assert "install: nothing to change: the appliance is installed as specified" in output, output[-4000:]
    assert "nothing to prove" in output and "serving from rung" not in output, output[-4000:]


def test_uninstall_purge_leaves_nothing(fresh: Machine) -> None:
    fresh.run(f"cd {CHECKOUT} && ./install.sh --uninstall --purge", timeout=600)
    for path in APPLIANCE_PATHS:
        assert fresh.run(f"test -e {path}", check=False).returncode == 1, f"{path} is left"
    named = fresh.run(
        "find / -xdev \\( -name '*llm-appliance*' -o -name '*llm_appliance*' \\) "
        f"-not -path '{CHECKOUT}' -not -path '{CHECKOUT}/*' -not -path '/srv/*' -print"
    ).stdout
    assert named == "", f"left behind:\n{named}"
    assert fresh.run("id llm-appliance", check=False).returncode == 1
    assert fresh.run("nft list table inet llm_appliance", check=False).returncode != 0
    assert "llm-appliance" not in fresh.run("systemctl list-unit-files --no-pager").stdout
    assert fresh.run("pgrep -f llama-server", check=False).returncode == 1
