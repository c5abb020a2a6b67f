"""The one client of llama-server's HTTP API (its own endpoints and the OpenAI ones, streamed or not), used by
the launcher, the health daemon, status, bench and the tests."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from appliance.facts.keys import read_keys
from appliance.facts.listeners import listening_uids


class ServerUnreachable(Exception):
    """No usable answer: refused, timed out, or not the expected shape."""


def read_api_key(path: Path | None) -> str | None:
    """The first key of an --api-key-file, as llama-server reads it."""
    if path is None:
        return None
    keys = read_keys(path)
    return keys[0] if keys else None


@dataclass
class Streamed:
    """What came back of one streamed request (server-sent events), however it ended. `status` is None when no
    response began; `done` when `data: [DONE]` closed it; `error` says what broke it (an error event, a
    status other than 200, the connection lost after `chunks` chunks)."""

    status: int | None = None
    chunks: int = 0
    done: bool = False
    finished: bool = False  # a chunk carried a finish_reason (the answer ended, not the connection)
    first_content_seconds: float | None = None
    final: dict[str, Any] | None = None  # the chunk carrying llama-server's `timings`
    parts: list[str] = field(default_factory=list)
    served_by: str | None = None  # a balancer's or router's header naming the backend that answered
    model: str | None = None  # the model the answer names (its first chunk's)
    error: str = ""

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def complete(self) -> bool:
        return self.status == 200 and self.finished and not self.error


LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ServerApi:
    base_url: str
    api_key: str | None = None
    timeout: float = 5.0
    # Who must own the server's listening socket before the key is sent to a local port (the launcher and the
    # daemon run as the server's user): another user's listener on a port left free by a restart gets nothing.
    listener_uid: int | None = None

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            self._check_listener()
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _check_listener(self) -> None:
        url = urllib.parse.urlsplit(self.base_url)
        if self.listener_uid is None or url.hostname not in LOOPBACK or url.port is None:
            return
        strangers = listening_uids(url.port) - {self.listener_uid}
        if strangers:
            raise ServerUnreachable(
                f"{self.base_url}: port {url.port} is held by uid {', '.join(map(str, sorted(strangers)))}, not "
                f"the server's uid {self.listener_uid}; the API key was not sent"
            )

    def _request(
        self, path: str, body: dict[str, Any] | None = None, timeout: float | None = None
    ) -> tuple[int, bytes]:
        headers = self._headers()
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

    def stream(
        self, path: str, body: dict[str, Any], timeout: float = 600.0, served_by_header: str | None = None
    ) -> Streamed:
        """POST `body` with `"stream": true` and read the events to their end. Never raises: how it ended is in
        the answer, so a load test can tell a request refused (no status, or not 200) from one cut mid-stream."""
        url = urllib.parse.urlsplit(self.base_url + path)
        connection = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80, timeout=timeout)
        answer, started = Streamed(), time.perf_counter()
        target = url.path + (f"?{url.query}" if url.query else "")
        try:
            try:
                # One request per connection: a kept-alive one would leave the end of a stream to the timeout.
                headers = {**self._headers(), "Connection": "close"}
            except ServerUnreachable as exc:
                answer.error = f"no request: {exc}"
                return answer
            try:
                connection.request("POST", target, json.dumps({**body, "stream": True}), headers)
                response = connection.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                answer.error = f"no response: {exc!r}"
                return answer
            answer.status = response.status
            if served_by_header:
                answer.served_by = response.getheader(served_by_header)
            if response.status != 200:
                answer.error = " ".join(response.read(300).decode(errors="replace").split())[:200]
                return answer
            self._read_events(response, answer, started)
        finally:
            connection.close()
        return answer

    @staticmethod
    def _read_events(response: http.client.HTTPResponse, answer: Streamed, started: float) -> None:
        try:
            while line := response.readline():
                if line.startswith(b"error:") or line.startswith(b'data: {"error"'):
                    answer.error = line.decode(errors="replace").strip()
                    return
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    answer.done = True
                    return
                chunk: dict[str, Any] = json.loads(payload)
                answer.chunks += 1
                answer.model = answer.model or chunk.get("model")
                choices = chunk.get("choices") or [{}]
                content = str(chunk.get("content") or (choices[0].get("delta") or {}).get("content") or "")
                if content and answer.first_content_seconds is None:
                    answer.first_content_seconds = time.perf_counter() - started
                answer.parts.append(content)
                answer.finished = answer.finished or bool(choices[0].get("finish_reason") or chunk.get("stop"))
                if "timings" in chunk:
                    answer.final = chunk
                if chunk.get("stop") is True:
                    return  # llama-server's own /completion: its stop chunk is the last, and no [DONE] follows
        except (OSError, http.client.HTTPException, ValueError) as exc:
            answer.error = f"after {answer.chunks} chunks: {exc!r}"
        if not answer.finished:
            answer.error = f"stream ended after {answer.chunks} chunks without [DONE]"

    def _json(self, body: bytes, path: str) -> Any:
        try:
            return json.loads(body)
        except ValueError:
            raise ServerUnreachable(f"{self.base_url}{path} did not answer JSON") from None
