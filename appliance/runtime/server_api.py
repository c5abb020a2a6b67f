"""A small client for llama-server's own endpoints, shared by the launcher, the health daemon and bench."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from appliance.facts.keys import read_keys


class ServerUnreachable(Exception):
    """No usable answer: refused, timed out, or not the expected shape."""


def read_api_key(path: Path | None) -> str | None:
    """The first key of an --api-key-file, as llama-server reads it."""
    if path is None:
        return None
    keys = read_keys(path)
    return keys[0] if keys else None


@dataclass(frozen=True)
class ServerApi:
    base_url: str
    api_key: str | None = None
    timeout: float = 5.0

    def _request(
        self, path: str, body: dict[str, Any] | None = None, timeout: float | None = None
    ) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base_url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                return int(response.status), response.read()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read()
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            raise ServerUnreachable(f"{self.base_url}{path}: {getattr(exc, 'reason', exc)}") from None

    def call(self, path: str, body: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        """Any JSON endpoint (GET without a body, POST with one); raises ServerUnreachable unless 200."""
        status, answer = self._request(path, body, timeout)
        if status != 200:
            raise ServerUnreachable(f"{self.base_url}{path} answered {status}: {answer[:300]!r}")
        return self._json(answer, path)

    def health(self) -> int:
        """HTTP status of /health: 200 ready, 503 loading; raises ServerUnreachable when nothing answers."""
        return self._request("/health")[0]

    def metrics(self) -> dict[str, float]:
        """llama-server's /metrics, each family summed over its labels (name without `llamacpp:`)."""
        status, body = self._request("/metrics")
        if status != 200:
            raise ServerUnreachable(
                f"{self.base_url}/metrics answered {status} (is --metrics set, is the API key right?)"
            )
        try:
            families = list(text_string_to_metric_families(body.decode()))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ServerUnreachable(f"{self.base_url}/metrics is not Prometheus text: {exc}") from None
        values: dict[str, float] = {}
        for family in families:
            for sample in family.samples:
                name = sample.name.removeprefix("llamacpp:")
                values[name] = values.get(name, 0.0) + float(sample.value)
        return values

    def slots(self) -> list[dict[str, Any]]:
        status, body = self._request("/slots")
        if status != 200:
            raise ServerUnreachable(f"{self.base_url}/slots answered {status}")
        return self._json(body, "/slots")  # type: ignore[no-any-return]

    def completion(self, prompt: str, n_predict: int, timeout: float = 600.0, **params: Any) -> dict[str, Any]:
        status, body = self._request("/completion", {"prompt": prompt, "n_predict": n_predict, **params}, timeout)
        if status != 200:
            raise ServerUnreachable(f"{self.base_url}/completion answered {status}: {body[:200]!r}")
        return self._json(body, "/completion")  # type: ignore[no-any-return]

    def chat(
        self, messages: list[dict[str, str]], max_tokens: int, timeout: float = 600.0, **params: Any
    ) -> dict[str, Any]:
        body = {"messages": messages, "max_tokens": max_tokens, **params}
        status, answer = self._request("/v1/chat/completions", body, timeout)
        if status != 200:
            raise ServerUnreachable(f"{self.base_url}/v1/chat/completions answered {status}: {answer[:200]!r}")
        return self._json(answer, "/v1/chat/completions")  # type: ignore[no-any-return]

    def _json(self, body: bytes, path: str) -> Any:
        try:
            return json.loads(body)
        except ValueError:
            raise ServerUnreachable(f"{self.base_url}{path} did not answer JSON") from None
