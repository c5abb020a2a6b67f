"""Which web pages a browser lets read the API: the planned argv's CORS grant, against the real llama-server.

A browser lets a page on origin O read a cross-origin response only when Access-Control-Allow-Origin is O
or `*` (`*` never with credentials), and sends a non-simple request (JSON, an Authorization header) only
after a preflight OPTIONS gets that grant. llama-server answers the Origin header itself; these tests read
what it answers to a page on a foreign origin and to the one origin the spec allows.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import resolved

from appliance.measure.server import free_port

pytestmark = pytest.mark.engine

FOREIGN = ["https://evil.example", "http://localhost:3000", "http://127.0.0.1:9999", "null"]
UI = "https://ui.example:8443"
LOAD_SECONDS = 120.0


class Server:
    def __init__(self, argv: list[str], port: int, log: Path) -> None:
        self.port, self.log = port, log
        with log.open("w") as out:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + LOAD_SECONDS
        while self.request("GET", "/health")[0] != 200:
            assert self.process.poll() is None, f"llama-server exited {self.process.returncode}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"no /health 200 within {LOAD_SECONDS} s:\n{self.tail()}"
            time.sleep(0.25)

    def tail(self) -> str:
        return self.log.read_text()[-3000:]

    def request(
        self, method: str, path: str, headers: dict[str, str] | None = None, body: bytes | None = None
    ) -> tuple[int, dict[str, str]]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            response.read()
            return response.status, {name.lower(): value for name, value in response.getheaders()}
        except (ConnectionError, TimeoutError):
            return 0, {}
        finally:
            connection.close()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    # What a page on `origin` would do.

    def read(self, origin: str) -> dict[str, str]:
        """A completion requested from the page: the response a browser would or would not hand to it."""
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
        headers = {"Origin": origin, "Content-Type": "application/json"}
        status, answer = self.request("POST", "/v1/chat/completions", headers, body)
        assert status == 200, (status, answer)
        return answer

    def health(self, origin: str) -> dict[str, str]:
        status, answer = self.request("GET", "/health", {"Origin": origin})
        assert status == 200
        return answer

    def preflight(self, origin: str) -> dict[str, str]:
        headers = {
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        status, answer = self.request("OPTIONS", "/v1/chat/completions", headers)
        assert status == 200
        return answer


def granted(headers: dict[str, str], origin: str) -> bool:
    """The browser's CORS check (Fetch standard): the page on `origin` may read the response."""
    allowed = headers.get("access-control-allow-origin")
    return allowed == origin or (allowed == "*" and not with_credentials(headers))


def with_credentials(headers: dict[str, str]) -> bool:
    return headers.get("access-control-allow-credentials") == "true"


@pytest.fixture
def serve(example: Callable[..., Path], tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """llama-server started with the argv the appliance plans for demo.toml (the real binary's dialect)."""
    servers: list[Server] = []

    def start(replace: dict[str, str] | None = None, edit: Callable[[list[str]], list[str]] = list) -> Server:
        port = free_port()
        spec = example("demo-draft.toml", {"port = 8080": f"port = {port}", **(replace or {})})
        argv = edit(list(resolved(spec).argv))
        servers.append(Server(argv, port, tmp_path / f"llama-server-{len(servers)}.log"))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def test_the_default_grants_no_origin(serve: Callable[..., Server]) -> None:
    server = serve()
    argv = server.process.args
    assert isinstance(argv, list)
    assert argv[argv.index("--cors-origins") + 1] == ""
    assert "--no-cors-credentials" in argv
    for origin in FOREIGN:
        for answer in (server.read(origin), server.health(origin), server.preflight(origin)):
            assert not granted(answer, origin), (origin, answer)
            assert not with_credentials(answer), (origin, answer)
            assert answer.get("access-control-allow-origin", "") == "", (origin, answer)


def test_the_allowed_origin_is_granted_and_no_other(serve: Callable[..., Server]) -> None:
    server = serve({"threads = 2": f'threads = 2\ncors_origins = ["{UI}"]'})
    for answer in (server.read(UI), server.health(UI), server.preflight(UI)):
        assert granted(answer, UI), answer
        assert not with_credentials(answer), answer
    preflight = server.preflight(UI)
    assert "POST" in preflight["access-control-allow-methods"]
    for origin in FOREIGN:
        for answer in (server.read(origin), server.health(origin), server.preflight(origin)):
            assert not granted(answer, origin), (origin, answer)
            assert not with_credentials(answer), (origin, answer)


def test_without_the_flags_the_binary_grants_every_origin(serve: Callable[..., Server]) -> None:
    """What the appliance rendered before: llama-server's own default reflects any Origin, with credentials."""

    def without_cors_flags(argv: list[str]) -> list[str]:
        at = argv.index("--cors-origins")
        return [arg for arg in argv[:at] + argv[at + 2 :] if arg != "--no-cors-credentials"]

    server = serve(edit=without_cors_flags)
    assert not any(flag in server.process.args for flag in ("--cors-origins", "--no-cors-credentials"))  # type: ignore[operator]
    evil = FOREIGN[0]
    assert granted(server.read(evil), evil)
    preflight = server.preflight(evil)
    assert granted(preflight, evil) and with_credentials(preflight)
