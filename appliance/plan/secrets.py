"""The API key files, checked as their readers will read them, not as root (who runs validate) reads them:
llama-server and the health daemon read server.api_key_file as the service user; Prometheus sends
prometheus.scrape_key_file (else server.api_key_file) as one bearer token. No message shows a key.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from pathlib import Path

from appliance.facts.keys import bearer_token, parse_keys
from appliance.spec.model import Spec
from appliance.spec.problems import Problem, error, warning
from appliance.system import paths
from appliance.system.users import Access, account, closed_directories, denied_as, stranger

API_KEY = "server.api_key_file"
SCRAPE_KEY = "prometheus.scrape_key_file"
USER = paths.SERVICE_USER
PROMETHEUS_USER = "prometheus"  # as Debian's prometheus package creates it
UPSTREAM_KEY = "fallback.api_key_file"
FLEET_KEY = "fleet.key_file"
ROUTER_USER = paths.ROUTER_USER


def key_problems(spec: Spec) -> list[Problem]:
    found: list[Problem] = (
        _upstream_key(spec.fallback.api_key_file) if spec.fallback and spec.fallback.api_key_file else []
    )
    api, keys = spec.server.api_key_file, None
    if api is not None:
        text = _read(API_KEY, api, f"install -m 0640 -o root -g {USER} /dev/null {api}; write one key per line", found)
        if text is not None:
            keys = parse_keys(text)
            found += _api_key_content(api, keys) + _service_user_reads(api)
    scrape = spec.prometheus.scrape_key_file
    if scrape is not None:
        found += _scrape_key(scrape, keys)
    elif keys is not None and len(keys) > 1:
        found.append(
            error(
                SCRAPE_KEY,
                f"{api} holds {len(keys)} keys, and the scrape job would send the whole file as one bearer token: "
                "llama-server answers 401 and LlmApplianceServerDown fires",
                "put the one key Prometheus uses in a file of its own and set prometheus.scrape_key_file to it",
            )
        )
    sent = scrape or api
    if sent is not None and sent.is_file():
        found += _prometheus_reads(SCRAPE_KEY if scrape else API_KEY, sent)
    return found + _fleet_key(spec)


def _fleet_key(spec: Spec) -> list[Problem]:
    """The fleet's shared key: read by the health daemon as the service user, and by nobody else."""
    fleet = spec.fleet
    if fleet is None or fleet.key_file is None:
        if fleet is not None and fleet.peers:  # turns = "eviction" (peers without key_file is refused otherwise)
            return [
                warning(
                    FLEET_KEY,
                    "the peers' /ready (read for the fleet-wide decay hold) is not authenticated: any pod that "
                    "answers at a peer's address could hold every restart for decay",
                    "set fleet.key_file to the fleet's key, the same file in every pod",
                )
            ]
        return []
    path = fleet.key_file
    create = f"install -m 0640 -o root -g {USER} /dev/null {path} && openssl rand -hex 32 > {path}"
    found: list[Problem] = []
    text = _read(FLEET_KEY, path, create + " (the same file on every host)", found)
    if text is None:
        return found
    token = bearer_token(text)
    if len(token) < 16 or "\n" in token or "\r" in token:
        found.append(error(FLEET_KEY, f"{path} must hold one key of 16 characters or more, on one line", create))
    return found + _service_user_reads(path, FLEET_KEY, "The health daemon")


def _read(field: str, path: Path, create: str, found: list[Problem]) -> str | None:
    if not path.exists():
        found.append(error(field, f"{path} does not exist", f"create it: {create}"))
    elif not path.is_file():
        found.append(error(field, f"{path} is not a file", f"point it at a file: {create}"))
    else:
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
            found.append(error(field, f"{path} cannot be read: {reason}", f"create it anew: {create}"))
    return None


def _api_key_content(path: Path, keys: list[str]) -> list[Problem]:
    if not keys:
        return [
            error(
                API_KEY,
                f"{path} holds no key (only empty lines and # comments): llama-server would ask no key of anyone",
                "write one key per line",
            )
        ]
    if any(key != key.strip() for key in keys):
        return [
            error(
                API_KEY,
                f"{path}: a key has leading or trailing white space (or a Windows line end); llama-server compares "
                "the line as written, while clients and Prometheus send keys trimmed, and get 401",
                "remove the white space around the keys; end each line with \\n alone",
            )
        ]
    return []


def _service_user_reads(path: Path, field: str = API_KEY, reader: str = "The server") -> list[Problem]:
    """root:llm-appliance, 0640 or 0440: the server reads it, no other user does, and it cannot rewrite it."""
    who = account()
    if who is None:
        return [
            warning(
                field,
                f"cannot check that {USER} can read {path}: the user does not exist on this machine yet",
                f"install.sh creates it; then: chown root:{USER} {path} && chmod 0640 {path}",
            )
        ]
    status = os.stat(path)
    mode = stat.S_IMODE(status.st_mode)
    wrong = []
    if status.st_uid != 0:
        wrong.append(f"it belongs to {_user(status.st_uid)}, not root")
    if status.st_gid != who.gid:
        wrong.append(f"its group is {_group(status.st_gid)}, not {who.group_name}")
    if mode & 0o007:
        wrong.append(f"mode {mode:04o} opens it to every user on this machine")
    if mode & 0o020:
        wrong.append(f"mode {mode:04o} lets {USER} rewrite the keys")
    if not mode & 0o040:
        wrong.append(f"mode {mode:04o} does not let the group read it")
    if wrong:
        return [
            error(
                field,
                f"{path}: {'; '.join(wrong)}. {reader} reads it as {USER}: it must be root:{who.group_name}, "
                "mode 0640 or 0440",
                f"chown root:{who.group_name} {path} && chmod 0640 {path} "
                f"(a new one: install -m 0640 -o root -g {who.group_name} /dev/null {path})",
            )
        ]
    # Every directory on the way counts, even where the units bind the file (plan/sandbox.py): `up` reads it
    # as the service user with no sandbox.
    unreachable = denied_as(who, [Access(path)]).get(Access(path))
    if unreachable:
        closed = closed_directories(path, who)
        through = " && ".join(f"chmod {owner}+x {directory}" for directory, owner in closed)
        return [
            error(
                field,
                f"{USER} cannot read {path}: {unreachable}",
                (f"let it through: {through} (search only: it still cannot list them); or " if through else "")
                + f"keep the key file in a directory {USER} may enter, e.g. {paths.ETC}",
            )
        ]
    return []


def _scrape_key(path: Path, keys: list[str] | None) -> list[Problem]:
    found: list[Problem] = []
    text = _read(
        SCRAPE_KEY,
        path,
        f"install -m 0640 -o root -g prometheus /dev/null {path} (the group Prometheus runs as); "
        f"write into it one of the keys of {API_KEY}",
        found,
    )
    if text is None:
        return found
    token = bearer_token(text)
    if not token:
        found.append(error(SCRAPE_KEY, f"{path} holds no key", f"write into it one of the keys of {API_KEY}"))
    elif "\n" in token or "\r" in token:
        found.append(
            error(
                SCRAPE_KEY,
                f"{path} holds more than one line: Prometheus sends the whole file as one bearer token",
                "write the one key alone, on one line, without comments",
            )
        )
    elif keys is not None and token not in keys:
        found.append(
            error(
                SCRAPE_KEY,
                f"the key in {path} is not one of the keys of {API_KEY}: llama-server would answer Prometheus 401",
                f"write into it one line of {API_KEY}",
            )
        )
    found += _open_to_everyone(
        SCRAPE_KEY, path, "the key", f"chown root:prometheus {path} && chmod 0640 {path} (the group Prometheus runs as)"
    )
    return found


def _prometheus_reads(field: str, path: Path) -> list[Problem]:
    """The scrape job's key, tried as the user a Prometheus on this machine runs as. A warning: the server starts
    either way, and Prometheus may run on another machine; but here its scrape would fail, and the alerts fire."""
    who = account(PROMETHEUS_USER)
    if who is None:
        return []
    refused = denied_as(who, [Access(path)]).get(Access(path))
    if refused is None:
        return []
    return [
        warning(
            field,
            f"the llama-server scrape job sends {path}, and {PROMETHEUS_USER} (the user Prometheus runs as here) "
            f"cannot read it: {refused}; the scrape would fail and LlmApplianceServerDown fire",
            f"give Prometheus a key file of its own: install -m 0640 -o root -g {PROMETHEUS_USER} /dev/null FILE, "
            "write one of the keys into it, set prometheus.scrape_key_file = FILE",
        )
    ]


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid {gid}"


def _upstream_key(path: Path) -> list[Problem]:
    """The upstream's key: one line, which the router's user reads and nobody else does, the service user least
    of all (a compromised llama-server must not be able to spend the team's cloud account)."""
    create = f"install -m 0640 -o root -g {ROUTER_USER} /dev/null {path}; write the upstream's key into it"
    found: list[Problem] = []
    text = _read(UPSTREAM_KEY, path, create, found)
    if text is None:
        return found
    token = bearer_token(text)
    if not token or "\n" in token or "\r" in token:
        found.append(error(UPSTREAM_KEY, f"{path} must hold the upstream's key alone, on one line", create))
    found += _open_to_everyone(
        UPSTREAM_KEY, path, "the upstream's key", f"chown root:{ROUTER_USER} {path} && chmod 0640 {path}"
    )
    router = account(ROUTER_USER) or stranger(ROUTER_USER)
    refused = denied_as(router, [Access(path)]).get(Access(path))
    if refused:
        closed = closed_directories(path, router)
        through = " && ".join(f"chmod {owner}+x {directory}" for directory, owner in closed)
        found.append(
            error(
                UPSTREAM_KEY,
                f"the router reads {path} as {ROUTER_USER}, and cannot: {refused}",
                (f"let it through: {through}; and " if through else "")
                + f"chown root:{ROUTER_USER} {path} && chmod 0640 {path}",
            )
        )
    service = account(USER)
    if service is not None and not denied_as(service, [Access(path)]):
        found.append(
            error(
                UPSTREAM_KEY,
                f"{USER} (llama-server's user) can read {path}: a compromised server could spend the upstream account",
                f"chown root:{ROUTER_USER} {path} && chmod 0640 {path}",
            )
        )
    return found


def _open_to_everyone(field: str, path: Path, what: str, fix: str) -> list[Problem]:
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if not mode & 0o007:
        return []
    return [error(field, f"{path}: mode {mode:04o} gives {what} to every user on this machine", fix)]
