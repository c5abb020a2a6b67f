"""Root runs nothing of the appliance's: `up` and `restart` started by root do what only root can (load the
applied nftables ruleset, create the state directory), then become the service user for good, as the units'
User= makes them, before anything is started or written.

Without systemd what the units add on top of the user is missing, and `up` says so once.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

from appliance.plan.resolved import Appliance
from appliance.render.render import render
from appliance.system import paths
from appliance.system.run import run
from appliance.system.users import Access, Account, account, denied_as, drop_to, exposure

STATE_MODE = 0o700
NOT_ENFORCED = (
    "llm-appliance up: running as {user}, without systemd; what its units would add is missing here: no system "
    "call filter, no private /tmp or /dev (every device node the user may open is open), no read-only view of "
    "the file system beyond the user's own rights, no capability or namespace restrictions, and no IP address "
    "policy beyond the nftables table ({ruleset})"
)
AS_CURRENT_USER = (
    "llm-appliance up: --as-current-user: llama-server and the health daemon run as root, unsandboxed; "
    "for tests and debugging only"
)


class PrivilegeError(Exception):
    """Root asked to run the appliance and cannot hand it to the service user (none exists, or its state
    directory would be somewhere the user could redirect root's chown)."""


def service_user(command: str) -> Account:
    who = account()
    if who is None:
        raise PrivilegeError(
            f"the service user {paths.SERVICE_USER} does not exist, and root runs nothing of the appliance's "
            f"itself: install.sh creates the user (`useradd --system {paths.SERVICE_USER}` does too); "
            + (
                "or pass --as-current-user to run llama-server as root, unsandboxed"
                if command == "up"
                else "then run it again"
            )
        )
    return who


def interpreter_paths() -> list[Path]:
    """What this process still reads once it has dropped: its interpreter, and each directory of sys.path it has
    imported from (the standard library, its C extensions, the virtualenv's site-packages, the appliance's own
    source), where what it imports later comes from (the idna codec at the exporter's first bind)."""
    entries = [entry for entry in sys.path if os.path.isabs(entry) and os.path.isdir(entry)]
    files = [
        file for module in list(sys.modules.values()) if isinstance(file := getattr(module, "__file__", None), str)
    ]
    used = [entry for entry in entries if any(file.startswith(os.path.join(entry, "")) for file in files)]
    return [Path(sys.executable), *map(Path, dict.fromkeys(used))]


def require_usable_interpreter(who: Account, needed: Sequence[Path] | None = None) -> None:
    """Refuse before dropping when `who` could not go on running this Python (one built under /root, say):
    after the drop it would die at its next import, with a traceback that names no file."""
    wanted = [Access(path, execute=True) for path in (interpreter_paths() if needed is None else needed)]
    refused = denied_as(who, wanted)
    if not refused:
        return
    access, reason = next(iter(refused.items()))
    what = "its interpreter" if access.path == Path(sys.executable) else "a directory it imports from"
    raise PrivilegeError(
        f"{who.name} could not go on running this Python once `up` becomes it: {what}, {access.path}: {reason}; "
        f"run `up` from a virtualenv of /usr/bin/python3 (`/usr/bin/python3 -m venv DIR`, as install.sh makes "
        f"{paths.VENV}), or pass --as-current-user"
    )


def prepare(appliance: Appliance, who: Account) -> str:
    """What root does before `up` drops: the state directory (as StateDirectory= would make it) and the
    ruleset, when the one applied is this spec's. Returns what became of the ruleset, for NOT_ENFORCED."""
    state = appliance.state_file.parent
    reason = exposure(_nearest_existing(state.parent), who)
    if reason:
        raise PrivilegeError(f"cannot give {state} to {who.name}: {reason}; choose another --state-dir")
    state.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(state, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchown(descriptor, who.uid, who.gid)
        os.fchmod(descriptor, STATE_MODE)
    finally:
        os.close(descriptor)
    return _load_ruleset(appliance)


def _load_ruleset(appliance: Appliance) -> str:
    applied = paths.RULESET
    if not applied.is_file():
        return f"none is applied: {applied} does not exist"
    if applied.read_text() != render(appliance)[str(applied.relative_to("/"))]:
        return f"not loaded: {applied} is another spec's; `llm-appliance apply` this one first"
    if shutil.which("nft") is None:
        return "not loaded: nft is not installed"
    run(["nft", "-f", str(applied)])
    return f"{applied}, loaded"


def become(who: Account, workdir: Path, bind_low_ports: bool = False) -> None:
    """The service user from here on, in its own directory, with its own name in the environment."""
    drop_to(who, bind_low_ports)
    os.environ.update(HOME=str(workdir), USER=who.name, LOGNAME=who.name)
    try:
        os.chdir(workdir)
    except OSError:
        os.chdir("/")  # root's working directory may be closed to it


def become_owner(state_dir: Path) -> None:
    """`restart` started by root: talk to the daemon as the owner of its state directory, the service user
    (root stays root for the directory of an `up` run as root). Root looks at the directory, never into it."""
    try:
        status = os.lstat(state_dir)
    except OSError as exc:
        raise PrivilegeError(f"no health daemon keeps its state in {state_dir}: {exc.strerror}") from None
    if not stat.S_ISDIR(status.st_mode):
        raise PrivilegeError(f"{state_dir} is not a directory (a link?); name the daemon's own --state-dir")
    if status.st_uid == 0:
        return
    who = service_user("restart")
    if status.st_uid != who.uid:
        raise PrivilegeError(f"{state_dir} belongs to uid {status.st_uid}, neither root nor {who.name}")
    become(who, state_dir)


def say_what_is_not_enforced(who: Account, ruleset: str) -> None:
    print(NOT_ENFORCED.format(user=who.name, ruleset=ruleset), file=sys.stderr, flush=True)


def _nearest_existing(directory: Path) -> Path:
    while not directory.is_dir() and directory != directory.parent:
        directory = directory.parent
    return directory
