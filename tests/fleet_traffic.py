"""Traffic through the fleet's HAProxy, a /ready monitor, and the scenarios the test and bench/fleet.py share.

The load client is a few threads inside the client's network namespace, each sending streaming chat
completions back to back (bounded in count and time). Each request is one of:

- ok: the stream ended with a finish_reason and `data: [DONE]`;
- failed: no response began (connection error, or a status other than 200: HAProxy's 503 when it gave up);
- cut: a 200 response began and ended before `data: [DONE]` (the generation was lost mid-stream).

Each request carries its number in the query string (`?n=17`), so HAProxy's log line for it (server,
termination state, retries) can be found.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

from fleet_netns import (
    API_KEY,
    API_PORT,
    BALANCER,
    DECAY_HOST,
    EXPORTER_PORT,
    REPO,
    Fleet,
    FleetError,
    HaproxyCounters,
    child_env,
    http_get,
    parse_exposition,
    wait_until,
)

from appliance.runtime.server_api import ServerApi

KILL_HOST = "demo-2"
PROMPTS = (
    "Name three colours.",
    "What is a fleet of servers?",
    "Say hello in French.",
    "Count from one to five.",
    "What is the capital of Italy?",
)
REQUEST_SECONDS = 60.0  # one stream's socket timeout: far beyond any generation of the demo here
# How long a scenario's event may take on a loaded 2-core box; only a failure waits it.
EVENT_SECONDS = 240.0
LOST_SHOWN = 12  # lost requests listed in a report, each with HAProxy's log line


@dataclass
class Request:
    number: int
    worker: int
    started: float  # time.monotonic()
    ended: float = 0.0
    status: int | None = None
    outcome: str = "pending"  # ok, failed, cut
    detail: str = ""
    chunks: int = 0


def stream_chat(request: Request, max_tokens: int) -> None:
    """One streaming chat completion through HAProxy; fills in `request`'s status, outcome and detail."""
    body = {
        "messages": [{"role": "user", "content": PROMPTS[request.number % len(PROMPTS)]}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    balancer = ServerApi(f"http://{BALANCER}:{API_PORT}", API_KEY)
    try:
        answer = balancer.stream(f"/v1/chat/completions?n={request.number}", body, REQUEST_SECONDS)
    finally:
        request.ended = time.monotonic()
    request.status, request.chunks, request.detail = answer.status, answer.chunks, answer.error
    if answer.status != 200:
        request.outcome = "failed"
    else:
        request.outcome = "ok" if answer.complete and answer.done else "cut"


class Load:
    """`workers` clients in the client's namespace, back to back, until stopped, `max_requests` were sent or
    `max_seconds` passed. A client whose request failed waits `backoff` seconds before its next, as clients do."""

    def __init__(
        self,
        fleet: Fleet,
        workers: int = 3,
        max_requests: int = 500,
        max_seconds: float = 180.0,
        max_tokens: int = 16,
        backoff: float = 0.2,
    ) -> None:
        self.fleet, self.workers, self.max_tokens, self.backoff = fleet, workers, max_tokens, backoff
        self.max_requests, self.max_seconds = max_requests, max_seconds
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.started = 0.0

    def __enter__(self) -> Load:
        self.started = time.monotonic()
        for worker in range(self.workers):
            thread = self.fleet.client.thread(lambda w=worker: self._work(w), f"load-{worker}")  # type: ignore[misc]
            self.threads.append(thread)
            thread.start()
        self.fleet.say(f"load: {self.workers} clients streaming chat completions ({self.max_tokens} tokens)")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """No new requests; those in flight finish."""
        self.stopping.set()
        for thread in self.threads:
            thread.join(REQUEST_SECONDS + 10)
        if any(t.is_alive() for t in self.threads):
            raise FleetError("a load client did not finish its request")

    def _next(self, worker: int) -> Request | None:
        with self.lock:
            exhausted = len(self.requests) >= self.max_requests or time.monotonic() - self.started > self.max_seconds
            if self.stopping.is_set() or exhausted:
                return None
            request = Request(len(self.requests) + 1, worker, time.monotonic())
            self.requests.append(request)
            return request

    def _work(self, worker: int) -> None:
        while (request := self._next(worker)) is not None:
            stream_chat(request, self.max_tokens)
            if request.outcome == "failed":
                self.stopping.wait(self.backoff)

    @property
    def exhausted(self) -> bool:
        return not any(t.is_alive() for t in self.threads)

    def done(self, since: float = 0.0) -> list[Request]:
        with self.lock:
            return [r for r in self.requests if r.started >= since and r.outcome != "pending"]

    def wait_ok(self, count: int, since: float = 0.0, seconds: float = EVENT_SECONDS) -> None:
        """Until `count` requests started after `since` have completed ok (the fleet is serving)."""

        def enough() -> bool:
            if self.exhausted:
                raise FleetError(f"the load ended ({len(self.requests)} sent) before {count} more completed")
            return sum(r.outcome == "ok" for r in self.done(since)) >= count

        wait_until(enough, seconds, lambda: f"{count} completed requests\n{self.fleet.timeline()}")

    def counts(self) -> dict[str, int]:
        finished = self.done()
        return {
            "sent": len(finished),
            **{outcome: sum(r.outcome == outcome for r in finished) for outcome in ("ok", "failed", "cut")},
        }


class ReadyMonitor:
    """Every `interval` seconds, each host's /ready from the client's namespace: the fewest hosts ready at once,
    the longest any host was not ready, and each host's sequence of answers ("ready", "draining", ...)."""

    def __init__(self, fleet: Fleet, interval: float = 0.2) -> None:
        self.fleet, self.interval = fleet, interval
        self.names = list(fleet.hosts)
        self.min_ready = len(self.names)
        self.samples = 0
        self.answers: dict[str, list[tuple[float, str]]] = {name: [] for name in self.names}
        self.not_ready_since: dict[str, float | None] = dict.fromkeys(self.names)
        self.longest: dict[str, float] = dict.fromkeys(self.names, 0.0)
        self.stopping = threading.Event()
        self.thread = fleet.client.thread(self._run, "ready-monitor")

    def __enter__(self) -> ReadyMonitor:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(10)
        now = time.monotonic()
        for name, since in self.not_ready_since.items():
            if since is not None:
                self.longest[name] = max(self.longest[name], now - since)

    def _run(self) -> None:
        while not self.stopping.is_set():
            ready = 0
            for name in self.names:
                status, body = http_get(self.fleet.hosts[name].ready_url, 1.0)
                answer = "ready" if status == 200 else body.strip().removeprefix("not ready: ") if status else "down"
                self._record(name, answer)
                ready += status == 200
            self.samples += 1
            if ready < self.min_ready:
                self.fleet.say(f"monitor: {ready} hosts ready")
            self.min_ready = min(self.min_ready, ready)
            self.stopping.wait(self.interval)

    def _record(self, name: str, answer: str) -> None:
        now = time.monotonic()
        seen = self.answers[name]
        if not seen or seen[-1][1] != answer:
            seen.append((now, answer))
            self.fleet.say(f"monitor: {name} /ready: {answer}")
        since = self.not_ready_since[name]
        if answer == "ready" and since is not None:
            self.longest[name] = max(self.longest[name], now - since)
            self.not_ready_since[name] = None
        elif answer != "ready" and since is None:
            self.not_ready_since[name] = now

    def sequence(self, name: str) -> list[str]:
        return [answer for _, answer in self.answers[name]]

    @property
    def longest_not_ready(self) -> float:
        return max(self.longest.values())


@dataclass
class Outcome:
    """One scenario's counts: the client's, HAProxy's and the monitor's."""

    scenario: str
    sent: int
    ok: int
    failed: int
    cut: int
    retried: int  # HAProxy's connection retries (haproxy_backend_retry_warnings_total)
    redispatched: int
    connection_errors: dict[str, int]
    min_ready: int
    longest_not_ready: float
    seconds: float
    sequences: dict[str, list[str]]
    requests: list[Request] = field(repr=False)
    notes: dict[str, Any] = field(default_factory=dict)

    def lost(self) -> list[Request]:
        return [r for r in self.requests if r.outcome != "ok"]

    def split(self, at: float) -> tuple[list[Request], list[Request]]:
        """The requests started before `at` (time.monotonic()) and those started after."""
        return [r for r in self.requests if r.started < at], [r for r in self.requests if r.started >= at]

    def report(self, fleet: Fleet) -> str:
        lines = [
            f"{self.scenario}: sent {self.sent}, ok {self.ok}, failed {self.failed}, cut {self.cut}, "
            f"retried {self.retried} (redispatched {self.redispatched}, connection errors {self.connection_errors}), "
            f"min ready {self.min_ready}, longest not ready {self.longest_not_ready:.1f} s, {self.seconds:.0f} s",
            *(f"  {key}: {value}" for key, value in self.notes.items() if not key.startswith("_")),
            *(f"  /ready of {name}: {' > '.join(seq)}" for name, seq in self.sequences.items() if len(seq) > 1),
        ]
        if "_killed_at" in self.notes:
            before, after = self.split(self.notes["_killed_at"])
            lines.append(
                f"  started before the kill: {len(before)}, cut {sum(r.outcome == 'cut' for r in before)}, "
                f"failed {sum(r.outcome == 'failed' for r in before)}; started after: {len(after)}, "
                f"lost {sum(r.outcome != 'ok' for r in after)}"
            )
        lost = self.lost()
        if len(lost) > LOST_SHOWN:
            lines.append(f"  ({len(lost)} requests lost; the first {LOST_SHOWN}:)")
        for request in lost[:LOST_SHOWN]:
            logged = fleet.haproxy_log(f"?n={request.number} ")
            lines.append(
                f"  request {request.number} {request.outcome} ({request.status}): {request.detail}"
                + (f"\n    haproxy: {logged[-1].strip()}" if logged else "")
            )
        return "\n".join(lines)


Action = Callable[[Fleet, Load, ReadyMonitor], dict[str, Any]]


@dataclass(frozen=True)
class LoadShape:
    """The load of one scenario: `workers` clients, at most `max_requests` or `max_seconds`; `before` requests
    completed before the action and `after` more once it is done (default: twice the clients)."""

    workers: int = 3
    max_requests: int = 500
    max_seconds: float = 200.0
    max_tokens: int = 16
    before: int = 0
    after: int = 0


def run_scenario(fleet: Fleet, name: str, shape: LoadShape, action: Action) -> Outcome:
    """The whole fleet up, the monitor and the load started and flowing, `action`, then a few more requests
    completed after it (the fleet serves again), the load stopped (in-flight requests finish)."""
    fleet.ensure_whole()
    fleet.say(f"--- {name}")
    before = fleet.counters()
    started = time.monotonic()
    with (
        ReadyMonitor(fleet) as monitor,
        Load(fleet, shape.workers, shape.max_requests, shape.max_seconds, shape.max_tokens) as load,
    ):
        load.wait_ok(shape.before or 2 * shape.workers)
        notes = action(fleet, load, monitor)
        load.wait_ok(shape.after or 2 * shape.workers, since=time.monotonic())
    seconds = time.monotonic() - started
    spent: HaproxyCounters = fleet.counters() - before
    counts = load.counts()
    outcome = Outcome(
        name,
        counts["sent"],
        counts["ok"],
        counts["failed"],
        counts["cut"],
        int(spent.retries),
        int(spent.redispatches),
        {server: int(value) for server, value in spent.connection_errors if value},
        monitor.min_ready,
        monitor.longest_not_ready,
        seconds,
        {host: monitor.sequence(host) for host in fleet.hosts},
        load.done(),
        notes,
    )
    fleet.say(outcome.report(fleet))
    return outcome


# --- the scenarios -----------------------------------------------------------------------------------------


def restart_request(fleet: Fleet, name: str, reason: str = "scheduled") -> subprocess.Popen[str]:
    """`llm-appliance restart --when-idle --reason REASON --state-dir DIR` in the host's namespace (what its
    timer runs), started without waiting: the daemon picks the request up from the state directory."""
    host = fleet.hosts[name]
    argv = host.netns.argv(
        sys.executable,
        "-m",
        "appliance.cli.main",
        "restart",
        "--when-idle",
        "--reason",
        reason,
        "--state-dir",
        host.state_dir,
    )
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(), cwd=REPO
    )


def rolling_restart(fleet: Fleet, load: Load, monitor: ReadyMonitor) -> dict[str, Any]:
    """A scheduled restart requested on all three hosts at once; the daemons restart them one at a time."""
    before = {name: host.restart_totals().get("scheduled", 0) for name, host in fleet.hosts.items()}
    pids = {name: host.server_pid() for name, host in fleet.hosts.items()}
    requests = {name: restart_request(fleet, name) for name in fleet.hosts}
    for name, process in requests.items():
        output, _ = process.communicate(timeout=120)
        if process.returncode != 0:
            raise FleetError(f"{name}: `restart --state-dir` failed ({process.returncode}):\n{output}")
    fleet.say("restart --when-idle --reason scheduled requested on every host")

    def restarted() -> bool:
        return all(
            host.restart_totals().get("scheduled", 0) > before[name] and host.server_pid() != pids[name]
            for name, host in fleet.hosts.items()
        ) and all(fleet.ready(name) for name in fleet.hosts)

    wait_until(
        restarted,
        EVENT_SECONDS,
        lambda: (
            "every host restarted once (scheduled) and ready: "
            + str({n: h.restart_totals() for n, h in fleet.hosts.items()})
            + f"\n{fleet.timeline()}"
        ),
        poll=0.5,
    )
    fleet.wait_balancer(set(fleet.hosts))
    return {
        "scheduled restarts": {n: h.restart_totals().get("scheduled", 0) - before[n] for n, h in fleet.hosts.items()},
        "order": _restart_order(monitor),
    }


def _restart_order(monitor: ReadyMonitor) -> list[str]:
    """The hosts in the order they went not-ready."""
    first: dict[str, float] = {}
    for name, answers in monitor.answers.items():
        for when, answer in answers:
            if answer != "ready":
                first.setdefault(name, when)
    return sorted(first, key=first.__getitem__)


def _baseline(fleet: Fleet, name: str) -> float:
    """The host's learned decode baseline (0 while it learns), from its exporter."""
    status, text = fleet.client.call(http_get, f"http://{fleet.hosts[name].address}:{EXPORTER_PORT}/metrics", 2.0)
    if status != 200:
        return 0.0
    values = [v for n, _, v in parse_exposition(text) if n == "llm_appliance_decode_baseline_tokens_per_second"]
    return max(values, default=0.0)


@contextmanager
def throttled(pid: int, stopped: float = 0.2, running: float = 0.02) -> Iterator[None]:
    """The process stopped `stopped` of every `stopped + running` seconds (SIGSTOP/SIGCONT) until the block ends
    or the process is gone: its decode rate falls to a tenth (by default) while /health still answers."""
    done = threading.Event()

    def bursts() -> None:
        try:
            while not done.is_set():
                os.kill(pid, signal.SIGSTOP)
                done.wait(stopped)
                os.kill(pid, signal.SIGCONT)
                done.wait(running)
        except ProcessLookupError:
            pass  # restarted: the throttled process is gone

    thread = threading.Thread(target=bursts, daemon=True, name=f"throttle-{pid}")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(5)
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def induced_decay(fleet: Fleet, load: Load, monitor: ReadyMonitor) -> dict[str, Any]:
    """DECAY_HOST's llama-server throttled under load until its daemon restarts it for decay. To a fifth of its
    speed: far below decay_ratio (0.5) x its baseline, yet each request (each window of the daemon's, as
    llama-server counts tokens when a request ends) done in a few seconds."""
    host = fleet.hosts[DECAY_HOST]
    wait_until(
        lambda: _baseline(fleet, DECAY_HOST) > 0,
        EVENT_SECONDS,
        lambda: f"{DECAY_HOST}'s decode baseline\n{fleet.timeline()}",
        poll=0.5,
    )
    baseline = _baseline(fleet, DECAY_HOST)
    before = host.restart_totals().get("decay", 0)
    pid = host.server_pid()
    fleet.say(f"{DECAY_HOST}: baseline {baseline:.0f} tok/s; throttling llama-server (pid {pid})")
    throttled_at = time.monotonic()
    with throttled(pid, stopped=0.12, running=0.03):
        wait_until(
            lambda: host.restart_totals().get("decay", 0) > before and host.server_pid() != pid,
            EVENT_SECONDS,
            lambda: f"{DECAY_HOST} restarted for decay\n{fleet.timeline()}\n{host.up.tail() if host.up else ''}",
            poll=0.25,
        )
    fleet.say(f"{DECAY_HOST}: restarted for decay (llama-server pid {host.server_pid()})")
    fleet.wait_host_ready(DECAY_HOST)
    fleet.wait_balancer(set(fleet.hosts))
    return {
        "baseline tok/s": round(baseline),
        "decay restarts": host.restart_totals().get("decay", 0) - before,
        "seconds from throttle to restart": round(time.monotonic() - throttled_at),
        "daemon said": [line.strip() for line in host.lines_with("restarting llama-server")][-1:],
    }


def kill_server(fleet: Fleet, load: Load, monitor: ReadyMonitor) -> dict[str, Any]:
    """kill -9 of KILL_HOST's llama-server under load: HAProxy's checks take it out (1 s x fall 2), and its `up`
    starts llama-server again RestartSec= (5 s) later, as the server unit's Restart= would."""
    host = fleet.hosts[KILL_HOST]
    pid = host.server_pid()
    in_flight = fleet.server_sessions(KILL_HOST)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    fleet.say(f"{KILL_HOST}: kill -9 llama-server (pid {pid}); HAProxy had {in_flight} request(s) on it")
    fleet.wait_balancer(set(fleet.hosts) - {KILL_HOST})

    def started_again() -> bool:
        assert host.up is not None and host.up.alive(), f"{KILL_HOST}'s `up` exited:\n{fleet.timeline()}"
        return host.server_pid() != pid

    wait_until(started_again, 60, lambda: f"{KILL_HOST}'s `up` to start llama-server again\n{fleet.timeline()}")
    fleet.say(f"{KILL_HOST}: `up` started llama-server again (pid {host.server_pid()})")
    return {"_killed_at": killed_at, "in flight on it at the kill (HAProxy)": in_flight}
