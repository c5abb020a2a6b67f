"""A fleet of three demo appliances behind the real HAProxy, in network namespaces on this machine.

    client/Prometheus 10.79.0.9 ──┐
    balancer (HAProxy) 10.79.0.10 ─┤
    demo-1 10.79.0.11 ─────────────┼── br0, in a namespace of its own
    demo-2 10.79.0.12 ─────────────┤
    demo-3 10.79.0.13 ─────────────┤
    upstream 10.79.0.20 ───────────┘  (the fleet's [fallback]: llama-server under another model name)

The fleet file is written here (the demo spec shared, made quick by overrides), `llm-appliance fleet render`
renders it, each host runs `llm-appliance up` on its derived spec inside its namespace (its own state
directory), and HAProxy runs the rendered haproxy.cfg in the balancer's. Every namespace, link and process
is created here and removed by `Fleet.close()`, on failure too; nothing is added to this machine's own
network namespace. Every wait ends at its event (a /ready answer, HAProxy's view, a state file); a deadline
only bounds a failure.

The test process reaches the namespaces through threads that entered the client's network namespace
(`setns` moves one thread only): the load client, the /ready monitor, the HAProxy and Prometheus queries.
Load, monitor and the scenarios that use them are in fleet_traffic.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import grp
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from appliance.ops.models import SMOLLM2

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "etc" / "llm-appliance"
INSTALLED_MODELS = "/var/lib/llm-appliance/models"  # as the examples name the models (conftest rewrites it too)
SERVICE_GROUP = "llm-appliance"

NET = "10.79.0"
CLIENT = f"{NET}.9"  # the load client and Prometheus
BALANCER = f"{NET}.10"
HOSTS = {"demo-1": f"{NET}.11", "demo-2": f"{NET}.12", "demo-3": f"{NET}.13"}
UPSTREAM = f"{NET}.20"  # the fleet's fallback, started only by the test of it (start_fallback)
UPSTREAM_PORT, UPSTREAM_MODEL = 8000, "upstream-model"
ROUTER_PORT = 8100  # the router on the balancer, in front of HAProxy
ROUTER_START_SECONDS = 300.0  # LiteLLM imports for a while on a busy 2-core box
API_PORT, STATS_PORT = 8000, 8404  # the balancer's (fleet file defaults)
SERVER_PORT, EXPORTER_PORT = 8080, 9478  # each host's (demo.toml)
PROMETHEUS_PORT = 9090  # on the client namespace's loopback
BACKEND = "llm-appliance"  # the rendered backend's name
API_KEY = "fleet-netns-key"
FLEET_KEY = "fleet-netns-shared-fleet-key"  # the hosts prove their /ready with it
SPEC = "demo.toml"
# The host whose decay detector is made quick: the others never decay or hang-restart on a busy 2-core box.
DECAY_HOST = "demo-3"
MIN_READY = 2
CHECK_SECONDS = 1  # the daemons' checks, HAProxy's checks, Prometheus's scrapes and rule evaluations
# How long a cold `up` may take (validate, model load, warm-up) on a loaded 2-core box; only a failure waits it.
START_SECONDS = 120.0
TOOLS = ("ip", "haproxy", "prometheus")
CLONE_NEWNET = 0x40000000

T = TypeVar("T")


class FleetError(Exception):
    """The fleet did not do what was waited for; the message carries the timeline and the logs' tails."""


def tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")


def child_env(**extra: str) -> dict[str, str]:
    """The environment of every command the fleet runs: this checkout's `appliance` first on the path."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def missing_tools() -> list[str]:
    return [name for name in TOOLS if tool(name) is None]


def _tool(name: str) -> str:
    found = tool(name)
    if found is None:
        raise FleetError(f"{name} is not installed")
    return found


# The host the decay scenario throttles: a breach is the median of 5 windows below half its baseline, twice.
# The test's hosts share this machine (namespaces, one kernel): each one's neighbours are the others, which
# a real fleet's hosts are not. Contention is not judged here (1: never), so the throttle's decay is seen.
DECAY_OVERRIDES = (
    "[hosts.overrides.health]\ndecay_ratio = 0.5\nconsecutive = 2\nbaseline_windows = 3\ncontention_max_share = 1.0\n"
)


def fleet_toml(keys: Path, targets_dir: Path, fleet_key: Path) -> str:
    """Three demo hosts, quick: 1 s checks everywhere, a 3 s drain (HAProxy's 1 s x fall 2, plus one)."""
    hosts = "".join(
        f'\n[[hosts]]\nname = "{name}"\naddress = "{address}"\n' + (DECAY_OVERRIDES if name == DECAY_HOST else "")
        for name, address in HOSTS.items()
    )
    return f"""# Written by tests/fleet_netns.py: the demo fleet, quick.
[fleet]
name = "demo"
spec = "{SPEC}"
key_file = "{fleet_key}"

[fleet.overrides.server]
api_key_file = "{keys}"
threads = 1               # three servers on two cores
ctx_size = 1024

[fleet.overrides.health]
interval_seconds = {CHECK_SECONDS}
consecutive = 100         # no decay or hang restart from a busy 2-core box's noise ({DECAY_HOST} aside)
canary_after_idle_seconds = 0

[fleet.overrides.restart]
cooldown_seconds = 5
idle_timeout_seconds = 30
max_per_hour = 30

[fleet.overrides.prometheus]
scrape_interval_seconds = {CHECK_SECONDS}

[balancer]
address = "{BALANCER}"
port = {API_PORT}
stats_port = {STATS_PORT}
check_interval_seconds = {CHECK_SECONDS}
fall = 2
rise = 2

[rules]
min_ready = {MIN_READY}
below_min_ready_alert_seconds = 0

[prometheus]
address = "{CLIENT}"
files_dir = "{targets_dir}"

[fallback]
base_url = "http://{UPSTREAM}:{UPSTREAM_PORT}/v1"
model = "{UPSTREAM_MODEL}"
port = {ROUTER_PORT}
cooldown_seconds = 2
{hosts}"""


# --- namespaces ------------------------------------------------------------------------------------------


def enter_netns(name: str) -> None:
    """Move the calling thread, and only it, into the named network namespace: the sockets it opens live there."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns = getattr(os, "setns", None)  # Python 3.12
        if setns is not None:
            setns(fd, CLONE_NEWNET)
        else:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, CLONE_NEWNET) != 0:
                error = ctypes.get_errno()
                raise OSError(error, f"setns into {name}: {os.strerror(error)}")
    finally:
        os.close(fd)


class Netns:
    """A network namespace the test process reaches through threads of its own inside it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._pool: ThreadPoolExecutor | None = None

    def call(self, fn: Callable[..., T], *args: Any, timeout: float = 30.0) -> T:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(4, f"netns-{self.name}", initializer=enter_netns, initargs=(self.name,))
        return self._pool.submit(fn, *args).result(timeout)

    def thread(self, target: Callable[[], None], name: str) -> threading.Thread:
        """A daemon thread running `target` inside the namespace."""

        def run() -> None:
            enter_netns(self.name)
            target()

        return threading.Thread(target=run, name=name, daemon=True)

    def argv(self, *argv: str | Path) -> list[str]:
        return [_tool("ip"), "netns", "exec", self.name, *map(str, argv)]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def http_get(url: str, timeout: float = 2.0, data: bytes | None = None) -> tuple[int, str]:
    """(status, body) of one request; status 0 with the error when nothing answered. No proxy from the environment."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, data)
    try:
        with opener.open(request, timeout=timeout) as response:
            return int(response.status), response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode(errors="replace")
    except (OSError, ValueError) as exc:  # URLError, refused, reset, timeout
        return 0, str(exc)


# --- processes -------------------------------------------------------------------------------------------


@dataclass
class Started:
    """A process of the fleet, its output collected line by line (and written to its log)."""

    name: str
    process: subprocess.Popen[str]
    log: Path
    lines: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, name: str, argv: list[str], log: Path) -> Started:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=child_env(PYTHONUNBUFFERED="1"),
            cwd=REPO,
            start_new_session=True,  # a Ctrl-C of the benchmark reaches close(), which stops these in order
        )
        started = cls(name, process, log)
        threading.Thread(target=started._collect, daemon=True, name=f"output-{name}").start()
        return started

    def _collect(self) -> None:
        assert self.process.stdout is not None
        with self.log.open("a") as log:
            for line in self.process.stdout:
                self.lines.append(line)
                log.write(line)
                log.flush()

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, count: int = 30) -> str:
        return "".join(self.lines[-count:])

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (a stopped process resumed first), SIGKILL after `timeout`; the exit code."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


@dataclass
class Host:
    name: str
    address: str
    netns: Netns
    spec: Path  # its derived spec, as `fleet render` wrote it
    state_dir: Path
    up: Started | None = None
    runs: int = 0

    @property
    def ready_url(self) -> str:
        return f"http://{self.address}:{EXPORTER_PORT}/ready"

    @property
    def state_file(self) -> Path:
        return self.state_dir / "health-state.json"

    def restart_totals(self) -> dict[str, int]:
        """The daemon's restart history by reason ({} before the first restart)."""
        try:
            totals = json.loads(self.state_file.read_text()).get("totals", {})
        except (OSError, ValueError):
            return {}
        return {str(k): int(v) for k, v in totals.items()}

    def server_pids(self) -> list[int]:
        """llama-server's pids, in start order, as this run of `up` logged them."""
        lines = list(self.up.lines) if self.up else []
        return [int(m.group(1)) for line in lines if (m := re.search(r"started llama-server \(pid (\d+)\)", line))]

    def server_pid(self) -> int:
        pids = self.server_pids()
        if not pids:
            raise FleetError(f"{self.name}: `up` has not started llama-server")
        return pids[-1]

    def lines_with(self, text: str) -> list[str]:
        return [line for line in list(self.up.lines if self.up else []) if text in line]


def wait_until(condition: Callable[[], bool], seconds: float, what: str | Callable[[], str], poll: float = 0.1) -> None:
    """Poll `condition` until it holds; FleetError when `seconds` pass first (only a failure waits that long)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise FleetError(f"timed out after {seconds:.0f} s waiting for {what() if callable(what) else what}")
        time.sleep(poll)


# --- HAProxy's view --------------------------------------------------------------------------------------


Sample = tuple[str, dict[str, str], float]
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_exposition(text: str) -> list[Sample]:
    found: list[Sample] = []
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match and not line.startswith("#"):
            with contextlib.suppress(ValueError):
                found.append((match.group(1), dict(LABEL.findall(match.group(2) or "")), float(match.group(3))))
    return found


@dataclass(frozen=True)
class HaproxyCounters:
    """HAProxy's own counts for the backend: connection retries, redispatches, connection errors by server."""

    retries: float = 0.0
    redispatches: float = 0.0
    connection_errors: tuple[tuple[str, float], ...] = ()

    def __sub__(self, other: HaproxyCounters) -> HaproxyCounters:
        before = dict(other.connection_errors)
        return HaproxyCounters(
            self.retries - other.retries,
            self.redispatches - other.redispatches,
            tuple((server, value - before.get(server, 0.0)) for server, value in self.connection_errors),
        )


# --- the fleet -------------------------------------------------------------------------------------------


class Fleet:
    """The fleet, started by `start()` (or `with Fleet(...) as fleet:`), removed by `close()`."""

    def __init__(self, work: Path, models: Path, prefix: str | None = None) -> None:
        self.work, self.models = work, models
        self.prefix = prefix or f"lfl{os.getpid()}"
        self.out, self.logs = work / "out", work / "logs"
        self.bridge = f"{self.prefix}-br"
        self.client = Netns(f"{self.prefix}-client")
        self.balancer = Netns(f"{self.prefix}-lb")
        self.upstream = Netns(f"{self.prefix}-up")
        self.hosts = {
            name: Host(
                name,
                address,
                Netns(f"{self.prefix}-{name}"),
                self.out / "hosts" / name / "etc" / "llm-appliance" / SPEC,
                work / "state" / name,
            )
            for name, address in HOSTS.items()
        }
        self.created: list[str] = []  # namespaces, in creation order
        self.processes: list[Started] = []
        self.haproxy: Started | None = None
        self.started = time.monotonic()
        self.events: list[str] = []

    def __enter__(self) -> Fleet:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def say(self, what: str) -> None:
        """One line of the timeline: printed (pytest -s shows it) and kept for failure messages."""
        # The wall clock too: HAProxy's and the hosts' logs carry it.
        now = time.time()
        clock = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
        line = f"{time.monotonic() - self.started:7.1f} s {clock}  {what}"
        self.events.append(line)
        print(line, flush=True)

    def timeline(self, last: int = 40) -> str:
        return "\n".join(self.events[-last:])

    # -- set-up --

    def start(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        self._write_fleet()
        self._render()
        self._network()
        for host in self.hosts.values():
            self.start_host(host.name, wait=False)
        self._start_haproxy()
        for host in self.hosts.values():
            self.wait_host_ready(host.name)
        self.wait_balancer(set(self.hosts))
        self.say("fleet ready: 3 hosts /ready 200, HAProxy has all 3 UP")

    def _write_fleet(self) -> None:
        # The key file as README says: root:llm-appliance 0640, in directories the service user may enter
        # (validate checks it as the server would read it): `work` must not be in a 0700 directory.
        keys = self.work / "keys"
        keys.mkdir(mode=0o755, exist_ok=True)
        keys.chmod(0o755)
        key_file = keys / "api-keys"
        key_file.write_text(f"{API_KEY}\n")
        with contextlib.suppress(KeyError):
            os.chown(key_file, 0, grp.getgrnam(SERVICE_GROUP).gr_gid)
        key_file.chmod(0o640)
        fleet_key = keys / "fleet-key"
        fleet_key.write_text(f"{FLEET_KEY}\n")
        with contextlib.suppress(KeyError):
            os.chown(fleet_key, 0, grp.getgrnam(SERVICE_GROUP).gr_gid)
        fleet_key.chmod(0o640)
        spec = (EXAMPLES / SPEC).read_text().replace(INSTALLED_MODELS, str(self.models))
        (self.work / SPEC).write_text(spec)
        (self.work / "fleet.toml").write_text(fleet_toml(key_file, self.out / "prometheus" / "targets", fleet_key))

    def _render(self) -> None:
        argv = [sys.executable, "-m", "appliance.cli.main", "fleet", "render", str(self.work / "fleet.toml")]
        result = subprocess.run(
            [*argv, "--out", str(self.out)], capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=120
        )
        (self.logs / "render.log").write_text(result.stdout + result.stderr)
        if result.returncode != 0:
            raise FleetError(f"fleet render failed ({result.returncode}):\n{result.stdout}{result.stderr}")
        self.say(f"fleet render: {result.stdout.strip().splitlines()[-1] if result.stdout.strip() else 'done'}")

    def _ip(self, *args: str) -> None:
        result = subprocess.run([_tool("ip"), *args], capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            raise FleetError(f"ip {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")

    def _network(self) -> None:
        """A bridge in a namespace of its own; each member's eth0 joined to it by a veth created inside the two
        namespaces (nothing in this machine's own namespace)."""
        members = [(self.client.name, "v-client", CLIENT), (self.balancer.name, "v-lb", BALANCER)]
        members += [(h.netns.name, f"v-{h.name}", h.address) for h in self.hosts.values()]
        members += [(self.upstream.name, "v-up", UPSTREAM)]
        for ns in [self.bridge, *(m[0] for m in members)]:
            self._ip("netns", "add", ns)
            self.created.append(ns)
            self._ip("-n", ns, "link", "set", "lo", "up")
        self._ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.bridge, "link", "set", "br0", "up")
        for ns, port, address in members:
            self._ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.bridge)
            self._ip("-n", self.bridge, "link", "set", port, "master", "br0")
            self._ip("-n", self.bridge, "link", "set", port, "up")
            self._ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            self._ip("-n", ns, "link", "set", "eth0", "up")
        self.say(f"namespaces {', '.join(self.created)} joined by {self.bridge}/br0")

    def _start_haproxy(self) -> None:
        cfg = self.out / "balancer" / "etc" / "haproxy" / "haproxy.cfg"
        # The rendered `log /dev/log` needs a syslog daemon; this machine has none. The harness adds its own
        # log target, HAProxy's stdout, in a global section of its own (the rendered file is used unchanged).
        logging = self.work / "harness-log.cfg"
        logging.write_text(
            "# tests/fleet_netns.py: HAProxy's request log on its stdout, beside the rendered log target\n"
            "global\n    log stdout format raw local0 info\n"
        )
        haproxy = _tool("haproxy")
        check = subprocess.run(
            [haproxy, "-c", "-f", str(logging), "-f", str(cfg)], capture_output=True, text=True, timeout=30
        )
        if check.returncode != 0:
            raise FleetError(f"haproxy -c refuses the rendered config:\n{check.stdout}{check.stderr}")
        self.haproxy = Started.start(
            "haproxy", self.balancer.argv(haproxy, "-db", "-f", logging, "-f", cfg), self.logs / "haproxy.log"
        )
        self.processes.append(self.haproxy)
        self.say(f"haproxy started in {self.balancer.name} (pid {self.haproxy.pid})")

    def start_fallback(self, engine: Path) -> None:
        """The fleet's [fallback] for real: the upstream (the demo model as UPSTREAM_MODEL) in its namespace, and
        the router on the balancer, from the files `fleet render` wrote for it, as its unit runs it."""
        model = self.models / SMOLLM2
        argv = [
            "env",
            f"LD_LIBRARY_PATH={engine.parent}",
            engine,
            "-m",
            model,
            "--host",
            UPSTREAM,
            "--port",
            str(UPSTREAM_PORT),
            "--alias",
            UPSTREAM_MODEL,
        ]
        upstream = Started.start(
            "upstream",
            self.upstream.argv(*argv, "-c", "2048", "-t", "1", "--log-verbosity", "2"),
            self.logs / "upstream.log",
        )
        self.processes.append(upstream)
        config_dir = self.out / "balancer" / "etc" / "llm-appliance" / "rendered" / "router"
        command = ("-m", "appliance.cli.main", "router", "--config-dir", config_dir, "--as-current-user")
        router = Started.start("router", self.balancer.argv(sys.executable, *command), self.logs / "router.log")
        self.processes.append(router)
        for started, url, seconds in (
            (upstream, f"http://{UPSTREAM}:{UPSTREAM_PORT}/health", START_SECONDS),
            (router, f"http://{BALANCER}:{ROUTER_PORT}/health/liveliness", ROUTER_START_SECONDS),
        ):

            def answers(started: Started = started, url: str = url) -> bool:
                if not started.alive():
                    raise FleetError(f"{started.name} exited:\n{started.tail()}")
                return self.client.call(http_get, url, 2.0, timeout=10)[0] == 200

            wait_until(answers, seconds, lambda url=url: f"{url} to answer 200\n{self.timeline()}")  # type: ignore[misc]
            self.say(f"{started.name}: {url} answers")

    # -- hosts --

    def start_host(self, name: str, wait: bool = True) -> None:
        host = self.hosts[name]
        host.state_dir.mkdir(parents=True, exist_ok=True)
        host.runs += 1
        argv = host.netns.argv(
            sys.executable,
            "-m",
            "appliance.cli.main",
            "up",
            host.spec,
            "--state-dir",
            host.state_dir,
            "--as-current-user",
            "--stop-timeout",
            "5",
        )
        host.up = Started.start(f"up-{name}", argv, self.logs / f"{name}.log")
        self.processes.append(host.up)
        self.say(f"{name}: `up` started (pid {host.up.pid}, run {host.runs})")
        if wait:
            self.wait_host_ready(name)

    def stop_host(self, name: str) -> int | None:
        host = self.hosts[name]
        code = host.up.stop() if host.up else None
        self.say(f"{name}: `up` stopped (exit {code})")
        return code

    def ready(self, name: str, timeout: float = 1.0) -> bool:
        status, _ = self.client.call(http_get, self.hosts[name].ready_url, timeout, timeout=timeout + 5)
        return status == 200

    def ready_body(self, name: str) -> str:
        status, body = self.client.call(http_get, self.hosts[name].ready_url, 1.0, timeout=6)
        return f"{status} {body.strip()}"

    def wait_host_ready(self, name: str, seconds: float = START_SECONDS, quiet: bool = False) -> None:
        host = self.hosts[name]

        def ready() -> bool:
            if host.up is None or not host.up.alive():
                raise FleetError(f"{name}: `up` exited:\n{host.up.tail(40) if host.up else ''}\n{self.timeline()}")
            return self.ready(name)

        wait_until(
            ready, seconds, lambda: f"{name}'s /ready to answer 200 ({self.ready_body(name)})\n{self.timeline()}"
        )
        if not quiet:
            self.say(f"{name}: /ready 200 (llama-server pid {host.server_pid()})")

    def ensure_whole(self) -> None:
        """Every host's `up` running and ready, HAProxy with all of them UP: a scenario that stopped one restores it."""
        stopped = [h.name for h in self.hosts.values() if h.up is None or not h.up.alive()]
        for name in stopped:
            self.start_host(name, wait=False)
        for name in self.hosts:
            self.wait_host_ready(name, quiet=name not in stopped)
        self.wait_balancer(set(self.hosts), quiet=not stopped)

    # -- HAProxy --

    def haproxy_metrics(self) -> list[Sample]:
        if self.haproxy is None or not self.haproxy.alive():
            raise FleetError(f"haproxy is not running:\n{self.haproxy.tail() if self.haproxy else ''}")
        status, body = self.client.call(http_get, f"http://{BALANCER}:{STATS_PORT}/metrics", 5.0, timeout=10)
        if status != 200:
            raise FleetError(f"HAProxy's /metrics answered {status}: {body[:300]}")
        return parse_exposition(body)

    def servers_up(self) -> set[str]:
        """The backend's servers HAProxy has UP (its checks of /ready passed `rise` times)."""
        return {
            labels["server"]
            for name, labels, value in self.haproxy_metrics()
            if name == "haproxy_server_status"
            and labels.get("proxy") == BACKEND
            and labels.get("state", "UP") == "UP"
            and value == 1
        }

    def server_sessions(self, server: str) -> int:
        """Requests HAProxy has on this server now."""
        for name, labels, value in self.haproxy_metrics():
            if name == "haproxy_server_current_sessions" and labels.get("server") == server:
                return int(value)
        return 0

    def counters(self) -> HaproxyCounters:
        samples = self.haproxy_metrics()

        def backend(metric: str) -> float:
            return sum(v for n, labels, v in samples if n == metric and labels.get("proxy") == BACKEND)

        errors = tuple(
            (labels["server"], v)
            for n, labels, v in samples
            if n == "haproxy_server_connection_errors_total" and labels.get("proxy") == BACKEND
        )
        return HaproxyCounters(
            backend("haproxy_backend_retry_warnings_total"),
            backend("haproxy_backend_redispatch_warnings_total"),
            errors,
        )

    def wait_balancer(self, up: set[str], seconds: float = 60.0, quiet: bool = False) -> None:
        """Until HAProxy has exactly these servers UP."""
        wait_until(
            lambda: self.servers_up() == up,
            seconds,
            lambda: f"HAProxy to have {sorted(up)} UP (has {sorted(self.servers_up())})\n{self.timeline()}",
            poll=0.2,
        )
        if not quiet:
            self.say(f"HAProxy: {', '.join(sorted(up)) or 'no server'} UP")

    def haproxy_log(self, text: str = "") -> list[str]:
        return [line for line in list(self.haproxy.lines if self.haproxy else []) if text in line]

    # -- the rest --

    def run_in(self, name: str, *argv: str | Path, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """A command in a host's namespace, with this checkout's `appliance` importable."""
        return subprocess.run(
            self.hosts[name].netns.argv(*argv),
            capture_output=True,
            text=True,
            env=child_env(),
            cwd=REPO,
            timeout=timeout,
        )

    def close(self) -> None:
        """Stop every process (resumed first, if stopped), then delete the namespaces (their links go with them)."""
        for started in reversed(self.processes):
            started.stop(timeout=15)
        ip = tool("ip")
        for ns in reversed(self.created):
            # Anything still inside a namespace of ours was started by this fleet (llama-server orphans).
            if ip is not None:
                pids = subprocess.run([ip, "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout
                for pid in pids.split():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
                subprocess.run([ip, "netns", "delete", ns], capture_output=True, text=True, timeout=30)
        self.created.clear()
        for netns in [self.client, self.balancer, self.upstream, *(h.netns for h in self.hosts.values())]:
            netns.close()


class Prometheus:
    """A real Prometheus in the client's namespace: the rendered scrape jobs and rules (the fleet's and each
    host's), targets from the rendered file_sd files; scrapes and rule evaluations every CHECK_SECONDS."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        directory = fleet.work / "prometheus"
        directory.mkdir(exist_ok=True)
        rendered = fleet.out / "prometheus"
        jobs = "".join(
            f"  {line}\n"
            for line in (rendered / "scrape.yml").read_text().splitlines()
            if line.strip() and not line.startswith("#")
        )
        rules = "".join(f"  - {path}\n" for path in sorted((rendered / "rules").glob("*.yml")))
        self.config = directory / "prometheus.yml"
        self.config.write_text(
            f"global:\n  scrape_interval: {CHECK_SECONDS}s\n  evaluation_interval: {CHECK_SECONDS}s\n"
            f"rule_files:\n{rules}scrape_configs:\n{jobs}"
        )
        argv = fleet.client.argv(
            _tool("prometheus"),
            f"--config.file={self.config}",
            f"--storage.tsdb.path={directory / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{PROMETHEUS_PORT}",
            "--log.level=warn",
        )
        self.process = Started.start("prometheus", argv, fleet.logs / "prometheus.log")
        fleet.processes.append(self.process)
        fleet.say(f"prometheus started in {fleet.client.name} (pid {self.process.pid})")

    def get(self, path: str, **params: str) -> Any:
        if not self.process.alive():
            raise FleetError(f"prometheus exited:\n{self.process.tail()}")
        url = f"http://127.0.0.1:{PROMETHEUS_PORT}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        status, body = self.fleet.client.call(http_get, url, 5.0, timeout=10)
        if status != 200:
            raise FleetError(f"prometheus {path} answered {status}: {body[:300]}")
        return json.loads(body)["data"] if path.startswith("/api/") else body

    def ready(self) -> bool:
        try:
            self.get("/-/ready")
            return True
        except FleetError:
            if not self.process.alive():
                raise
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/query", query=expr)["result"])

    def targets_up(self) -> set[tuple[str, str]]:
        """(job, host) of every active target whose last scrape succeeded."""
        active = self.get("/api/v1/targets", state="active")["activeTargets"]
        return {(t["labels"]["job"], t["labels"].get("host", "")) for t in active if t["health"] == "up"}

    def alerts(self, name: str) -> list[dict[str, Any]]:
        """Active alerts of this name (pending or firing); a resolved alert is no longer listed."""
        return [a for a in self.get("/api/v1/alerts")["alerts"] if a["labels"]["alertname"] == name]

    def firing(self, name: str) -> list[dict[str, Any]]:
        return [a for a in self.alerts(name) if a["state"] == "firing"]

    def stop(self) -> None:
        self.process.stop()


@contextlib.contextmanager
def running_fleet(work: Path, models: Path) -> Iterator[Fleet]:
    with Fleet(work, models) as fleet:
        yield fleet
