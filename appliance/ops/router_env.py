"""What the router needs on the machine ([fallback]): a user of its own, in the service user's group (it reads
the local API key, and nobody but it and root reads the upstream's), and LiteLLM's proxy in a virtualenv apart
from the appliance's, installed from router-requirements.txt, every package pinned with its hashes: a router
holds API keys, and pip refuses a file that is not the one pinned."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from appliance.system import paths
from appliance.system.files import write_atomically
from appliance.system.run import run
from appliance.system.users import Account, account

REQUIREMENTS = "router-requirements.txt"
INSTALLED_RECORD = "llm-appliance-requirements.sha256"  # in the venv: which requirements it was made from


def requirements_text() -> str:
    return resources.files("appliance.ops").joinpath(REQUIREMENTS).read_text()


def ensure_router_user(did: Callable[[str], None]) -> Account:
    if account(paths.ROUTER_USER) is None:
        run(
            [
                "useradd",
                "--system",
                "--no-create-home",
                "--home-dir",
                "/nonexistent",
                "--shell",
                "/usr/sbin/nologin",
                "--groups",
                paths.SERVICE_USER,
                paths.ROUTER_USER,
            ]
        )
        did(f"created the system user {paths.ROUTER_USER} (in group {paths.SERVICE_USER})")
    who = account(paths.ROUTER_USER)
    assert who is not None, f"useradd did not create {paths.ROUTER_USER}"
    return who


def ensure_router_venv(did: Callable[[str], None], venv: Path = paths.ROUTER_VENV) -> None:
    """The router's virtualenv, made by the distribution's python3 and filled with --require-hashes; made again
    only when the pinned requirements change."""
    text = requirements_text()
    digest = hashlib.sha256(text.encode()).hexdigest()
    record = venv / INSTALLED_RECORD
    if record.is_file() and record.read_text().strip() == digest and (venv / "bin" / "litellm").is_file():
        return
    if not (venv / "bin" / "python").is_file():
        run(["/usr/bin/python3", "-m", "venv", str(venv)])
    pinned = venv / REQUIREMENTS
    write_atomically(pinned, text)
    pip = [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check"]
    run([*pip, "--require-hashes", "--no-deps", "-r", str(pinned)])
    write_atomically(record, digest + "\n")
    did(f"installed the router (LiteLLM's proxy, hash-pinned) in {venv}")


def ensure_router(did: Callable[[str], None]) -> None:
    ensure_router_user(did)
    ensure_router_venv(did)
