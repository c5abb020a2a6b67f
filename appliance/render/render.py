"""Render the resolved appliance into its files: a pure function from Appliance to {path: text}.

Templates see only the view built here, every value ready to print, so they stay loops and conditionals:
no arithmetic, no string surgery, no lists built in a template.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance import __version__
from appliance.plan.endpoint import Endpoint
from appliance.plan.priority import PRIORITIES, Priority
from appliance.plan.resolved import SNAPSHOT, Appliance
from appliance.plan.start_limit import SERVER_START_LIMIT, StartLimit
from appliance.render.dashboard import dashboard_json
from appliance.render.promql import label_matchers, quoted, series
from appliance.render.router_files import RouterPlace, RouterView, router_files, router_view
from appliance.render.templates import template
from appliance.spec.address import ip_address
from appliance.system import metric_names as metric
from appliance.system import paths


@dataclass(frozen=True)
class View:
    header: str
    spec_file: str
    cli: str
    rendered_dir: str
    snapshot: str
    state_dir: str
    state_directory: str  # StateDirectory=: systemd gives the service user this innermost directory only
    user: str
    nft_table: str
    server: Endpoint
    exporter: Endpoint
    scrape_key_file: str | None
    scrape_key_file_yaml: str  # a YAML double-quoted string
    scrape_key_file_text: str  # inside an alert's description: YAML-escaped, and no Go template action
    spec_file_text: str
    on_gpu_devices: bool  # the server uses a GPU: device nodes open, NVML read, GPU alerts
    server_device_nodes: tuple[str, ...]
    health_device_nodes: tuple[str, ...]
    mlock: bool
    server_binds: tuple[str, ...]  # BindReadOnlyPaths= of each unit, quoted (sandbox.py refused the rest)
    health_binds: tuple[str, ...]
    restart_binds: tuple[str, ...]
    memory_high_mib: int | None  # MemoryHigh= of the server unit: the host budget's usable RAM
    priority: Priority  # Nice=, CPUWeight=, IOWeight= of the server unit (server.priority)
    priority_name: str
    allow_v4: str  # nftables set elements, comma-separated
    allow_v6: str
    server_allow: tuple[str, ...]  # IPAddressAllow= of the server unit, besides localhost
    health_allow: tuple[str, ...]  # ...of the health unit
    peers: tuple[Endpoint, ...]  # each fleet peer's exporter, which the health daemon dials for /ready
    egress_deny: bool  # also: the server unit filters IP addresses (systemd's filter holds both directions)
    schedule: str
    randomized_delay_seconds: int
    watchdog_seconds: int
    health_watchdog_seconds: int
    start_limit: StartLimit  # the server unit's Restart= budget, which `up` keeps too
    restart_unit: str
    server_unit: str
    health_unit: str
    snapshot_json: str
    dashboard_json: str  # Grafana's dashboard model, built as data (dashboard.py)
    scrape_interval: str
    labels: tuple[tuple[str, str], ...]  # the spec's labels, each value quoted (valid in YAML and in PromQL)
    rule_labels: tuple[tuple[str, str], ...]  # ...in an alerting rule, where Prometheus expands templates
    selectors: dict[str, str]  # each series the alerts read, with the spec's labels as matchers
    metric_names: dict[str, str]  # the metrics the alerts' descriptions name, bare
    decay_ratio: float
    creep_ratio: float
    engine_floor: float  # below this ratio the engine regressed: 1 - health.engine_regression
    min_free_bytes: int
    min_free_mib: int
    acceptance_min: float
    speculation_min_speedup: float
    contention_max_share: float
    draft_in_use: bool  # a draft model is in use
    speculation: bool  # llama-server speculates (a draft, or n-gram types): the speculation alerts apply
    max_per_hour: int
    alert_for: dict[str, str]  # alert (AlertForSeconds field) -> its `for:` as a Prometheus duration
    router: RouterView | None  # [fallback]: the firewall's egress rule for the router's user
    api_ports: str  # what clients reach, an nftables set's elements: the server, the exporter, the router


def view(appliance: Appliance) -> View:
    spec = appliance.spec
    header = f"generated from {appliance.spec_file} by llm-appliance {__version__}; edit the spec and run `llm-appliance apply`, not this file"
    labels = sorted(spec.prometheus.labels.items())
    return View(
        header=header,
        spec_file=str(appliance.spec_file),
        cli=str(paths.CLI),
        rendered_dir=str(paths.RENDERED),
        snapshot=str(SNAPSHOT),
        state_dir=str(paths.STATE),
        state_directory=str(paths.STATE.relative_to("/var/lib")),
        user=paths.SERVICE_USER,
        nft_table=paths.NFT_TABLE,
        server=appliance.server,
        exporter=appliance.exporter,
        scrape_key_file=str(appliance.scrape_key_file) if appliance.scrape_key_file else None,
        scrape_key_file_yaml=quoted(str(appliance.scrape_key_file or "")),
        scrape_key_file_text=_in_template(str(appliance.scrape_key_file or "")),
        spec_file_text=_in_template(str(appliance.spec_file)),
        on_gpu_devices=bool(appliance.server_devices),
        server_device_nodes=appliance.server_device_nodes,
        health_device_nodes=appliance.health_device_nodes,
        mlock=appliance.mlock,
        server_binds=tuple(f'"{path}"' for path in appliance.server_binds),
        health_binds=tuple(f'"{path}"' for path in appliance.health_binds),
        restart_binds=tuple(f'"{path}"' for path in appliance.restart_binds),
        memory_high_mib=appliance.memory_high_mib,
        priority=PRIORITIES[spec.server.priority],
        priority_name=spec.server.priority,
        allow_v4=", ".join(appliance.allow_v4),
        allow_v6=", ".join(appliance.allow_v6),
        server_allow=appliance.server_ip_allow,
        health_allow=appliance.health_ip_allow,
        # Addresses alone reach the ruleset: validate refuses a name unless turns = "eviction" (Kubernetes,
        # where no ruleset loads), and nft would resolve one once, at load, and never again.
        peers=tuple(peer for peer in appliance.peers if ip_address(peer.host) is not None),
        egress_deny=appliance.egress_deny,
        schedule=spec.restart.schedule,
        randomized_delay_seconds=spec.restart.randomized_delay_seconds,
        watchdog_seconds=spec.health.watchdog_seconds,
        health_watchdog_seconds=appliance.health_watchdog_seconds,
        start_limit=SERVER_START_LIMIT,
        restart_unit=paths.RESTART_UNIT,
        server_unit=paths.SERVER_UNIT,
        health_unit=paths.HEALTH_UNIT,
        snapshot_json=appliance.to_json(header),
        dashboard_json=dashboard_json(appliance, header),
        scrape_interval=f"{spec.prometheus.scrape_interval_seconds}s",
        labels=tuple((name, quoted(value)) for name, value in labels),
        rule_labels=tuple((name, f'"{_in_template(value)}"') for name, value in labels),
        selectors=selectors(appliance, label_matchers(spec.prometheus.labels)),
        metric_names={"version_info": metric.VERSION_INFO, "restarts": metric.RESTARTS_TOTAL},
        decay_ratio=spec.health.decay_ratio,
        creep_ratio=spec.health.creep_ratio,
        engine_floor=round(1 - spec.health.engine_regression, 6),
        min_free_bytes=appliance.min_free_bytes,
        min_free_mib=spec.health.min_free_mib,
        acceptance_min=spec.health.acceptance_min,
        speculation_min_speedup=spec.health.speculation_min_speedup,
        contention_max_share=spec.health.contention_max_share,
        draft_in_use=appliance.draft_in_use,
        speculation=appliance.speculation,
        max_per_hour=spec.restart.max_per_hour,
        alert_for={name: duration(s) for name, s in spec.prometheus.alert_for_seconds.model_dump().items()},
        router=router_view(appliance.router),
        api_ports=", ".join(
            str(endpoint.port)
            for endpoint in (
                appliance.server,
                appliance.exporter,
                *([appliance.router.endpoint] if appliance.router else []),
            )
        ),
    )


def selectors(appliance: Appliance, labels: tuple[str, ...]) -> dict[str, str]:
    """Each series the alerts read, with the spec's labels as matchers."""

    def of(metric: str, *matchers: str) -> str:
        return series(metric, labels, *matchers)

    devices = "|".join(appliance.server_devices)
    return {
        "server_up": of(metric.SERVER_UP),
        "server_scraped": of("up", 'job="llm-appliance-llama-server"'),
        "health_scraped": of("up", 'job="llm-appliance-health"'),
        "decode_tps": of(metric.DECODE_TOKENS_PER_SECOND),
        "decode_baseline": of(metric.DECODE_BASELINE_TOKENS_PER_SECOND),
        "vram_creep": of(metric.SERVER_VRAM_CREEP_RATIO),
        "gpu_free": of(metric.GPU_MEMORY_FREE_BYTES, f'device=~"{devices}"'),
        "speculation_engaged": of(metric.SPECULATION_ENGAGED),
        "speculation_configured": of(metric.SPECULATION_CONFIGURED),
        "acceptance": of(metric.SPECULATION_ACCEPTANCE_RATIO),
        "drafted": of(metric.SPECULATION_DRAFTED_TOKENS_TOTAL),
        "speculation_speedup": of(metric.SPECULATION_SPEEDUP),
        "contended": of(metric.CONTENDED),
        "version_mismatch": of(metric.VERSION_MISMATCH),
        "version_drift": of(metric.VERSION_DRIFT),
        "engine_regression": of(metric.ENGINE_REGRESSION),
        "restart_budget_exhausted": of(metric.RESTART_BUDGET_EXHAUSTED),
        "unplanned_restarts": of(metric.RESTARTS_TOTAL, 'reason!~"scheduled|manual"'),
    }


def _in_template(text: str) -> str:
    """Text inside a double-quoted YAML string that Prometheus expands as a Go template (an alert's labels and
    annotations): YAML-escaped, and each "{{" printed by an action of its own rather than opening one."""
    return quoted(text.replace("{{", '{{ "{{" }}'))[1:-1]


def duration(seconds: int) -> str:
    """Seconds as a Prometheus duration: 900 -> 15m, 90 -> 1m30s, 0 -> 0s."""
    parts = [(seconds // 86400, "d"), (seconds % 86400 // 3600, "h"), (seconds % 3600 // 60, "m"), (seconds % 60, "s")]
    return "".join(f"{n}{unit}" for n, unit in parts if n) or "0s"


# Rendered file (relative to the root) -> its template.
FILES = {
    f"etc/systemd/system/{paths.SERVER_UNIT}": "server.service.j2",
    f"etc/systemd/system/{paths.HEALTH_UNIT}": "health.service.j2",
    f"etc/systemd/system/{paths.RESTART_UNIT}": "restart.service.j2",
    f"etc/systemd/system/{paths.RESTART_TIMER}": "restart.timer.j2",
    str(paths.RULESET.relative_to("/")): "firewall.nft.j2",
    str(SNAPSHOT.relative_to("/")): "appliance.json.j2",
    "etc/llm-appliance/rendered/prometheus/llm-appliance.rules.yml": "alerts.rules.yml.j2",
    "etc/llm-appliance/rendered/prometheus/scrape.yml": "scrape.yml.j2",
    "etc/llm-appliance/rendered/grafana/llm-appliance.json": "grafana.json.j2",
    "etc/polkit-1/rules.d/50-llm-appliance.rules": "polkit.rules.j2",
}
# Files earlier versions rendered and this one does not: uninstall removes them too.
RETIRED = ("etc/llm-appliance/rendered/launch.json", "etc/llm-appliance/rendered/health.json")


def render(appliance: Appliance) -> dict[str, str]:
    """Every file of the appliance, by path relative to the root; the same appliance gives the same bytes."""
    context = view(appliance)
    files = {path: template(name).render(v=context) for path, name in FILES.items()}
    if appliance.router is not None:
        # Beside the server, in the service user's group (to read server.api_key_file, root:llm-appliance 0640).
        # systemd's address filter holds both directions: with egress = "allow" the unit has none.
        ip_allow = appliance.router_ip_allow if appliance.egress_deny else ()
        beside = RouterPlace(context.header, paths.SERVER_UNIT, paths.SERVICE_USER, ip_allow)
        files |= router_files(appliance.router, beside)
    return dict(sorted(files.items()))
