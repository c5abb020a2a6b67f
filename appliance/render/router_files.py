"""The router's files ([fallback]): LiteLLM's config, the /ready gate and the clients' door it loads, router.json (what
`llm-appliance router` runs from) and the router's unit. Rendered beside one appliance (render.py) and on a
fleet's balancer (fleet_render.py): the same files, in a different place.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.plan.endpoint import Endpoint
from appliance.plan.router import ROUTER_FILE, Router
from appliance.render.promql import quoted
from appliance.render.templates import template
from appliance.system import paths

CONFIG_DIR = str(paths.ROUTER_DIR.relative_to("/"))
# Rendered file (relative to the root) -> its template.
ROUTER_FILES = {
    f"etc/systemd/system/{paths.ROUTER_UNIT}": "router.service.j2",
    f"{CONFIG_DIR}/config.yaml": "router.yaml.j2",
    f"{CONFIG_DIR}/ready_gate.py": "ready_gate.py.j2",
    f"{CONFIG_DIR}/client_auth.py": "client_auth.py.j2",
    f"{CONFIG_DIR}/{ROUTER_FILE}": "router.json.j2",
}


@dataclass(frozen=True)
class RouterPlace:
    """Where the router runs, for its unit: beside an appliance's server, or alone on a fleet's balancer."""

    header: str
    beside_unit: str | None  # the local server's unit on this machine: started after it (none on a balancer)
    key_group: str | None  # a group that reads server.api_key_file (the service user's, beside an appliance)
    # The unit's IPAddressAllow= besides localhost, with IPAddressDeny=any; empty: no address filter in the
    # unit (on a balancer, whose clients it does not know, the egress ruleset holds what the router dials).
    ip_allow: tuple[str, ...]


@dataclass(frozen=True)
class RouterView:
    """What the router's templates print (YAML values quoted)."""

    header: str
    cli: str
    config_dir: str
    user: str
    unit: str
    beside_unit: str | None
    key_group: str | None
    ip_allow: tuple[str, ...]
    endpoint: Endpoint
    upstream: Endpoint
    upstream_url: str  # as written, for the unit's description
    alias: str  # YAML-quoted from here on
    local_model: str
    local_url: str
    upstream_model: str
    upstream_url_yaml: str
    timeout_seconds: int
    cooldown_seconds: int
    reasons_text: str
    router_json: str


def router_view(router: Router | None, place: RouterPlace | None = None) -> RouterView | None:
    if router is None:
        return None
    place = place or RouterPlace("", None, None, ())
    return RouterView(
        header=place.header,
        cli=str(paths.CLI),
        config_dir=str(paths.ROUTER_DIR),
        user=paths.ROUTER_USER,
        unit=paths.ROUTER_UNIT,
        beside_unit=place.beside_unit,
        key_group=place.key_group,
        ip_allow=place.ip_allow,
        endpoint=router.endpoint,
        upstream=router.upstream,
        upstream_url=router.upstream_url,
        alias=quoted(router.alias),
        # LiteLLM's "openai/" provider: any OpenAI-compatible API at api_base, the model named as the rest.
        local_model=quoted(f"openai/{router.alias}"),
        local_url=quoted(router.local_url),
        upstream_model=quoted(f"openai/{router.model}"),
        upstream_url_yaml=quoted(router.upstream_url),
        timeout_seconds=router.timeout_seconds,
        cooldown_seconds=router.cooldown_seconds,
        reasons_text=", ".join(router.fallback_reasons),
        router_json=router.to_json(place.header),
    )


def router_files(router: Router, place: RouterPlace) -> dict[str, str]:
    """The router's files, by path relative to the root of the machine it runs on."""
    context = router_view(router, place)
    return {path: template(name).render(v=context) for path, name in ROUTER_FILES.items()}
