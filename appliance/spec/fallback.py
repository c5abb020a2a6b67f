"""[fallback]: the OpenAI-compatible upstream a router sends to when the local server cannot serve."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from appliance.spec.address import http_url
from appliance.spec.base import FilePath, Line, Strict


def _http_url(value: str) -> str:
    # Its host goes into the router's egress rule and its text into the router unit's description and config:
    # an address or a DNS name, a path of plain characters, and nothing a ruleset, a unit or YAML reads as syntax.
    if http_url(value) is None:
        raise ValueError(
            f"{value!r} is not an http(s) URL of an OpenAI-compatible API; write e.g. https://api.example.com/v1: "
            "the host an IP address or a DNS name, the path letters, digits and -._~/, no user, query or fragment"
        )
    return value.rstrip("/")


class Fallback(Strict):
    """An OpenAI-compatible upstream that answers when the local server cannot: a router (LiteLLM's proxy, its
    own unit) listens on server.host:port for the clients, sends each request to llama-server first, and to
    the upstream when /ready says the local side is down, busy, or either (`when`)."""

    base_url: Annotated[Line, AfterValidator(_http_url)]  # e.g. "https://api.example.com/v1"
    model: Annotated[Line, Field(min_length=1)]  # the upstream's name of its model
    api_key_file: FilePath | None = None  # the upstream's key, one line; read by the router's user only
    when: Literal["down", "busy", "both"] = "both"
    port: Annotated[int, Field(ge=1, le=65535)] = 8000  # where clients connect: the router
    timeout_seconds: Annotated[int, Field(ge=1, le=86400)] = 600  # one request, either side
    # After local fails a request, the router sends straight to the upstream this long before it tries again.
    cooldown_seconds: Annotated[int, Field(ge=1, le=3600)] = 30
    # What the upstream charges, for the cost report beside the local cost (in cost.currency).
    price_per_million_input_tokens: Annotated[float, Field(ge=0.0, le=1e6)] | None = None
    price_per_million_output_tokens: Annotated[float, Field(ge=0.0, le=1e6)] | None = None
