# generated from /etc/llm-appliance/demo-fallback.toml by llm-appliance 0.1.0; edit the spec and run `llm-appliance apply`, not this file
"""The router's gate, loaded by LiteLLM's proxy from beside its config: before a backend is picked for a request,
ask the health daemon's /ready (at most every half second). While it says a reason the spec's fallback.when
names, the local server is left out, and the request goes to the upstream before its first byte: a drain, a
restart, a full queue or a decaying server is told to the router before a client waits on it.

`llm-appliance router` sets LLM_APPLIANCE_READY_URL and LLM_APPLIANCE_FALLBACK_REASONS from router.json."""

import asyncio
import os
import time
import urllib.error
import urllib.request

from litellm.integrations.custom_logger import CustomLogger

READY_URL = os.environ["LLM_APPLIANCE_READY_URL"]
FALLBACK_REASONS = frozenset(os.environ["LLM_APPLIANCE_FALLBACK_REASONS"].split(","))
LOCAL = "local"  # the model_info id of the local deployment in config.yaml
TTL_SECONDS = 0.5
TIMEOUT_SECONDS = 0.5


def not_ready_reason() -> str | None:
    """/ready's reason, None when ready; a daemon that does not answer watches nothing: "down"."""
    try:
        with urllib.request.urlopen(READY_URL, timeout=TIMEOUT_SECONDS):
            return None
    except urllib.error.HTTPError as exc:
        return exc.read(200).decode(errors="replace").strip().removeprefix("not ready: ")
    except OSError:
        return "down"


class ReadyGate(CustomLogger):
    def __init__(self) -> None:
        super().__init__()
        self.asked_at = float("-inf")
        self.reason: str | None = None

    async def async_filter_deployments(
        self, model, healthy_deployments, messages, request_kwargs=None, parent_otel_span=None
    ):
        if time.monotonic() - self.asked_at >= TTL_SECONDS:
            self.reason = await asyncio.to_thread(not_ready_reason)
            self.asked_at = time.monotonic()
        if self.reason not in FALLBACK_REASONS:
            return healthy_deployments
        return [d for d in healthy_deployments if (d.get("model_info") or {}).get("id") != LOCAL]


gate = ReadyGate()
