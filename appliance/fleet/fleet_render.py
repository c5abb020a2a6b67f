"""The fleet's files: each host's tree (its derived spec, rendered as `apply` renders it), haproxy.cfg for the
balancer, and for Prometheus the file_sd targets (one entry per host and job), the scrape jobs that read
them, each host's alert rules and the fleet's own.

`hosts()` validates and resolves each host (it reads the model files, as `render` does); `render_fleet` is
pure: the same fleet and hosts give the same bytes.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

from appliance import __version__
from appliance.facts.machine import MachineFacts
from appliance.fleet.hosts import HostSpec, derive, where_written
from appliance.fleet.load import LoadedFleet
from appliance.fleet.model import Balancer, Fleet, Host
from appliance.plan.endpoint import Endpoint
from appliance.plan.resolved import Appliance, resolve
from appliance.plan.router import Router, router
from appliance.plan.validate import validate_loaded
from appliance.render.apply import installed_spec_path
from appliance.render.promql import quoted
from appliance.render.render import duration, render
from appliance.render.router_files import RouterPlace, router_files
from appliance.render.templates import template
from appliance.spec.address import host_port, ip_address
from appliance.spec.problems import Problem, Severity, SpecInvalid, error, warning
from appliance.system import metric_names as metric
from appliance.system import paths

BALANCER = "balancer"  # the balancer host's files, by path from its root
HAPROXY_CFG = f"{BALANCER}/etc/haproxy/haproxy.cfg"
ROUTER_EGRESS = f"{BALANCER}/etc/llm-appliance/rendered/router/egress.nft"
PROMETHEUS = "prometheus"
HOST_RULES = "etc/llm-appliance/rendered/prometheus/llm-appliance.rules.yml"
JOBS = {"health": "llm-appliance-health", "server": "llm-appliance-llama-server", "balancer": "llm-appliance-haproxy"}


@dataclass(frozen=True)
class FleetHost:
    spec: HostSpec
    appliance: Appliance

    @property
    def name(self) -> str:
        return self.spec.host.name


def hosts(fleet: LoadedFleet, facts: MachineFacts | None = None) -> tuple[list[FleetHost], list[Problem]]:
    """Every host's spec derived, validated (with this machine's facts) and resolved, and the warnings; SpecInvalid
    with every host's problems, located where they were written, otherwise."""
    found: list[Problem] = []
    done: list[FleetHost] = []
    for host in fleet.fleet.hosts:
        try:
            derived = derive(fleet, host)
            validated = validate_loaded(derived.loaded, facts)
        except SpecInvalid as exc:
            found += _relocated(exc, fleet, host)
            continue
        found += [derived.locate(p) for p in validated.warnings]
        done.append(FleetHost(derived, resolve(validated.plan, installed_spec_path(derived.source))))
    found += [fleet.locate(p) for p in _endpoint_problems(done, fleet) + _alias_problems(done, fleet)]
    found += [fleet.locate(p) for p in _fallback_problems(done, fleet.fleet)]
    if any(p.severity is Severity.ERROR for p in found):
        raise SpecInvalid(found)
    return done, found


def _relocated(exc: SpecInvalid, fleet: LoadedFleet, host: Host) -> list[Problem]:
    # derive's problems are located already (in the fleet file or the host's spec); validate's are not yet.
    return [p if p.file == fleet.path else where_written(p, fleet, host, fleet.spec_of(host)) for p in exc.problems]


def _endpoint_problems(done: list[FleetHost], fleet: LoadedFleet) -> list[Problem]:
    """Two hosts on one address must not share a port: the balancer would send both hosts' share to one."""
    seen = Counter(endpoint.address for h in done for endpoint in (h.appliance.server, h.appliance.exporter))
    return [
        error(
            f"hosts.{fleet.index(h.spec.host)}.address",
            f"{endpoint.address} is used twice in the fleet",
            "give each host its own address, or its own server.port and prometheus.port (hosts.overrides)",
        )
        for h in done
        for endpoint in (h.appliance.server, h.appliance.exporter)
        if seen[endpoint.address] > 1
    ]


def _alias_problems(done: list[FleetHost], fleet: LoadedFleet) -> list[Problem]:
    """Behind one balancer every host should answer to one model name: a client asks for the name it listed."""
    names = Counter(h.appliance.alias for h in done)
    if len(names) < 2:
        return []
    common = names.most_common(1)[0][0]
    return [
        warning(
            f"hosts.{fleet.index(h.spec.host)}.overrides.server.alias",
            f"host {h.name} serves its model as {h.appliance.alias!r}, the others as {common!r}: a client of the "
            "balancer sees the name change from one request to the next",
            f'set server.alias = "{common}" for every host (fleet.overrides.server)',
        )
        for h in done
        if h.appliance.alias != common
    ]


def _fallback_problems(done: list[FleetHost], f: Fleet) -> list[Problem]:
    """The router on the balancer needs a port of its own there, one key file for every host (it sends the
    hosts' key through HAProxy), and no host that must keep its code on the machine."""
    if f.fallback is None:
        return []
    found: list[Problem] = []
    taken = {f.balancer.port: "balancer.port", f.balancer.stats_port: "balancer.stats_port"}
    if f.fallback.port in taken:
        found.append(
            error(
                "fallback.port",
                f"{f.fallback.port} is {taken[f.fallback.port]}: the router listens beside HAProxy on the balancer",
                "give the router a port of its own, e.g. port = 8100 (clients connect there)",
            )
        )
    private = [h.name for h in done if h.appliance.spec.network.private]
    if private:
        found.append(
            error(
                "fallback",
                f"host {', '.join(private)} is private (network.private = true): no request of its clients may "
                "go to an upstream",
                "remove [fallback] from the fleet file, or make no host private",
            )
        )
    if len({h.appliance.api_key_file for h in done}) > 1:
        found.append(
            error(
                "fallback",
                "the hosts ask keys from different server.api_key_file paths: the router sends one key to all",
                "set server.api_key_file once for every host (fleet.overrides.server)",
            )
        )
    return found


def fleet_router(f: Fleet, members: list[FleetHost]) -> Router | None:
    """The router on the balancer: HAProxy is its local side (its API, and the /ready of its stats frontend)."""
    if f.fallback is None:
        return None
    b = f.balancer
    first = members[0].appliance
    return router(
        f.fallback,
        Endpoint(b.address, f.fallback.port),
        first.alias,
        Endpoint(b.address, b.port),
        first.api_key_file,
        Endpoint(b.address, b.stats_port),
    )


def render_fleet(fleet: LoadedFleet, members: list[FleetHost]) -> dict[str, str]:
    """Every file of the fleet, by path relative to the output directory."""
    f = fleet.fleet
    header = (
        f"generated from {fleet.path.name} by llm-appliance {__version__}; edit the fleet file and run "
        "`llm-appliance fleet render`, not this file"
    )
    files: dict[str, str] = {}
    for member in members:
        tree = f"hosts/{member.name}"
        files.update({f"{tree}/{path}": text for path, text in render(member.appliance).items()})
        files[f"{tree}/{str(member.appliance.spec_file).lstrip('/')}"] = member.spec.text
        # Prometheus loads each host's rules from one directory; the host's tree keeps its own copy too.
        files[f"{PROMETHEUS}/rules/{member.name}.rules.yml"] = files[f"{tree}/{HOST_RULES}"]
    files[HAPROXY_CFG] = template("fleet/haproxy.cfg.j2").render(v=_haproxy(f, members, header))
    upstream_router = fleet_router(f, members)
    if upstream_router is not None:
        # Alone on the balancer: no server unit to follow, its own group for the key file, and its egress held
        # by a ruleset of its own (the unit cannot filter addresses one way only, and its clients are unknown).
        place = RouterPlace(header, beside_unit=None, key_group=None, ip_allow=())
        files.update({f"{BALANCER}/{path}": text for path, text in router_files(upstream_router, place).items()})
        files[ROUTER_EGRESS] = template("fleet/router-egress.nft.j2").render(v=_egress(f, upstream_router, header))
    files.update(_prometheus(fleet, members, header))
    return dict(sorted(files.items()))


@dataclass(frozen=True)
class BackendServer:
    name: str
    server: str  # address:port of llama-server
    check_port: int  # the exporter's, where /ready is
    maxconn: int  # the host's slots: more would wait inside llama-server, where no other host can take them


@dataclass(frozen=True)
class ClientError:
    """One of HAProxy's own error answers, in OpenAI's error shape (what SDKs, IDEs and routers parse)."""

    status: int
    body: str  # JSON, inside single quotes in the config: holds no single quote
    retry_after: int


def client_errors(check_interval_seconds: int) -> tuple[ClientError, ...]:
    def error(status: int, kind: str, message: str) -> ClientError:
        body = json.dumps({"error": {"message": message, "type": kind, "code": status}}, separators=(",", ":"))
        assert "'" not in body
        return ClientError(status, body, check_interval_seconds)

    return (
        error(502, "server_error", "an appliance failed while answering; send the request again"),
        error(503, "unavailable_error", "no appliance of this fleet can take the request now; retry or fall back"),
        error(504, "timeout_error", "the appliance did not answer in time"),
    )


@dataclass(frozen=True)
class HaproxyView:
    header: str
    haproxy_version: str
    maxconn: int
    connect_timeout: str
    server_timeout: str
    queue_timeout: str
    api_bind: str
    stats_bind: str
    retries: int
    check_interval: str
    check_interval_seconds: int
    fall: int
    rise: int
    hosts: tuple[BackendServer, ...]
    errors: tuple[ClientError, ...]
    # The balancer's own /ready (on the stats port): "saturated" past this many requests queued for a slot.
    max_queued: int


def _haproxy(f: Fleet, members: list[FleetHost], header: str) -> HaproxyView:
    b = f.balancer
    servers = tuple(
        BackendServer(m.name, m.appliance.server.address, m.appliance.exporter.port, m.appliance.spec.server.parallel)
        for m in members
    )
    binds = (host_port(b.address, b.port), host_port(b.address, b.stats_port))
    max_queued = max(m.appliance.spec.health.ready_max_queued for m in members)
    return haproxy_view(b, header, sum(s.maxconn for s in servers), binds, max_queued, servers)


def haproxy_view(
    b: Balancer,
    header: str,
    slots: int,
    binds: tuple[str, str],
    max_queued: int,
    hosts: tuple[BackendServer, ...] = (),
) -> HaproxyView:
    """haproxy.cfg's values for a balancer in front of `slots` slots in all, listening on `binds` (the API's,
    the stats'), saying "saturated" on its /ready past `max_queued` requests queued; `hosts` are its servers
    when it names them one by one."""
    return HaproxyView(
        header=header,
        haproxy_version="2.6",
        maxconn=max(1024, 4 * slots),
        connect_timeout=f"{b.connect_timeout_seconds}s",
        server_timeout=f"{b.server_timeout_seconds}s",
        queue_timeout=f"{b.queue_timeout_seconds}s",
        api_bind=binds[0],
        stats_bind=binds[1],
        retries=b.retries,
        check_interval=f"{b.check_interval_seconds}s",
        check_interval_seconds=b.check_interval_seconds,
        fall=b.fall,
        rise=b.rise,
        hosts=hosts,
        errors=client_errors(b.check_interval_seconds),
        max_queued=max_queued,
    )


@dataclass(frozen=True)
class EgressView:
    header: str
    table: str
    user: str
    local_ports: str  # HAProxy's API and stats ports, on this machine
    upstream: Endpoint
    upstream_is_address: bool  # a name cannot be pinned: its addresses are the resolver's to say


def _egress(f: Fleet, upstream_router: Router, header: str) -> EgressView:
    upstream = upstream_router.upstream
    return EgressView(
        header=header,
        table=f"{paths.NFT_TABLE}_router",
        user=paths.ROUTER_USER,
        local_ports=f"{f.balancer.port}, {f.balancer.stats_port}",
        upstream=upstream,
        upstream_is_address=ip_address(upstream.host) is not None,
    )


def _prometheus(fleet: LoadedFleet, members: list[FleetHost], header: str) -> dict[str, str]:
    f = fleet.fleet
    files_dir = f.prometheus.files_dir

    def targets(entries: list[tuple[str, str]]) -> str:
        groups = [
            {"targets": [address], "labels": {"appliance": f.fleet.name, "host": host}} for host, address in entries
        ]
        return json.dumps(groups, indent=2) + "\n"

    found = {
        "health": targets([(m.name, m.appliance.exporter.address) for m in members]),
        "server": targets([(m.name, m.appliance.server.address) for m in members]),
        "balancer": targets([("balancer", host_port(f.balancer.address, f.balancer.stats_port))]),
    }
    files = {f"{PROMETHEUS}/targets/{JOBS[job]}.json": text for job, text in found.items()}
    keys = {m.appliance.scrape_key_file for m in members}
    key = next(iter(keys)) if len(keys) == 1 else None
    interval = min(m.appliance.spec.prometheus.scrape_interval_seconds for m in members)
    scrape = {
        "header": header,
        "files_dir": str(files_dir),
        "scrape_interval": f"{interval}s",
        "scrape_key_file": quoted(str(key)) if key else None,
        "targets": {job: quoted(str(files_dir / f"{JOBS[job]}.json")) for job in JOBS},
    }
    files[f"{PROMETHEUS}/scrape.yml"] = template("fleet/scrape.yml.j2").render(v=scrape)
    idle = max(m.appliance.spec.restart.idle_timeout_seconds for m in members)
    balancer = host_port(f.balancer.address, f.balancer.stats_port)
    files[f"{PROMETHEUS}/rules/fleet.rules.yml"] = fleet_rules(f, len(members), idle, balancer, header)
    return files


def fleet_rules(f: Fleet, hosts: int, idle_timeout_seconds: int, balancer: str, header: str) -> str:
    """The fleet's own alerts (min_ready, a stuck drain, fleet-wide decay, the balancer's silence) over `hosts`
    appliances whose longest wait for idle is `idle_timeout_seconds`; `balancer` says where HAProxy's stats are."""
    drain = f.balancer.check_interval_seconds * f.balancer.fall
    name = quoted(f.fleet.name)
    rules = {
        "header": header,
        "name": f.fleet.name,
        "appliance": name,
        "hosts": hosts,
        "min_ready": f.rules.min_ready,
        "below_min_ready_for": duration(f.rules.below_min_ready_alert_seconds),
        # Draining lasts the balancer's drain and the longest wait for idle; past both (and a margin), it is stuck.
        "draining_for": duration(drain + idle_timeout_seconds + 300),
        "balancer": balancer,
        "metric_names": {"version_info": metric.VERSION_INFO},
        "selectors": {
            "ready": f"{metric.READY}{{appliance={name}}}",
            "draining": f"{metric.DRAINING}{{appliance={name}}}",
            "fleet_decay": f"{metric.FLEET_DECAY}{{appliance={name}}}",
            "balancer_scraped": f'up{{job="{JOBS["balancer"]}", appliance={name}}}',
        },
    }
    return template("fleet/fleet.rules.yml.j2").render(v=rules)
