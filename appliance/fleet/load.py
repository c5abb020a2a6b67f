"""Read a fleet file: TOML, the typed model, then the checks across hosts; every problem located by file,
line and field, as the spec's are (spec/load.py)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import ValidationError

from appliance.fleet.model import Fleet, Host
from appliance.spec.load import KeyLines, locate, located_problems, parse_toml, read_text
from appliance.spec.problems import Problem, SpecInvalid, error

MINUTES_PER_DAY = 24 * 60
# Spec fields the fleet sets on every host (hosts.py); an override of one would be silently lost.
FLEET_OWNED = {
    "server.host": "the fleet sets it to the host's address",
    "prometheus.host": "the fleet sets it to the host's address (the balancer checks /ready there)",
    "fleet": "the fleet writes each host's [fleet] table (peers, min_ready, the drain) from the fleet file",
    "restart.schedule": "the fleet spreads the schedules: set rules.restart_first and rules.restart_spacing_minutes",
}


@dataclass(frozen=True)
class LoadedFleet:
    fleet: Fleet
    path: Path
    key_lines: KeyLines

    def locate(self, problem: Problem) -> Problem:
        """`problem` at its line of the fleet file, its field as the user reads it (hosts[2], not hosts.2)."""
        located = locate(problem, self.path, self.key_lines)
        return replace(located, field=re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", located.field))

    def spec_of(self, host: Host) -> Path:
        """The host's spec file: its own or the shared one, relative to the fleet file."""
        written = host.spec or self.fleet.fleet.spec
        assert written is not None, "load_fleet refuses a host without a spec"
        return written if written.is_absolute() else self.path.parent / written

    def index(self, host: Host) -> int:
        return self.fleet.hosts.index(host)


def load_fleet(path: Path) -> LoadedFleet:
    """The fleet file, typed and checked across hosts, or SpecInvalid listing every problem."""
    text = read_text(path, "/etc/llm-appliance/fleet.toml", "fleet file")
    document, key_lines = parse_toml(text, path)
    try:
        fleet = Fleet.model_validate(document)
    except ValidationError as exc:
        raise SpecInvalid([_bracketed(p) for p in located_problems(exc, document, path, key_lines, Fleet)]) from None
    loaded = LoadedFleet(fleet, path, key_lines)
    found = [_bracketed(loaded.locate(p)) for p in fleet_problems(fleet)]
    if found:
        raise SpecInvalid(found)
    return loaded


def fleet_problems(fleet: Fleet) -> list[Problem]:
    found: list[Problem] = []
    names = Counter(host.name for host in fleet.hosts)
    for i, host in enumerate(fleet.hosts):
        if names[host.name] > 1:
            found.append(
                error(f"hosts.{i}.name", f"{host.name!r} names more than one host", "give each host its own name")
            )
        if host.spec is None and fleet.fleet.spec is None:
            found.append(
                error(
                    f"hosts.{i}.spec",
                    f"host {host.name!r} has no spec, and the fleet has no shared one",
                    'set spec = "appliance.toml" under [fleet] (shared by every host) or under this host',
                )
            )
        found += _owned_problems(f"hosts.{i}.overrides", host.overrides)
    found += _owned_problems("fleet.overrides", fleet.fleet.overrides)
    hosts = len(fleet.hosts)
    if fleet.rules.min_ready >= hosts:
        found.append(
            error(
                "rules.min_ready",
                f"{fleet.rules.min_ready} of {hosts} host{'s' if hosts != 1 else ''} must stay ready: no host could "
                "ever restart (a restart waits until the others keep min_ready serving)",
                f"set min_ready below {hosts}, or add hosts",
            )
        )
    if fleet.rules.restart_spacing_minutes * hosts > MINUTES_PER_DAY:
        found.append(
            error(
                "rules.restart_spacing_minutes",
                f"{hosts} hosts {fleet.rules.restart_spacing_minutes} minutes apart take more than a day: two would "
                "share a time",
                f"use at most {MINUTES_PER_DAY // hosts} minutes",
            )
        )
    if fleet.balancer.port == fleet.balancer.stats_port:
        found.append(
            error(
                "balancer.stats_port",
                f"the API and HAProxy's metrics would both listen on port {fleet.balancer.port}",
                f"choose another port, e.g. stats_port = {fleet.balancer.port + 404}",
            )
        )
    return found


def _owned_problems(where: str, overrides: dict[str, dict[str, object]]) -> list[Problem]:
    return [
        error(f"{where}.{table}.{key}", "is the fleet's to set", f"remove it: {why}")
        for table, values in overrides.items()
        for key in values
        if (why := FLEET_OWNED.get(f"{table}.{key}", FLEET_OWNED.get(table))) is not None
    ]


def _bracketed(problem: Problem) -> Problem:
    """hosts.1.name as a reader writes it: hosts[1].name."""
    field = re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", problem.field)
    return Problem(problem.severity, field, problem.message, problem.fix, problem.file, problem.line)
