"""Restarts asked for from outside the daemon (the timer's scheduled one, an admin's `llm-appliance restart`),
handed to the running health daemon through its state directory, so that they take the same path as the
daemon's own: the min_ready guard, the drain, the warm-up. The same under systemd and under `up`.

The command writes REQUEST; the daemon adopts it by renaming it to ADOPTED (the command sees it taken), and
removes ADOPTED just before the restart it asked for. A daemon that stops in between (a crash, a stop) finds
ADOPTED when it starts again and carries the restart out.

A drain (`llm-appliance drain`, a pod's preStop) takes the same road: the command writes DRAIN_REQUEST, the daemon
adopts it, stops taking requests for good (/ready "draining") and writes DRAINED with the request's id once none is
in flight; the command waits for that.

Both sides run as the service user, which owns the directory: a request is a wish the user could carry out
itself (polkit lets it restart the server), so it is parsed with care but needs no more trust than that.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast, get_args

from appliance.system.files import write_atomically

log = logging.getLogger("llm-appliance.health")
REQUEST = "restart-request.json"
ADOPTED = "restart-adopted.json"
DRAIN_REQUEST = "drain-request.json"
DRAIN_ADOPTED = "drain-adopted.json"
DRAINED = "drained.json"
Reason = Literal["scheduled", "manual"]


@dataclass(frozen=True)
class RestartRequest:
    reason: Reason
    requested_at: float
    id: str


class RestartRequests:
    def __init__(self, state_dir: Path) -> None:
        self.request = state_dir / REQUEST
        self.adopted = state_dir / ADOPTED

    # -- the command's side --

    def submit(self, reason: Reason) -> RestartRequest:
        wanted = RestartRequest(reason, time.time(), uuid.uuid4().hex)
        write_atomically(self.request, json.dumps(wanted.__dict__) + "\n", mode=0o600)
        return wanted

    def taken(self, wanted: RestartRequest) -> bool:
        """True once the daemon adopted `wanted` (or a newer request replaced it, which the daemon adopts)."""
        found = _read(self.request)
        return found is None or found.id != wanted.id

    def withdraw(self, wanted: RestartRequest) -> None:
        """Take back `wanted` if no daemon took it; a daemon adopting it at this very moment still may."""
        if not self.taken(wanted):
            self.request.unlink(missing_ok=True)

    # -- the daemon's side --

    def pending(self) -> bool:
        return self.request.exists()

    def adopt(self) -> RestartRequest | None:
        """The request to carry out: a new one (taken now), or one adopted before this daemon started."""
        if self.request.exists():
            try:
                os.replace(self.request, self.adopted)
            except OSError as exc:
                log.warning("cannot take the restart request %s: %s", self.request, exc)
        if not self.adopted.exists():
            return None
        found = _read(self.adopted)
        if found is None:
            log.warning("ignoring %s: not a restart request this version writes", self.adopted)
            self.done()
        return found

    def done(self) -> None:
        self.adopted.unlink(missing_ok=True)


def _read(path: Path) -> RestartRequest | None:
    try:
        raw = json.loads(path.read_text())
        reason, requested_at, ident = raw["reason"], float(raw["requested_at"]), str(raw["id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if reason not in get_args(Reason):
        return None
    return RestartRequest(cast(Reason, reason), requested_at, ident)


class DrainRequests:
    def __init__(self, state_dir: Path) -> None:
        self.request = state_dir / DRAIN_REQUEST
        self.adopted = state_dir / DRAIN_ADOPTED
        self.drained = state_dir / DRAINED

    # -- the command's side --

    def submit(self) -> str:
        ident = uuid.uuid4().hex
        write_atomically(self.request, json.dumps({"id": ident, "requested_at": time.time()}) + "\n", mode=0o600)
        return ident

    def taken(self, ident: str) -> bool:
        return _drain_id(self.request) != ident

    def done(self, ident: str) -> bool:
        return _drain_id(self.drained) == ident

    def withdraw(self, ident: str) -> None:
        if not self.taken(ident):
            self.request.unlink(missing_ok=True)

    # -- the daemon's side --

    def forget(self) -> None:
        """At the daemon's start: a drain is the running daemon's to carry out. One left from before (a pod's
        state directory on a volume outlives the pod) would keep the new one draining for ever."""
        for path in (self.request, self.adopted, self.drained):
            path.unlink(missing_ok=True)

    def pending(self) -> bool:
        return self.request.exists()

    def adopt(self) -> str | None:
        """The id of a drain asked for since the last look, taken now; None when none was."""
        if not self.request.exists():
            return None
        try:
            os.replace(self.request, self.adopted)
        except OSError as exc:
            log.warning("cannot take the drain request %s: %s", self.request, exc)
            return None
        ident = _drain_id(self.adopted)
        if ident is None:
            log.warning("ignoring %s: not a drain request this version writes", self.adopted)
        return ident

    def drained_for(self, ident: str) -> None:
        write_atomically(self.drained, json.dumps({"id": ident}) + "\n", mode=0o600)
        self.adopted.unlink(missing_ok=True)


def _drain_id(path: Path) -> str | None:
    try:
        ident = json.loads(path.read_text())["id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return ident if isinstance(ident, str) else None
