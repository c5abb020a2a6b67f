"""The spec against the sandbox its units impose and the user they run as: every file a unit opens must be
reachable inside the unit's namespace and readable by the service user, checked as that user.

- ProtectHome= hides /home, /root and /run/user, where people keep ~/models and the Hugging Face cache: a file
  there is bound back read-only (BindReadOnlyPaths=, with ProtectHome=tmpfs, the one mode that can take a
  bind), the file alone, not its neighbours;
- PrivateTmp= gives each unit its own, empty /tmp and /var/tmp, and the host empties or ages both at boot: a
  file there (as written, or where its links lead) is refused, never bound: it would be gone after a reboot;
- the service user must read what it opens (a directory of mode 0700 on the way, a file of another group):
  root tries it as that user for real (system.users.denied_as, ACLs included), and the fix names each directory
  that stops it (`chmod o+x DIR`) and the file's own mode; before the user exists, the modes are read as any
  other user's (ACLs not), which it will be to every file there now. Every directory on the way counts, even
  for a file the units bind: `llm-appliance up` runs the same files as that user with no sandbox at all.

Validation, not planning: it reads the file system, as validate.py does.
"""

from __future__ import annotations

import grp
import os
from dataclasses import dataclass
from pathlib import Path

from appliance.spec.model import Spec
from appliance.spec.problems import Problem, error, warning
from appliance.system import paths
from appliance.system.users import (
    READ,
    SEARCH,
    Access,
    Account,
    account,
    closed_directories,
    denied_as,
    may,
    refused_by_modes,
    stranger,
)

HIDDEN_HOMES = (Path("/home"), Path("/root"), Path("/run/user"))  # ProtectHome=
PRIVATE_TMP = (Path("/tmp"), Path("/var/tmp"))  # PrivateTmp=: the unit's own, empty; refused, not bound
# What BindReadOnlyPaths= cannot carry, even quoted: its separator, systemd's specifiers and escapes.
UNBINDABLE = frozenset(":%\"\\'")
MODELS = paths.STATE.parent / "models"


@dataclass(frozen=True)
class Sandbox:
    """The paths each unit binds read-only from a hidden home; empty: the unit keeps ProtectHome=yes."""

    server_binds: tuple[str, ...] = ()
    health_binds: tuple[str, ...] = ()
    restart_binds: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Opened:
    field: str
    path: Path
    units: tuple[str, ...]  # "server", "health", "restart"
    execute: bool = False
    optional: bool = False  # may not exist yet (the baseline): bound with "-", not checked for reading
    checked_elsewhere: bool = False  # the API key files: plan/secrets.py checks owner, mode and reading
    move_to: Path = MODELS


def opened_files(spec: Spec, binary: str, key_files: bool = True) -> list[_Opened]:
    found = [_Opened("server.binary", Path(binary), ("server",), execute=True, move_to=paths.ENGINE_DIR)]
    for role, model in (("target", spec.models.target), ("draft", spec.models.draft)):
        if model is not None:
            found.append(_Opened(f"models.{role}.path", model.path, ("server",)))
    if spec.server.api_key_file is not None and key_files:
        found.append(
            _Opened(
                "server.api_key_file",
                spec.server.api_key_file,
                ("server", "health", "restart"),
                checked_elsewhere=True,
                move_to=paths.ETC,
            )
        )
    if spec.fleet is not None and spec.fleet.key_file is not None:
        found.append(
            _Opened("fleet.key_file", spec.fleet.key_file, ("health",), checked_elsewhere=True, move_to=paths.ETC)
        )
    found.append(
        _Opened("health.baseline_file", spec.health.baseline_file, ("health",), optional=True, move_to=paths.STATE)
    )
    return found


def under(path: Path, roots: tuple[Path, ...]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def hidden(path: Path) -> list[Path]:
    """The names of `path` (as written, and the file it leads to) in a home the units' sandbox hides: to bind."""
    return [p for p in dict.fromkeys((path, _real(path))) if under(p, HIDDEN_HOMES)]


def temporary(path: Path) -> Path | None:
    """The temporary directory `path` is in, or leads into (a link followed); None when neither."""
    return next((root for p in (path, _real(path)) for root in PRIVATE_TMP if under(p, (root,))), None)


def sandbox(spec: Spec, binary: str, key_files: bool = True) -> tuple[Sandbox, list[Problem]]:
    """The binds the units need, and every file they could not open. Without `key_files`, the key file is not
    this machine's (a cluster's Secret, mounted where the pod's `up` reads it): neither checked nor bound."""
    binds: dict[str, list[str]] = {"server": [], "health": [], "restart": []}
    found: list[Problem] = []
    wanted: dict[Access, _Opened] = {}
    for opened in opened_files(spec, binary, key_files):
        path = opened.path
        if not path.is_absolute():
            found.append(
                error(
                    opened.field,
                    f"{path} is relative; the units do not start where you run validate",
                    f"write it in full, e.g. {opened.move_to / path.name}",
                )
            )
            continue
        tmp = temporary(path)
        if tmp is not None:
            real = _real(path)
            where = f"{path}" if under(path, (tmp,)) else f"{path} leads to {real}, which"
            found.append(
                error(
                    opened.field,
                    f"{where} is in a temporary directory ({tmp}): the units do not see it (PrivateTmp= gives each "
                    "its own, empty /tmp and /var/tmp), and the system empties /tmp at boot and ages /var/tmp",
                    f"move it to {opened.move_to}/ and set {opened.field} to where it is then",
                )
            )
            continue  # the move is the fix, whatever else stops the service user on the way there now
        bound = hidden(path)
        if bound:
            bad = sorted({c for p in bound for c in str(p) if c in UNBINDABLE})
            if bad:
                found.append(
                    error(
                        opened.field,
                        f"{path} is where the units' sandbox hides it (ProtectHome=), and its name holds "
                        f"{' '.join(bad)}, which systemd cannot bind back into them (BindReadOnlyPaths=)",
                        f"rename it without {' '.join(bad)}, or move it to {opened.move_to}/",
                    )
                )
                continue
            # The binary brings its libraries from its own directory (a llama.cpp build's bin/).
            shown = [str(p.parent) if opened.execute else str(p) for p in bound]
            for unit in opened.units:
                binds[unit] += [("-" if opened.optional else "") + p for p in shown]
        # A file that does not exist has its own error (the model, the key) or warning (the binary, before
        # `engine install`); the baseline may come later, from `bench`.
        if path.exists() and not opened.checked_elsewhere:
            # One problem per file: a model that is both target and draft is named once, as the target.
            wanted.setdefault(Access(path, execute=opened.execute), opened)
    found += _readable(wanted)
    box = Sandbox(*(tuple(dict.fromkeys(binds[unit])) for unit in ("server", "health", "restart")))
    return box, found


def _readable(wanted: dict[Access, _Opened]) -> list[Problem]:
    who = account()
    checked_as = ""
    if who is None:
        if not wanted:
            return []
        # validate on a machine the appliance is not installed on yet: install.sh creates the user with a group
        # of its own, so to every file there now it will be "other"; what "other" may not open, neither will it.
        who = stranger("any other user")
        checked_as = (
            f" ({paths.SERVICE_USER}, the user the units will run as, does not exist here yet: checked as any "
            "other user, which it will be to this file)"
        )
        refused = refused_by_modes(who, list(wanted))
        if not refused:
            return [
                warning(
                    next(iter(wanted.values())).field,
                    f"{paths.SERVICE_USER} does not exist on this machine yet: the files its units open were checked "
                    "as any other user would open them (by their modes; ACLs and groups not)",
                    "install.sh creates it; validate again after",
                )
            ]
    else:
        refused = denied_as(who, list(wanted))
    found = []
    for access, reason in refused.items():
        opened = wanted[access]
        verb = "run" if opened.execute else "read"
        user = who.name if checked_as else f"{who.name}, the user the units run as,"
        found.append(
            error(
                opened.field,
                f"{user} cannot {verb} {access.path}: {reason}{checked_as}",
                _fix(access, opened, who, checked_as != ""),
            )
        )
    return found


def _fix(access: Access, opened: _Opened, who: Account, stranger: bool) -> str:
    """The commands that let `who` open the file: x on each directory that stops it on the way (search alone: it
    still cannot list them), then read on the file itself; or the move to where it may."""
    fixes = []
    closed = closed_directories(access.path, who)
    if closed:
        fixes.append(" && ".join(f"chmod {owner}+x {directory}" for directory, owner in closed))
    bits = READ | (SEARCH if opened.execute else 0)
    if not may(os.stat(access.path), who, bits):
        x = "x" if opened.execute else ""
        if stranger:
            fixes.append(f"chmod o+r{x} {access.path}")
        else:
            group = _group(access.path)
            # Never "join root's group": that would open every root:root 0640 file to a compromised server.
            join = f" (or add it to the file's group: usermod -aG {group} {who.name})" if group != "root" else ""
            fixes.append(f"chgrp {who.group_name} {access.path} && chmod g+r{x} {access.path}{join}")
    if not fixes:  # the modes allow it, the kernel does not: an ACL, a security module
        return (
            f"let it: chgrp {who.group_name} {access.path} && chmod g+r{'x' if opened.execute else ''} "
            f"{access.path} (and g+x on each directory on the way; check getfacl), or move the file to "
            f"{opened.move_to}/"
        )
    return f"let it: {' && '.join(fixes)}; or move the file to {opened.move_to}/"


def _group(path: Path) -> str:
    gid = os.stat(path).st_gid
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
