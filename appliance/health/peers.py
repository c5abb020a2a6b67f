"""The fleet's other hosts as this daemon sees them, through their /ready (health/exporter.py): the status the
balancer sees, and the headers the min_ready guard needs (how long ready, claim, the restart wanted).

Read all at once, each with a short timeout: an unreachable peer is a peer not serving, never an error. With the
fleet's key, each answer must prove itself (health/fleet_proof.py): one that does not is a peer not serving
either, whatever it says (its claim, its drain, its readiness are not believed).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.message import Message

from appliance.health import fleet_proof
from appliance.health.exporter import CLAIM, READY_SECONDS, SIGNED, WANTS


@dataclass(frozen=True)
class Peer:
    name: str
    ready: bool
    # Why not ready, as its /ready says ("draining", "restarting", ...), or "unreachable".
    reason: str | None = None
    ready_seconds: float = 0.0
    claim: bool = False
    wants: str | None = None


PeerReader = Callable[[Mapping[str, str]], list[Peer]]


def read_peer(name: str, url: str, timeout: float, key: bytes | None = None) -> Peer:
    challenge = fleet_proof.challenge()
    request = urllib.request.Request(url, headers={fleet_proof.CHALLENGE: challenge} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            status, body, headers = int(answer.status), answer.read(200), answer.headers
    except urllib.error.HTTPError as exc:
        status, body, headers = exc.code, exc.read(200), exc.headers
    except (OSError, ValueError) as exc:  # refused, timed out, reset: a host that is down or unreachable
        return Peer(name, False, f"unreachable ({getattr(exc, 'reason', exc)})")
    if key is not None:
        signed = {h: headers.get(h, "") for h in (*SIGNED, fleet_proof.PROOF)}
        if not fleet_proof.proven(key, challenge, (status, body, signed), SIGNED, name):
            return Peer(name, False, "unauthenticated (no proof of the fleet key for this host)")
    if status == 200:
        return _peer(name, True, None, headers)
    text = body.decode(errors="replace").strip()
    return _peer(name, False, text.removeprefix("not ready: ") or f"HTTP {status}", headers)


def _peer(name: str, ready: bool, reason: str | None, headers: Message) -> Peer:
    try:
        ready_seconds = float(headers.get(READY_SECONDS) or 0.0)
    except ValueError:
        ready_seconds = 0.0
    return Peer(name, ready, reason, ready_seconds, headers.get(CLAIM) == "1", headers.get(WANTS) or None)


def reader(timeout: float, key: bytes | None = None) -> PeerReader:
    """Every peer's /ready at once: a slow or silent peer costs one timeout, not one per peer."""

    def read(peers: Mapping[str, str]) -> list[Peer]:
        if not peers:
            return []
        with ThreadPoolExecutor(max_workers=min(8, len(peers)), thread_name_prefix="peer") as pool:
            return list(pool.map(lambda item: read_peer(item[0], item[1], timeout, key), sorted(peers.items())))

    return read
