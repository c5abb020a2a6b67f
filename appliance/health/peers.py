"""The fleet's other hosts as this daemon sees them, through their /ready (health/exporter.py): the status the
balancer sees, and the headers the min_ready guard needs (how long ready, claim, the restart wanted).

Read all at once, each with a short timeout: an unreachable peer is a peer not serving, never an error.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.message import Message

from appliance.health.exporter import CLAIM, READY_SECONDS, WANTS


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


def read_peer(name: str, url: str, timeout: float) -> Peer:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return _peer(name, True, None, answer.headers)
    except urllib.error.HTTPError as exc:
        body = exc.read(200).decode(errors="replace").strip()
        return _peer(name, False, body.removeprefix("not ready: ") or f"HTTP {exc.code}", exc.headers)
    except (OSError, ValueError) as exc:  # refused, timed out, reset: a host that is down or unreachable
        return Peer(name, False, f"unreachable ({getattr(exc, 'reason', exc)})")


def _peer(name: str, ready: bool, reason: str | None, headers: Message) -> Peer:
    try:
        ready_seconds = float(headers.get(READY_SECONDS) or 0.0)
    except ValueError:
        ready_seconds = 0.0
    return Peer(name, ready, reason, ready_seconds, headers.get(CLAIM) == "1", headers.get(WANTS) or None)


def reader(timeout: float) -> PeerReader:
    """Every peer's /ready at once: a slow or silent peer costs one timeout, not one per peer."""

    def read(peers: Mapping[str, str]) -> list[Peer]:
        if not peers:
            return []
        with ThreadPoolExecutor(max_workers=min(8, len(peers)), thread_name_prefix="peer") as pool:
            return list(pool.map(lambda item: read_peer(item[0], item[1], timeout), sorted(peers.items())))

    return read
