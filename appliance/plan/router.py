"""The router in front of the local side ([fallback]): where clients connect, the two backends, and when the
second one answers. One value for both places a router runs: beside one appliance (its llama-server and
health daemon are the local side) and on a fleet's balancer (HAProxy is). Rendered beside the router's config
as router.json, which `llm-appliance router` runs from.
"""

from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import ConfigDict, TypeAdapter, ValidationError

from appliance.plan.endpoint import Endpoint
from appliance.spec.fallback import Fallback
from appliance.spec.model import Spec

# Why /ready answers 503 (the health exporter's), each a state in which the local server cannot or should not
# take a request now: "loading" until the daemon's first check saw the server, "warming" before its warm-up
# completion, "degraded" serving slower than it should until the restart it waits for (decay latched, on the CPU
# where the spec says GPU), "saturated" every slot busy and requests queued. A fleet's balancer says "down" (no
# host ready) and "saturated" (requests queued for a slot) on its own /ready.
ReadyReason = Literal["loading", "warming", "down", "draining", "restarting", "degraded", "saturated"]
NOT_SERVING: tuple[ReadyReason, ...] = ("loading", "warming", "down", "draining", "restarting", "degraded")
NOT_READY: tuple[ReadyReason, ...] = (*NOT_SERVING, "saturated")
# The reasons that send a request to the upstream, by `fallback.when`.
FALLBACK_REASONS = {"down": NOT_SERVING, "busy": ("saturated",), "both": NOT_READY}
ROUTER_FILE = "router.json"  # beside the router's config.yaml


class RouterFileError(Exception):
    """router.json is missing or not this version's; the message says what to run."""


@dataclass(frozen=True)
class Router:
    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(extra="forbid")

    endpoint: Endpoint  # where clients connect
    alias: str  # the model name clients send, for both backends
    local_url: str  # the local side's OpenAI API: llama-server's, or the fleet's HAProxy
    local_key_file: Path | None  # server.api_key_file: the key the local side asks, and the one clients send
    ready_url: str  # the local side's /ready, which the router's gate asks before each request
    fallback_reasons: tuple[str, ...]  # /ready's reasons that send a request to the upstream
    upstream: Endpoint  # the upstream's host and port, the one place the router may dial out to
    upstream_url: str
    upstream_tls: bool
    model: str  # the upstream's model name; clients send the local alias to both
    upstream_key_file: Path | None
    timeout_seconds: int
    cooldown_seconds: int

    def to_json(self, header: str) -> str:
        document = {"generated": header, **_router_file().dump_python(self, mode="json")}
        return json.dumps(document, indent=2, sort_keys=True) + "\n"

    @classmethod
    def read(cls, path: Path) -> Router:
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc).splitlines()[0]
            raise RouterFileError(
                f"cannot read {path}: {reason}; apply the spec (or the fleet's files) again"
            ) from None
        if isinstance(document, dict):
            document.pop("generated", None)
        try:
            return _router_file().validate_python(document, strict=False)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise RouterFileError(f"{path}: {where}: {first['msg']}; apply the spec again") from None


@cache
def _router_file() -> TypeAdapter[Router]:
    return TypeAdapter(Router)


def router(
    fallback: Fallback, endpoint: Endpoint, alias: str, local: Endpoint, local_key_file: Path | None, ready: Endpoint
) -> Router:
    """The router for `fallback`, listening at `endpoint`, with the local side's API at `local` and its /ready
    at `ready`."""
    upstream = urllib.parse.urlsplit(fallback.base_url)
    tls = upstream.scheme == "https"
    return Router(
        endpoint=endpoint,
        alias=alias,
        local_url=f"{local.url}/v1",
        local_key_file=local_key_file,
        ready_url=f"{ready.url}/ready",
        fallback_reasons=FALLBACK_REASONS[fallback.when],
        upstream=Endpoint(upstream.hostname or "", upstream.port or (443 if tls else 80)),
        upstream_url=fallback.base_url,
        upstream_tls=tls,
        model=fallback.model,
        upstream_key_file=fallback.api_key_file,
        timeout_seconds=fallback.timeout_seconds,
        cooldown_seconds=fallback.cooldown_seconds,
    )


def router_of(spec: Spec, alias: str) -> Router | None:
    """One appliance's router: on server.host at fallback.port, in front of its llama-server and daemon."""
    if spec.fallback is None:
        return None
    return router(
        spec.fallback,
        Endpoint(spec.server.host, spec.fallback.port),
        alias,
        Endpoint(spec.server.host, spec.server.port),
        spec.server.api_key_file,
        Endpoint(spec.prometheus.host, spec.prometheus.port),
    )
