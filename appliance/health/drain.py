"""The restart path's two pure parts: whose turn it is in the fleet (the min_ready guard), and the drain before a
restart, as a state machine on an injected clock: not-ready first, then the balancer's time to notice
(drain_seconds), then the requests in flight (idle_timeout at the latest), then the restart.

The daemon steps both once per check, with its peers' /ready as last read, the time and whether llama-server is
busy.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from appliance.health.peers import Peer

# A peer in one of these is in the middle of a restart: nobody else starts one.
RESTARTING = ("draining", "restarting", "loading", "warming")

# "drain": the balancer may still send new requests; "wait": requests in flight; "restart": nothing left to cut.
Step = Literal["drain", "wait", "restart"]


@dataclass
class Drain:
    drain_seconds: float
    idle_timeout_seconds: float
    started: float | None = None

    @property
    def active(self) -> bool:
        return self.started is not None

    def step(self, now: float, busy: bool) -> Step:
        if self.started is None:
            self.started = now
        elapsed = now - self.started
        if elapsed < self.drain_seconds:
            return "drain"
        # The idle timeout counts from the end of the drain: only then no new request can arrive.
        if busy and elapsed < self.drain_seconds + self.idle_timeout_seconds:
            return "wait"
        return "restart"

    def remaining(self, now: float) -> float:
        """Seconds until the balancer has stopped sending (0 once it has, or when not draining)."""
        return 0.0 if self.started is None else max(0.0, self.started + self.drain_seconds - now)

    def cancel(self) -> None:
        self.started = None


# "claim": announce the turn (still serving) and look again; "go": drain (or go on draining) towards the restart;
# "hold": go on draining, but do not restart yet; "wait": not this host's turn yet (serving); "yield": stop a
# drain already begun and serve again.
Turn = Literal["claim", "go", "hold", "wait", "yield"]


@dataclass(frozen=True)
class TurnVerdict:
    turn: Turn
    detail: str


def restart_turn(
    me: str, min_ready: int, settle_seconds: float, peers: list[Peer], claimed: bool, draining: bool
) -> TurnVerdict:
    """Whether this host may take its restart now. One host restarts at a time, and only while at least min_ready
    other hosts serve, each ready for settle_seconds (long enough for the balancer to send to it again).

    Two hosts that want to restart at once both claim first (still serving); the one whose name sorts first goes,
    the other waits. A drain that began anyway beside another (both read each other before either claimed) ends
    for the host whose name sorts last.
    """
    serving = [p for p in peers if p.ready and p.ready_seconds >= settle_seconds]
    short = f"{len(serving)} other host{'s' if len(serving) != 1 else ''} serving, min_ready {min_ready}"
    if draining:
        first = sorted(p.name for p in peers if p.reason == "draining" and p.name < me)
        if first:
            return TurnVerdict("yield", f"{first[0]} is draining too and goes first")
        if len(serving) >= min_ready:
            return TurnVerdict("go", short)
        if any(p.reason == "draining" for p in peers):
            return TurnVerdict("hold", f"{short}; the other draining host gives way")
        return TurnVerdict("yield", short)
    restarting = sorted(f"{p.name} ({p.reason})" for p in peers if not p.ready and p.reason in RESTARTING)
    if restarting:
        return TurnVerdict("wait", f"{', '.join(restarting)} restarting first")
    settling = sorted(p.name for p in peers if p.ready and p.ready_seconds < settle_seconds)
    if settling:
        return TurnVerdict("wait", f"{', '.join(settling)} ready again only just (settling {settle_seconds:.0f} s)")
    if len(serving) < min_ready:
        return TurnVerdict("wait", short)
    ahead = sorted(p.name for p in peers if p.claim and p.name < me)
    if ahead:
        return TurnVerdict("wait", f"{ahead[0]} claimed the turn first")
    if not claimed:
        return TurnVerdict("claim", short)
    return TurnVerdict("go", short)


@dataclass
class PeerClocks:
    """How long this host has seen each peer hold a claim (while ready) or stay restarting, by its own clock, not
    the peer's word. A claim turns into a drain at the peer's next check, and a restart ends when the server is
    back: a claim past `claim_seconds` or a restart past `turn_seconds` is a peer stuck (or lying), and no
    longer holds this host's turn. A peer not read for `claim_seconds` starts afresh."""

    claim_seconds: float
    turn_seconds: float
    claiming: dict[str, tuple[float, float]] = field(default_factory=dict)  # name: (since, last seen)
    restarting: dict[str, tuple[float, float]] = field(default_factory=dict)

    def judge(self, now: float, peers: list[Peer]) -> list[Peer]:
        judged = []
        for peer in peers:
            if self._held(self.claiming, peer.name, now, peer.ready and peer.claim) > self.claim_seconds:
                peer = replace(peer, claim=False)
            stuck = self._held(self.restarting, peer.name, now, not peer.ready and peer.reason in RESTARTING)
            if stuck > self.turn_seconds:
                peer = replace(peer, reason=f"{peer.reason} for {stuck:.0f} s, over {self.turn_seconds:.0f} s: stuck")
            judged.append(peer)
        return judged

    def _held(self, clocks: dict[str, tuple[float, float]], name: str, now: float, holds: bool) -> float:
        """Seconds `name` has held the state without a break (0 when it does not now)."""
        if not holds:
            clocks.pop(name, None)
            return 0.0
        since, seen = clocks.get(name, (now, now))
        if now - seen > self.claim_seconds:
            since = now
        clocks[name] = (since, now)
        return now - since
