"""The daemon's own pod, evicted through the Kubernetes Eviction API: how a fleet whose [fleet] turns =
"eviction" takes its restart turns. The API server asks the PodDisruptionBudget: 201, the pod goes (the kubelet
runs its preStop drain, then stops it, and the StatefulSet starts it again); 429, the restart would leave too few
pods ready, so the daemon serves on and asks again later.

In-cluster configuration as every pod has it: the pod's name and namespace from the downward API (POD_NAME,
POD_NAMESPACE), the service account's token and CA, and the API server at KUBERNETES_SERVICE_HOST:PORT; each is
injectable (a test's fake API server on loopback). The standard library only: urllib and ssl.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# The API server answers an eviction at once (the drain is the kubelet's, later): a slow answer is a failed one.
EVICTION_TIMEOUT_SECONDS = 10.0

Outcome = Literal["granted", "refused", "failed"]
OUTCOMES: tuple[Outcome, ...] = ("granted", "refused", "failed")


class NotInCluster(Exception):
    """What the in-cluster configuration lacks; the message names it."""


@dataclass(frozen=True)
class EvictionAnswer:
    outcome: Outcome
    detail: str  # the API server's message, or why it could not be asked


@dataclass(frozen=True)
class InCluster:
    pod: str
    namespace: str
    api_url: str  # https://host:port, or a test's http://127.0.0.1:port
    token_file: Path
    ca_file: Path | None  # None: the system's CAs (or plain HTTP)

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None, account: Path = SERVICE_ACCOUNT) -> InCluster:
        """As a pod sees it. LLM_APPLIANCE_KUBE_API, _TOKEN_FILE and _CA_FILE override the API server's URL, the
        token and the CA (a test's fake); POD_NAMESPACE falls back on the service account's namespace file."""
        env = os.environ if env is None else env
        pod = env.get("POD_NAME", "")
        namespace = env.get("POD_NAMESPACE", "") or _read(account / "namespace")
        api = env.get("LLM_APPLIANCE_KUBE_API", "")
        if not api and env.get("KUBERNETES_SERVICE_HOST"):
            host = env["KUBERNETES_SERVICE_HOST"]
            host = f"[{host}]" if ":" in host else host
            api = f"https://{host}:{env.get('KUBERNETES_SERVICE_PORT', '443')}"
        missing = [name for name, value in (("POD_NAME", pod), ("POD_NAMESPACE", namespace), ("API", api)) if not value]
        if missing:
            raise NotInCluster(
                f'[fleet] turns = "eviction" needs {", ".join(missing)} (the downward API\'s POD_NAME and '
                "POD_NAMESPACE, the API server's KUBERNETES_SERVICE_HOST): is this a pod of the rendered StatefulSet?"
            )
        token = Path(env.get("LLM_APPLIANCE_KUBE_TOKEN_FILE", "") or account / "token")
        ca = Path(env.get("LLM_APPLIANCE_KUBE_CA_FILE", "") or account / "ca.crt")
        return InCluster(pod, namespace, api.rstrip("/"), token, ca if ca.exists() else None)


class Evictor:
    """POSTs the Eviction of this pod; each call asks the API server afresh (the PDB's answer changes)."""

    def __init__(self, cluster: InCluster, timeout: float = EVICTION_TIMEOUT_SECONDS) -> None:
        self.cluster, self.timeout = cluster, timeout

    @property
    def pod(self) -> str:
        return self.cluster.pod

    def evict(self) -> EvictionAnswer:
        c = self.cluster
        path = f"/api/v1/namespaces/{_quote(c.namespace)}/pods/{_quote(c.pod)}/eviction"
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": c.pod, "namespace": c.namespace}}
        try:
            # Read at each eviction: the kubelet rotates a projected token (an hour, by default).
            token = c.token_file.read_text().strip()
        except OSError as exc:
            return EvictionAnswer("failed", f"cannot read the service account token {c.token_file}: {exc.strerror}")
        request = urllib.request.Request(
            c.api_url + path,
            data=json.dumps(body).encode(),
            method="POST",
            headers={
                "Content-Type": "application/json",
                "Accept": "application/json",
                "Authorization": f"Bearer {token}",
            },
        )
        context = ssl.create_default_context(cafile=str(c.ca_file) if c.ca_file else None)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=context) as answer:
                return EvictionAnswer("granted", f"HTTP {answer.status}: {_message(answer.read(4096))}")
        except urllib.error.HTTPError as exc:
            message = _message(exc.read(4096))
            outcome: Outcome = "refused" if exc.code == 429 else "failed"
            return EvictionAnswer(outcome, f"HTTP {exc.code}: {message}")
        except (OSError, ValueError) as exc:  # refused, timed out, TLS: the API server not reached
            return EvictionAnswer("failed", f"API server {c.api_url} not reached: {getattr(exc, 'reason', exc)}")


def _message(raw: bytes) -> str:
    """A Status body's message (and the PDB's cause, which says how many pods it needs), else the raw text."""
    try:
        status = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace").strip()[:200] or "no body"
    if not isinstance(status, dict):
        return str(status)[:200]
    causes = (status.get("details") or {}).get("causes") or []
    said = [str(status.get("message") or status.get("status") or "")]
    said += [str(c.get("message")) for c in causes if isinstance(c, dict) and c.get("message")]
    return " ".join(s for s in said if s) or "no message"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")
