"""Each host's spec as the fleet derives it: the host's spec file, the fleet's and the host's overrides merged
over it, then what the fleet owns: the host's address for llama-server and the exporter (the balancer and
Prometheus reach both there), the balancer and Prometheus in network.allow, and a restart time of its own.

The derived spec is TOML text edited from the original (comments kept), because it is what the host
installs and applies: what runs on a host is what `apply` of that file renders, nothing fleet-only beside it.
A problem in it is reported where the user wrote the value: the fleet file for what the fleet sets, the
host's spec file for the rest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomlkit
from tomlkit.items import Table

from appliance import __version__
from appliance.fleet.load import LoadedFleet
from appliance.fleet.model import Balancer, Host, Rules
from appliance.spec.address import host_port, network_of
from appliance.spec.load import KeyLines, LoadedSpec, locate, parse_spec, parse_toml, read_text
from appliance.spec.model import Network, Prometheus
from appliance.spec.problems import Problem, SpecInvalid


@dataclass(frozen=True)
class HostSpec:
    host: Host
    source: Path  # the spec file it derives from
    text: str  # the derived spec, as the host installs it
    loaded: LoadedSpec  # `text`, read as a spec (its path: the source's, for the messages)
    fleet: LoadedFleet

    def locate(self, problem: Problem) -> Problem:
        return where_written(problem, self.fleet, self.host, self.source)


def where_written(problem: Problem, fleet: LoadedFleet, host: Host, source: Path) -> Problem:
    """`problem`, found in a host's derived spec, where the user wrote the value: an override or a field the
    fleet sets in the fleet file, the rest in the host's spec file."""
    index = fleet.index(host)
    table, _, rest = problem.field.partition(".")
    for where, overrides in (
        (f"hosts.{index}.overrides", host.overrides),
        ("fleet.overrides", fleet.fleet.fleet.overrides),
    ):
        if rest.split(".")[0] in overrides.get(table, {}):
            return _in_fleet(problem, fleet, host, f"{where}.{problem.field}")
    owned = {
        "server.host": f"hosts.{index}.address",
        "prometheus.host": f"hosts.{index}.address",
        "restart.schedule": "rules.restart_first",
        "fleet.min_ready": "rules.min_ready",
        "fleet.drain_seconds": "balancer.check_interval_seconds",
        "fleet.settle_seconds": "balancer.check_interval_seconds",
    }
    if problem.field in owned:
        return _in_fleet(problem, fleet, host, owned[problem.field])
    # The line found in the derived text is not the source's: look it up again there.
    unlocated = Problem(problem.severity, problem.field, problem.message, problem.fix)
    return locate(unlocated, source, KeyLines.of(read_text(source, str(source))))


def _in_fleet(problem: Problem, fleet: LoadedFleet, host: Host, field: str) -> Problem:
    message = f"{problem.message} (in host {host.name}'s spec as the fleet derives it: {problem.field})"
    readable = re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", field)
    return Problem(problem.severity, readable, message, problem.fix, fleet.path, fleet.key_lines.line_of(field))


def schedule(rules: Rules, index: int) -> str:
    """The index-th host's OnCalendar=: restart_first, then restart_spacing_minutes apart (wrapping at midnight)."""
    hours, minutes = (int(part) for part in rules.restart_first.split(":"))
    at = (hours * 60 + minutes + index * rules.restart_spacing_minutes) % (24 * 60)
    return f"*-*-* {at // 60:02d}:{at % 60:02d}:00"


def derive(fleet: LoadedFleet, host: Host) -> HostSpec:
    """The host's spec text and its parse; SpecInvalid (located in the fleet or the host's spec) if it fails."""
    source = fleet.spec_of(host)
    document = merged(fleet, host)
    f = fleet.fleet
    table_of(document, "server")["host"] = host.address
    table_of(document, "prometheus")["host"] = host.address
    # The host's own scrape jobs and rules carry the labels the fleet's targets give it.
    labels = table_of(document, "prometheus").get("labels")
    if labels is None:
        labels = table_of(document, "prometheus")["labels"] = tomlkit.inline_table()
    labels.update({"appliance": f.fleet.name, "host": host.name})
    allow = document.get("network", {}).get("allow", Network().allow)
    # The peers read this host's /ready before they restart (the min_ready guard): they are clients too.
    peers = [h.address for h in f.hosts if h != host]
    extra = [network_of(a) for a in (f.balancer.address, f.prometheus.address, *peers) if a is not None]
    table_of(document, "network")["allow"] = list(dict.fromkeys([*(str(a) for a in allow), *extra]))
    table_of(document, "restart")["schedule"] = schedule(f.rules, fleet.index(host))
    document["fleet"] = _member(fleet, host)
    header = (
        f"# host {host.name} of fleet {f.fleet.name}: generated from {fleet.path.name} and {source.name} by "
        f"llm-appliance {__version__};\n# edit those and run `llm-appliance fleet render`, not this file.\n"
    )
    text = header + tomlkit.dumps(document)
    try:
        loaded = parse_spec(text, source)
    except SpecInvalid as exc:
        raise SpecInvalid([where_written(p, fleet, host, source) for p in exc.problems]) from None
    return HostSpec(host, source, text, loaded, fleet)


def drain_seconds(balancer: Balancer) -> int:
    """How long a host stays not-ready before it restarts: HAProxy marks it down after `fall` failed checks
    `inter` apart; one more interval covers a check already under way and HAProxy's spread of checks."""
    return balancer.check_interval_seconds * (balancer.fall + 1)


def settle_seconds(balancer: Balancer) -> int:
    """How long a host back from its restart must be ready before the next host may go: HAProxy sends to it
    again after `rise` good checks `inter` apart, and one more interval covers the spread of checks."""
    return balancer.check_interval_seconds * (balancer.rise + 1)


def _member(fleet: LoadedFleet, host: Host) -> Table:
    """The host's [fleet] table: its peers' /ready (their exporters, after their overrides), min_ready, the drain."""
    table = tomlkit.table()
    table.comment("written by `llm-appliance fleet render`: the restart path's drain and min_ready guard")
    table["host"] = host.name
    peers = tomlkit.inline_table()
    for peer in fleet.fleet.hosts:
        if peer != host:
            peers[peer.name] = ready_url(peer, merged(fleet, peer))
    table["peers"] = peers
    table["min_ready"] = fleet.fleet.rules.min_ready
    table["drain_seconds"] = drain_seconds(fleet.fleet.balancer)
    table["settle_seconds"] = settle_seconds(fleet.fleet.balancer)
    table["turns"] = "peers"  # the daemons settle the turns among themselves (k8s render writes "eviction")
    if fleet.fleet.fleet.key_file is not None:
        table["key_file"] = str(fleet.fleet.fleet.key_file)
    return table


def ready_url(host: Host, document: Any) -> str:
    """The host's /ready: its exporter, on the host's address (the fleet sets prometheus.host to it)."""
    return f"http://{host_port(host.address, exporter_port(document))}/ready"


def exporter_port(document: Any) -> int:
    """prometheus.port of a spec document (merged overrides and all), its default if unset."""
    port = document.get("prometheus", {}).get("port", Prometheus().port)
    # A port of the wrong type is reported when that host's own spec is checked; here any number will do.
    return port if isinstance(port, int) and not isinstance(port, bool) else Prometheus().port


def merged(fleet: LoadedFleet, host: Host) -> Any:
    """The host's spec file as a tomlkit document (comments kept), with the fleet's and the host's overrides."""
    source = fleet.spec_of(host)
    original = read_text(source, str(source))
    parse_toml(original, source)  # a syntax error, located, before tomlkit's own words for it
    document = tomlkit.parse(original)
    for overrides in (fleet.fleet.fleet.overrides, host.overrides):
        for table, values in overrides.items():
            _merge(table_of(document, table), values)
    return document


def table_of(document: Any, name: str) -> Table:
    if name not in document:
        document[name] = tomlkit.table()
    table: Table = document[name]
    return table


def _merge(table: Any, values: dict[str, Any]) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(table.get(key), dict):
            _merge(table[key], value)
        else:
            table[key] = value
