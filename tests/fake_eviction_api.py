"""A FAKE of the Kubernetes API server's Eviction subresource, for tests only: real HTTP on loopback, answering
POST /api/v1/namespaces/{ns}/pods/{pod}/eviction as the API server does for pods under one PodDisruptionBudget
with minAvailable (pkg/registry/core/pod/storage/eviction.go, policy/v1):

- the PDB's status: currentHealthy = the ready pods, desiredHealthy = minAvailable, disruptionsAllowed =
  currentHealthy - desiredHealthy (at least 0);
- a ready pod is evicted only while disruptionsAllowed > 0; a pod not ready (unhealthyPodEvictionPolicy
  IfHealthyBudget, the default) while currentHealthy >= desiredHealthy;
- evicted: 201 with a Status of success, and the pod is gone (it terminates, no longer healthy);
- refused: 429 with a Status whose reason is TooManyRequests and the budget's cause;
- an unknown pod: 404 NotFound; no or another bearer token: 401; a body that is not this pod's Eviction: 400.

It is not a Kubernetes: no pods run, nothing is deleted but the fake's own record.
"""

from __future__ import annotations

import json
import re
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

EVICTION_PATH = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<pod>[^/]+)/eviction$")
REFUSED = "Cannot evict pod as it would violate the pod's disruption budget."


class FakeEvictionApi:
    def __init__(
        self,
        namespace: str,
        pods: dict[str, bool],
        min_available: int,
        token: str = "fake-token",
        tls: tuple[Path, Path] | None = None,
    ) -> None:
        """`pods`: the PDB's pods by name, ready or not; `tls`: a certificate and its key, to speak HTTPS as the
        API server does."""
        self.namespace, self.min_available, self.token = namespace, min_available, token
        self.pods = dict(pods)
        self.answers: list[tuple[str, int]] = []  # (pod, HTTP status) of every POST, in order
        self._changed = threading.Condition()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                code, status = fake.answer(self.path, self.headers.get("Authorization", ""), body)
                raw = json.dumps(status).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True, name="fake-eviction-api").start()

    def set_ready(self, pod: str, ready: bool) -> None:
        with self._changed:
            self.pods[pod] = ready

    def disruptions_allowed(self) -> int:
        return max(0, self._healthy() - self.min_available)

    def wait_for_answers(self, count: int, timeout: float) -> list[tuple[str, int]]:
        """Until `count` POSTs were answered (or `timeout`): the answers so far."""
        with self._changed:
            self._changed.wait_for(lambda: len(self.answers) >= count, timeout)
            return list(self.answers)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- the API server's side --

    def answer(self, path: str, authorization: str, body: bytes) -> tuple[int, dict[str, Any]]:
        with self._changed:
            match = EVICTION_PATH.match(path)
            pod = match["pod"] if match else ""
            code, status = self._decide(match, pod, authorization, body)
            self.answers.append((pod, code))
            self._changed.notify_all()
            return code, status

    def _decide(
        self, match: re.Match[str] | None, pod: str, authorization: str, body: bytes
    ) -> tuple[int, dict[str, Any]]:
        if authorization != f"Bearer {self.token}":
            return 401, _status(401, "Unauthorized", "Unauthorized")
        if match is None or match["ns"] != self.namespace or pod not in self.pods:
            return 404, _status(404, "NotFound", f'pods "{pod}" not found', {"name": pod, "kind": "pods"})
        try:
            eviction = json.loads(body)
            valid = (
                eviction["apiVersion"] == "policy/v1"
                and eviction["kind"] == "Eviction"
                and eviction["metadata"]["name"] == pod
                and eviction["metadata"].get("namespace", self.namespace) == self.namespace
            )
        except (ValueError, KeyError, TypeError):
            valid = False
        if not valid:
            return 400, _status(400, "BadRequest", "not an Eviction of this pod")
        healthy = self._healthy()
        allowed = self.pods[pod] and healthy - self.min_available > 0
        allowed = allowed or (not self.pods[pod] and healthy >= self.min_available)
        if not allowed:
            cause = f"The disruption budget llm needs {self.min_available} healthy pods and has {healthy} currently"
            details = {"causes": [{"reason": "DisruptionBudget", "message": cause}]}
            return 429, _status(429, "TooManyRequests", REFUSED, details)
        del self.pods[pod]  # evicted: the pod terminates and no longer counts
        return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    def _healthy(self) -> int:
        return sum(1 for ready in self.pods.values() if ready)


def _status(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message}
    return {**status, "reason": reason, **({"details": details} if details else {}), "code": code}
