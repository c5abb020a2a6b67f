"""Entry points: the health unit's daemon, the server unit's version check, the timer's idle restart,
and `llm-appliance up` (launcher and daemon together, no systemd)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from appliance.facts.gpu import Pynvml
from appliance.health import versions
from appliance.health.daemon import DaemonConfig, HealthDaemon
from appliance.health.exporter import Metrics, Readiness, serve
from appliance.health.privileges import (
    AS_CURRENT_USER,
    become,
    prepare,
    require_usable_interpreter,
    say_what_is_not_enforced,
    service_user,
)
from appliance.health.requests import DrainRequests, Reason, RestartRequests
from appliance.health.router_beside_up import RouterBesideUp
from appliance.health.state import RestartLog
from appliance.health.units import SystemdUnit, UnitError
from appliance.plan.priority import PRIORITIES
from appliance.plan.resolved import Appliance
from appliance.plan.start_limit import SERVER_START_LIMIT
from appliance.runtime.launch import Launcher, LaunchPlan
from appliance.runtime.notify import Notifier
from appliance.runtime.running import Announcement, announced
from appliance.runtime.server_api import ServerApi, ServerUnreachable, read_api_key
from appliance.system import paths

log = logging.getLogger("llm-appliance.health")


def run_daemon(appliance: Appliance) -> int:
    metrics = Metrics()
    readiness = Readiness(metrics)
    serve(metrics, appliance.exporter.host, appliance.exporter.port, readiness)
    daemon = HealthDaemon(
        DaemonConfig(appliance), SystemdUnit(paths.SERVER_UNIT), Pynvml(), metrics, readiness=readiness
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    log.info("exporting metrics on %s", appliance.exporter.url)
    return daemon.run(stop)


def check_versions(appliance: Appliance) -> int:
    """ExecStartPre of the server: refuse the start on a pin mismatch when the spec says refuse."""
    spec = appliance.spec
    found = versions.detect(Pynvml(), paths.ENGINE_DIR)
    problems = versions.mismatches(spec.versions, found)
    summary = (
        f"driver {found.driver or '-'}, CUDA {found.cuda or '-'}, {found.llama_cpp or 'llama-server: no manifest'}"
    )
    if not problems:
        log.info("versions ok: %s", summary)
        return 0
    for problem in problems:
        log.error("version mismatch: %s", problem)
    if spec.versions.on_mismatch == "refuse":
        log.error('refusing to start (versions.on_mismatch = "refuse"); fix the versions or set on_mismatch = "warn"')
        return 1
    log.warning('starting anyway (versions.on_mismatch = "warn")')
    return 0


# How long `restart` waits for a running daemon to take its request: the daemon looks every second, and a
# check under way (a canary completion, a slow /slots) may hold it for its probe timeout.
ADOPT_TIMEOUT_SECONDS = 60.0


def request_restart(state_dir: Path, reason: Reason, applied: Appliance | None) -> int:
    """What `restart` does: hand the restart to the running health daemon, which takes it its way (its turn in
    the fleet, the drain, the warm-up), under systemd and under `up` alike. With no daemon to take it, a single
    appliance still restarts when idle through systemd; a fleet member does not (its turn cannot be known)."""
    requests = RestartRequests(state_dir)
    try:
        wanted = requests.submit(reason)
    except OSError as exc:
        log.error(
            "cannot leave the restart request in %s: %s; run it as root or as %s",
            state_dir,
            exc.strerror or exc,
            paths.SERVICE_USER,
        )
        return 2
    deadline = time.monotonic() + ADOPT_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if requests.taken(wanted):
            log.info(
                "the health daemon took the %s restart: it waits its turn in the fleet, drains, restarts llama-server "
                "and warms it up (its log says when)",
                reason,
            )
            return 0
        time.sleep(0.2)
    requests.withdraw(wanted)
    if applied is None or applied.spec.fleet is not None:
        log.error(
            "no health daemon took the restart request in %.0f s (is it running? `systemctl status %s`, or the "
            "`up` whose --state-dir is %s); not restarting behind its back",
            ADOPT_TIMEOUT_SECONDS,
            paths.HEALTH_UNIT,
            state_dir,
        )
        return 3
    log.warning("no health daemon took the restart request: restarting through systemd when idle")
    return restart_when_idle(applied, reason)


def request_drain(state_dir: Path, timeout: float) -> int:
    """What `drain` (a pod's preStop) does: hand the running health daemon a drain request and wait until it says
    drained: /ready answered 503 "draining" for the fleet's drain_seconds, then no request in flight. The daemon
    stays draining (the pod is going away); 1 when `timeout` passes first, with why."""
    drains = DrainRequests(state_dir)
    try:
        ident = drains.submit()
    except OSError as exc:
        log.error(
            "cannot leave the drain request in %s: %s; run it as root or as %s",
            state_dir,
            exc.strerror,
            paths.SERVICE_USER,
        )
        return 2
    deadline = time.monotonic() + timeout
    while not drains.done(ident):
        if time.monotonic() >= deadline:
            taken = drains.taken(ident)
            drains.withdraw(ident)
            why = (
                "the health daemon is draining, requests still in flight"
                if taken
                else f"no health daemon took the request (is the `up` whose --state-dir is {state_dir} running?)"
            )
            log.error("not drained after %.0f s: %s", timeout, why)
            return 1
        time.sleep(0.2)
    log.info("drained: the health daemon answers /ready 503 draining and no request is in flight")
    return 0


def restart_when_idle(appliance: Appliance, reason: str, control: SystemdUnit | None = None) -> int:
    """Without a daemon: wait until no request is processing (idle_timeout at the latest), restart."""
    spec = appliance.spec
    api = ServerApi(
        appliance.server.url, read_api_key(appliance.api_key_file), timeout=spec.health.probe_timeout_seconds
    )
    control = control or SystemdUnit(paths.SERVER_UNIT)
    deadline = time.monotonic() + spec.restart.idle_timeout_seconds
    while time.monotonic() < deadline:
        try:
            if api.metrics().get("requests_processing", 0) == 0:
                break
        except ServerUnreachable as exc:
            log.info("server not answering (%s): restarting without waiting", exc)
            break
        time.sleep(1.0)
    else:
        log.warning("still busy after idle_timeout (%d s): restarting anyway", spec.restart.idle_timeout_seconds)
    RestartLog(appliance.state_file).append(time.time(), reason)
    try:
        control.restart(reason)
    except UnitError as exc:
        log.error("restart failed: %s", exc)
        return 3
    log.info("restarted %s (%s)", paths.SERVER_UNIT, reason)
    return 0


class LauncherControl:
    """The server as `llm-appliance up` runs it: the launcher in this process, llama-server its child."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher

    def main_pid(self) -> int | None:
        return os.getpid()

    def active(self) -> bool:
        return self.launcher.child is not None and self.launcher.child.poll() is None

    def restart(self, reason: str) -> None:
        self.launcher.request_restart()


def up(appliance: Appliance, spec: Path, stop_timeout: float, as_current_user: bool = False) -> int:
    """Launcher in the foreground, health daemon and exporter beside it; Ctrl-C stops both. Started by root, it
    becomes the service user first (unless `as_current_user`, for tests), as the units' User= would. llama-server
    is restarted when it dies, within the server unit's start limit; nothing `up` started outlives it."""
    spec = spec.absolute()  # named in its announcement; `become` changes the working directory
    dropping = os.geteuid() == 0 and not as_current_user
    who = service_user("up") if dropping else None
    if who is not None:
        require_usable_interpreter(who)  # refused here, before anything is started
    # The router holds the upstream's key: started while root can still give it a user of its own, and a keeper
    # that stays root to end it.
    router = RouterBesideUp.start(appliance, as_current_user)
    try:
        keep_priority(PRIORITIES[appliance.spec.server.priority].nice)  # as the unit's Nice=; llama-server inherits it
        if who is not None:
            ruleset = prepare(appliance, who)
            # A port below 1024 (the server's or the exporter's): the one capability, as the units grant it.
            become(who, appliance.state_file.parent, appliance.server.privileged or appliance.exporter.privileged)
            say_what_is_not_enforced(who, ruleset)
        elif os.geteuid() == 0:
            print(AS_CURRENT_USER, file=sys.stderr, flush=True)
        return _serve_up(appliance, spec, stop_timeout)
    finally:
        if router is not None:
            router.stop()


def keep_priority(nice: int) -> None:
    """The server's nice value, set while root may still lower it (server.priority; plan/priority.py)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except PermissionError:
        log.warning("cannot set nice %d as uid %d: llama-server runs at nice %d", nice, os.geteuid(), os.nice(0))


def _serve_up(appliance: Appliance, spec: Path, stop_timeout: float) -> int:
    # Where `restart` hands its requests to the daemon: there from the start, as StateDirectory= makes it.
    appliance.state_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    metrics = Metrics()
    readiness = Readiness(metrics)
    serve(metrics, appliance.exporter.host, appliance.exporter.port, readiness)
    launcher = Launcher(LaunchPlan.of(appliance), stop_timeout=stop_timeout, start_limit=SERVER_START_LIMIT)
    daemon = HealthDaemon(DaemonConfig(appliance), LauncherControl(launcher), Pynvml(), metrics, readiness=readiness)
    # The daemon's READY/STATUS must not reach the launcher's socket: one process, one notifier. It watches on
    # while the launcher restarts llama-server, and stops with the launcher.
    thread = threading.Thread(
        target=daemon.run, args=(launcher.stop_requested, Notifier(enabled=False)), daemon=True, name="health"
    )
    thread.start()
    log.info("health daemon exporting metrics on %s", appliance.exporter.url)
    # What `status` finds out that this appliance runs, and how (runtime/running.py).
    with announced(appliance.state_file.parent, Announcement(str(spec), appliance)):
        try:
            return launcher.run()
        finally:
            launcher.stop_requested.set()
            thread.join(timeout=appliance.spec.health.interval_seconds + 5)
