"""The server unit's ExecStart: run llama-server as a child and speak systemd's notify protocol for it.

llama-server answers HTTP before its model is loaded (/health says 503 until then), so systemd cannot
tell "started" from "ready". The launcher sends READY=1 only once /health answers 200, WATCHDOG=1 only
while it keeps answering (a wedged server stops the pings and systemd's watchdog restarts it), stops the
child gracefully on SIGTERM, and checks that the draft model is really drafting.

Under systemd the launcher exits when llama-server dies and the unit's Restart= starts it again. `up` has no
systemd: its launcher restarts llama-server itself, within the unit's own start limit (plan/start_limit.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from appliance.plan.resolved import Appliance
from appliance.plan.start_limit import StartLimit, StartWindow
from appliance.runtime.notify import Notifier, watchdog_interval
from appliance.runtime.server_api import ServerApi, ServerUnreachable, read_api_key
from appliance.runtime.server_death import LAST_EXIT, describe_exit, engine_facts
from appliance.runtime.server_process import die_with_parent, exit_described, stop, wait_until_ready
from appliance.system.files import write_atomically
from appliance.system.run import DEVNULL, PIPE, STDOUT, Popen, spawn

log = logging.getLogger("llm-appliance.launch")

EXIT_STOPPED = 0
EXIT_LOAD_FAILED = 1
EXIT_DIED = 1
# Warnings llama-server writes in the course of ordinary requests (server-context.cpp), each by itself no news
# to an admin: the first of each kind per start is relayed with a note, the rest only kept for a failure's
# explanation. Fragment of the line -> what it means. Every other line is relayed as it comes.
ROUTINE_WARNINGS = {
    # a prompt the slot holds whole (the health canary's fixed prompt, a client's retry): one token is re-evaluated
    "need to evaluate at least 1 token for each active slot": "prompt answered wholly from its cache",
    "n_past was set to": "prompt answered wholly from its cache",
    # sliding-window and recurrent models keep a few checkpoints of a long conversation, the oldest dropped
    "erasing old context checkpoint": "context checkpoint dropped from a long conversation",
}


@dataclass(frozen=True)
class LaunchPlan:
    argv: tuple[str, ...]
    health_url: str
    api_key_file: Path | None
    draft_in_use: bool  # a draft model is in use
    speculation: bool  # llama-server speculates: with the draft model, or n-gram types without one
    watchdog_seconds: int
    state_dir: Path | None = None  # where the last exit's description is left for `status`

    @property
    def base_url(self) -> str:
        return self.health_url.removesuffix("/health")

    @classmethod
    def of(cls, appliance: Appliance) -> LaunchPlan:
        return cls(
            argv=appliance.argv,
            health_url=appliance.health_url,
            api_key_file=appliance.api_key_file,
            draft_in_use=appliance.draft_in_use,
            speculation=appliance.speculation,
            watchdog_seconds=appliance.spec.health.watchdog_seconds,
            state_dir=appliance.state_file.parent,
        )


class Launcher:
    def __init__(
        self,
        plan: LaunchPlan,
        notifier: Notifier | None = None,
        stop_timeout: float = 30.0,
        start_limit: StartLimit | None = None,
    ) -> None:
        """`start_limit`: restart llama-server when it dies, within this limit (`up`); None: exit (systemd)."""
        self.plan = plan
        self.start_limit = start_limit
        self.notifier = notifier or Notifier()
        self.stop_timeout = stop_timeout
        # llama-server is this launcher's child, its user: the key goes to no other user's listener on its port.
        self.api = ServerApi(plan.base_url, read_api_key(plan.api_key_file), timeout=5.0, listener_uid=os.geteuid())
        self.tail: deque[str] = deque(maxlen=200)
        self.stop_requested = threading.Event()
        self.restart_requested = threading.Event()
        self.stop_requested_or_restart = threading.Event()  # wakes the serving loop for either
        self.child: Popen[str] | None = None
        self.speculation_verdict: bool | None = None

    def request_stop(self, signum: int, _frame: FrameType | None = None) -> None:
        log.info("received %s: stopping llama-server", signal.Signals(signum).name)
        self.stop_requested.set()
        self.stop_requested_or_restart.set()

    def request_restart(self) -> None:
        """Restart llama-server in place (SIGHUP, or the health daemon of `llm-appliance up`)."""
        self.restart_requested.set()
        self.stop_requested_or_restart.set()

    def _on_sighup(self, _signum: int, _frame: FrameType | None = None) -> None:
        log.info("received SIGHUP: restarting llama-server")
        self.request_restart()

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        signal.signal(signal.SIGHUP, self._on_sighup)
        starts = StartWindow(self.start_limit) if self.start_limit else None
        if starts is not None:
            starts.allows(time.monotonic())  # the first start counts, as systemd counts it
        served = False
        try:
            while True:
                outcome = self._start()
                if outcome is None:
                    served = True
                    outcome = self._serve()
                if outcome is None:
                    self.notifier.send("RELOADING=1", "STATUS=restarting llama-server")
                    continue
                # A first load that fails ends it: nothing has served yet, the spec or the engine is at fault,
                # and a retry would fail the same way.
                if self.stop_requested.is_set() or starts is None or not served:
                    return outcome
                stopped = self._wait_to_restart(starts, outcome)
                if stopped is not None:
                    return stopped
        finally:
            # Whatever ends the loop (an exception too): llama-server goes with it, not at interpreter exit.
            if self.child is not None:
                self._terminate_child()

    def _wait_to_restart(self, starts: StartWindow, outcome: int) -> int | None:
        """After llama-server died: None once it is time to start it again (RestartSec=), else the exit code,
        when the start limit is reached or a stop comes meanwhile."""
        limit = starts.limit
        if not starts.allows(time.monotonic()):
            log.error(
                "llama-server died again after %d starts within %d s, the server unit's start limit "
                "(StartLimitBurst=%d, StartLimitIntervalSec=%d): not starting it again",
                limit.burst,
                limit.interval_seconds,
                limit.burst,
                limit.interval_seconds,
            )
            return outcome
        log.warning(
            "restarting llama-server in %d s (start %d of %d allowed within %d s, as the server unit's Restart= would)",
            limit.delay_seconds,
            starts.starts,
            limit.burst,
            limit.interval_seconds,
        )
        self.notifier.status(f"llama-server died; restarting it in {limit.delay_seconds} s")
        if self.stop_requested.wait(limit.delay_seconds):
            log.info("stopped before llama-server was started again")
            self.notifier.stopping("stopped")
            return EXIT_STOPPED
        return None

    def _start(self) -> int | None:
        """Start llama-server and wait for it to load; an exit code when it never became ready."""
        started = time.monotonic()
        self.tail.clear()  # a failure is explained by this start's lines, not an earlier one's
        self.restart_requested.clear()
        self.stop_requested_or_restart.clear()
        self.speculation_verdict = None
        # Line-buffered text, undecodable bytes replaced: the relay must never die on one odd line.
        self.child = spawn(
            self.plan.argv,
            stdout=PIPE,
            stderr=STDOUT,
            stdin=DEVNULL,
            errors="replace",
            bufsize=1,
            preexec_fn=die_with_parent,
        )
        threading.Thread(target=self._relay_output, args=(self.child,), daemon=True).start()
        log.info("started llama-server (pid %d)", self.child.pid)  # spawn logged the command line
        self.notifier.status(f"loading model (llama-server pid {self.child.pid})")
        outcome = self._wait_until_ready()
        if outcome is not None:
            return outcome
        log.info("llama-server is ready after %.1f s at %s", time.monotonic() - started, self.plan.base_url)
        if self.plan.state_dir is not None:  # serving again: how it last ended is history, not the state
            with contextlib.suppress(OSError):
                (self.plan.state_dir / LAST_EXIT).unlink(missing_ok=True)
        self.notifier.ready(self._ready_status())
        self._check_slots()
        return None

    def _relay_output(self, child: Popen[str]) -> None:
        """llama-server's output goes on to the journal, but for routine warnings after their first; the tail
        keeps every line to explain a failure."""
        assert child.stdout is not None
        seen: set[str] = set()
        for line in child.stdout:
            self.tail.append(line.rstrip("\n"))
            meaning = _routine_warning(line)
            if meaning in seen:
                continue
            sys.stderr.write(line)
            sys.stderr.flush()
            if meaning is not None:
                seen.add(meaning)
                log.info(
                    "llama-server warns so at every %s: routine, not relayed again until it restarts",
                    meaning,
                )

    def _wait_until_ready(self) -> int | None:
        assert self.child is not None
        # No deadline: systemd's TimeoutStartSec= is the one (a 27B model may take minutes to load).
        while not wait_until_ready(self.child, self.api, math.inf, self.stop_requested_or_restart):
            if self.stop_requested.is_set():
                return self._stop("stopped while loading")
            if self.restart_requested.is_set():  # it is starting afresh already
                self.restart_requested.clear()
                self.stop_requested_or_restart.clear()
            code = self._child_exit()
            if code is not None:
                log.error("llama-server failed to load the model: it %s", self._death(code))
                return EXIT_LOAD_FAILED
        return None

    def _serve(self) -> int | None:
        """Watch the ready server; an exit code when done, None when a restart was asked for."""
        interval = watchdog_interval(self.plan.watchdog_seconds) or 5.0
        failing_since: float | None = None
        while not self.stop_requested_or_restart.wait(min(interval, 2.0)):
            code = self._child_exit()
            if code is not None:
                log.error("llama-server exited unexpectedly: it %s", self._death(code))
                return 128 - code if code < 0 else (code or EXIT_DIED)
            try:
                healthy = self.api.health() == 200
            except ServerUnreachable:
                healthy = False
            if healthy:
                failing_since = None
                self.notifier.watchdog()
                self._check_speculation()
            elif failing_since is None:
                failing_since = time.monotonic()
                log.warning(
                    "/health stopped answering 200; no WATCHDOG=1 until it does (systemd restarts a hung server)"
                )
                self.notifier.status("llama-server is not answering /health")
        if self.stop_requested.is_set():
            return self._stop("stopped")
        self._terminate_child()
        log.info("llama-server stopped for a restart (%s)", exit_described(self.child.returncode if self.child else 0))
        return None

    def _ready_status(self) -> str:
        if self.plan.draft_in_use:
            kind = "draft configured"
        else:
            kind = "speculation without a draft model" if self.plan.speculation else "no draft"
        return f"ready at {self.plan.base_url} ({kind})"

    def _check_slots(self) -> None:
        """llama-server frees an unusable draft at load; /slots says whether speculation initialised."""
        if not self.plan.speculation:
            return
        try:
            slots = self.api.slots()
        except ServerUnreachable as exc:
            log.warning("cannot read /slots to confirm speculation: %s", exc)
            return
        if slots and not any(slot.get("speculative") for slot in slots):
            self._not_engaged("llama-server did not initialise speculative decoding (/slots: speculative=false)")

    def _check_speculation(self) -> None:
        """After the first tokens are generated, configured speculation (a draft, n-grams) must have drafted some."""
        if not self.plan.speculation or self.speculation_verdict is not None:
            return
        try:
            metrics = self.api.metrics()
        except ServerUnreachable as exc:
            log.debug("cannot read /metrics yet: %s", exc)
            return
        if metrics.get("tokens_predicted_total", 0) <= 0:
            return
        drafted = metrics.get("spec_decode_num_draft_tokens_total", 0)
        if drafted > 0:
            self.speculation_verdict = True
            accepted = metrics.get("spec_decode_num_accepted_tokens_total", 0)
            log.info("speculation engaged: %d tokens drafted, %d accepted", drafted, accepted)
            self.notifier.status(f"{self._ready_status()}; speculation engaged, acceptance {accepted / drafted:.2f}")
        elif self.plan.draft_in_use:
            self._not_engaged(f"{metrics['tokens_predicted_total']:.0f} tokens generated and none drafted")
        # n-gram types draft only once the output repeats earlier text: no drafts yet is no verdict yet.

    def _not_engaged(self, why: str) -> None:
        self.speculation_verdict = False
        if self.plan.draft_in_use:
            log.error(
                "SPECULATION NOT ENGAGED: a draft model is configured but %s. The server runs without it, slower. "
                "Check `llm-appliance validate` (draft vocabulary, --spec-type draft-simple) and the lines above.",
                why,
            )
        else:
            log.error(
                "SPECULATION NOT ENGAGED: speculative.type is configured but %s. The server runs without it, slower. "
                "Check `llm-appliance validate` (--spec-type) and the lines above.",
                why,
            )
        self.notifier.status(f"{self._ready_status()}; SPECULATION NOT ENGAGED")

    def _child_exit(self) -> int | None:
        assert self.child is not None
        return self.child.poll()

    def _death(self, code: int) -> str:
        """How llama-server ended, as runtime/server_death.py words it for every reader; left in the state
        directory for `status` too."""
        time.sleep(0.2)  # let the relay thread catch the last lines
        sets, cpu = engine_facts(Path(self.plan.argv[0]))
        described = describe_exit(code, self.tail, sets, cpu)
        if self.plan.state_dir is not None:
            with contextlib.suppress(OSError):
                write_atomically(self.plan.state_dir / LAST_EXIT, f"{described}\n", mode=0o600)
        return described

    def _stop(self, reason: str) -> int:
        assert self.child is not None
        self.notifier.stopping(reason)
        self._terminate_child()
        log.info("llama-server %s (%s)", reason, exit_described(self.child.returncode))
        return EXIT_STOPPED

    def _terminate_child(self) -> None:
        assert self.child is not None
        stop(self.child, self.stop_timeout)


def _routine_warning(line: str) -> str | None:
    """What a routine llama-server warning means, or None for any other line (llama-server prefixes its
    warnings with "W ")."""
    if not line.startswith("W "):
        return None
    return next((meaning for fragment, meaning in ROUTINE_WARNINGS.items() if fragment in line), None)
