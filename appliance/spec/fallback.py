"""[fallback]: the OpenAI-compatible upstream a router sends to when the local server cannot serve."""

from __future__ import annotations

import urllib.parse
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from appliance.spec.base import FilePath, Line, Strict


def _http_url(value: str) -> str:
    parsed = urllib.parse.urlsplit(value)
    try:
        port = parsed.port
    except ValueError:
        port = -1
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port == -1 or parsed.query or parsed.fragment:
        raise ValueError(
            f"{value!r} is not an http(s) URL of an OpenAI-compatible API; write e.g. https://api.example.com/v1"
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
