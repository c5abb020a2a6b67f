"""The appliance spec as written by the user: one TOML file, modelled strictly (unknown keys rejected).

Every field has a default that suits the single-GPU example, so a spec states only what differs.
Checks that need more than one field, or the model files, live in `validate.py` and `plan.py`.
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    Field,
    field_validator,
    model_validator,
)

from appliance.spec.address import bracketed, http_url, is_ipv6, is_loopback
from appliance.spec.base import (
    DEFAULT_BINARY,
    DEVICE_NAME,
    Address,
    Alias,
    CacheType,
    FilePath,
    GpuLayers,
    Line,
    LogLevel,
    Strict,
    _one_line,
)
from appliance.spec.fallback import Fallback
from appliance.spec.speculative import Speculative, Tuning
from appliance.system import paths


class Sampling(Strict):
    """Server-wide sampling defaults; a request may still override them."""

    temperature: Annotated[float, Field(ge=0.0, le=5.0)] = 0.6
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 0.95
    top_k: Annotated[int, Field(ge=0, le=1000)] = 20
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    repeat_penalty: Annotated[float, Field(ge=0.0, le=5.0)] = 1.0
    seed: int | None = None


FLAG_NAME = re.compile(r"^--?[A-Za-z][A-Za-z0-9-]*$")


def _flag_name(value: str) -> str:
    if not FLAG_NAME.fullmatch(value):
        raise ValueError(
            f'{value!r} is not a llama-server flag\'s name; write the flag alone, e.g. "--lora" (no value)'
        )
    return value


class Server(Strict):
    binary: Line = DEFAULT_BINARY
    host: Address = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 8080
    # The model's name in the API (/v1/models, every response): what a client sends as `model`. Default: the
    # target's GGUF general.name, else its file stem (resolved in plan/plan.py).
    alias: Alias | None = None
    api_key_file: FilePath | None = None
    # Web pages (origins) a browser may let read the API; none by default (see _origins).
    cors_origins: list[str] = []
    parallel: Annotated[int, Field(ge=1, le=256)] = 1
    threads: Annotated[int, Field(ge=0, le=1024)] = 0
    ctx_size: Annotated[int, Field(ge=256, le=4_194_304)] = 8192
    batch_size: Annotated[int, Field(ge=32, le=65536)] = 2048
    ubatch_size: Annotated[int, Field(ge=32, le=65536)] = 512
    flash_attn: Literal["auto", "on", "off"] = "auto"
    load_mode: Literal["auto", "none", "mmap", "mlock", "mmap+mlock", "dio"] = "mmap"
    sampling: Sampling = Sampling()
    # llama-server's own log threshold. "warning": the journal keeps its warnings and errors, not the ~8 info
    # lines it writes per request (timings, slot selection); "info" brings those back when debugging.
    log_level: LogLevel = "warning"
    # How much of the machine the server keeps beside a busy neighbour (plan/priority.py): "high" (Nice=-10,
    # CPUWeight=1000), "normal", or "low" for a box where the model is the background job.
    priority: Literal["high", "normal", "low"] = "high"
    # More llama-server flags, each checked (plan/extra_args.py): one that opens the server to its clients or
    # the network is refused; one whose meaning llm-appliance does not know passes only when listed in
    # extra_args_unchecked, the spec author's word that it is harmless.
    extra_args: list[Line] = []
    extra_args_unchecked: list[Annotated[str, AfterValidator(_flag_name)]] = []

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        # llama-server sends --cors-origins verbatim as Access-Control-Allow-Origin (an empty value grants
        # no one), and a browser grants only the origin it serialises byte for byte: one, in canonical form.
        for origin in value:
            canonical = canonical_origin(origin)
            if canonical is None:
                raise ValueError(
                    f"{origin!r} is not a web origin; write the one origin of the web UI that calls the API, "
                    "scheme://host[:port], e.g. https://ui.example:8443 (no wildcard: any web page in a browser "
                    "could then read the API)"
                )
            if canonical != origin:
                raise ValueError(f"{origin!r} is never sent by a browser as an Origin; write it as {canonical!r}")
        if len(value) > 1:
            raise ValueError(
                "llama-server sends its CORS origins verbatim as one Access-Control-Allow-Origin header, and "
                "browsers refuse a list there (it would grant no one); list one origin, or serve the UIs from one "
                "origin through a reverse proxy"
            )
        return value

    @property
    def slot_ctx(self) -> int:
        """llama-server divides ctx_size evenly among the slots."""
        return self.ctx_size // self.parallel

    @property
    def host_is_loopback(self) -> bool:
        return is_loopback(self.host)


def canonical_origin(text: str) -> str | None:
    """`text` as a browser serialises an origin (lower case, no default port, no path), or None when it is none."""
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port
    except ValueError:
        return None
    scheme, host = parts.scheme.lower(), parts.hostname
    if scheme not in ("http", "https") or not host or parts.username is not None or parts.password is not None:
        return None
    if parts.path not in ("", "/") or parts.query or parts.fragment or text.endswith(("?", "#")):
        return None
    if not re.fullmatch(r"[a-z0-9.-]+|[0-9a-f:.]+", host) or host.startswith(".") or ".." in host:
        return None
    if is_ipv6(host):
        try:
            host = bracketed(ipaddress.IPv6Address(host).compressed)
        except ValueError:
            return None
    default = {"http": 80, "https": 443}[scheme]
    return f"{scheme}://{host}" + (f":{port}" if port is not None and port != default else "")


class Model(Strict):
    path: FilePath
    gpu_layers: GpuLayers = "all"
    devices: list[str] = []
    cache_type_k: CacheType = "f16"
    cache_type_v: CacheType = "f16"

    @field_validator("devices")
    @classmethod
    def _device_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not DEVICE_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a llama.cpp device name; use names like CUDA0, CUDA1 or none")
        return value


class Models(Strict):
    target: Model
    draft: Model | None = None


class Memory(Strict):
    gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=1.0)] = 0.95
    # A margin on top of the estimated compute buffers (plan/compute.py), per GPU and once for the host: the
    # estimate is calibrated on llama-server's log (never below it), and the CUDA context itself sits in the
    # (1 - gpu_memory_utilization) share, so a small margin is enough.
    compute_headroom_mib: Annotated[int, Field(ge=0, le=1_048_576)] = 256
    # Totals for machines where NVML cannot tell (and for tests): {"CUDA0" = 24576}.
    device_total_mib: dict[str, Annotated[int, Field(gt=0, le=16_777_216)]] = {}
    # The share of the machine's RAM the server may plan to use: the OS, the page cache of everything else,
    # the health daemon and sshd need the rest.
    host_memory_utilization: Annotated[float, Field(gt=0.0, le=1.0)] = 0.9
    # The machine's RAM where /proc/meminfo cannot tell (and for tests); MiB.
    host_total_mib: Annotated[int, Field(gt=0, le=1_073_741_824)] | None = None


class Network(Strict):
    allow: list[str] = ["127.0.0.0/8", "::1/128"]
    egress: Literal["deny", "allow"] = "deny"
    # Private code: nothing leaves this machine, ever. No [fallback] may be rendered, and egress stays "deny".
    private: bool = False

    @field_validator("allow")
    @classmethod
    def _cidrs(cls, value: list[str]) -> list[str]:
        for cidr in value:
            try:
                if "%" in cidr:  # an IPv6 zone: systemd's IPAddressAllow= and nft take none
                    raise ValueError("a zone (%) has no place in a network")
                ipaddress.ip_network(cidr, strict=True)
            except ValueError as exc:
                raise ValueError(f"{cidr!r} is not a network in CIDR form ({exc}); write e.g. 192.168.1.0/24") from None
        return value


class Health(Strict):
    interval_seconds: Annotated[int, Field(ge=1, le=3600)] = 30
    probe_timeout_seconds: Annotated[float, Field(gt=0, le=600)] = 5.0
    watchdog_seconds: Annotated[int, Field(ge=0, le=3600)] = 120
    decay_ratio: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.8
    consecutive: Annotated[int, Field(ge=1, le=100)] = 3
    baseline_windows: Annotated[int, Field(ge=1, le=100)] = 5
    creep_ratio: Annotated[float, Field(gt=0.0, le=10.0)] = 0.15
    min_free_mib: Annotated[int, Field(ge=0)] = 512
    acceptance_min: Annotated[float, Field(ge=0.0, le=1.0)] = 0.4
    # Decode with speculation over decode without it (the baseline file's no_speculation_tps), per bucket;
    # below this, speculation costs more than it saves (LlmApplianceSpeculationNotPaying).
    speculation_min_speedup: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    canary_after_idle_seconds: Annotated[int, Field(ge=0)] = 900
    # A decode sample taken while other processes used more than this share of the CPUs (and kept the server
    # waiting for one as long), or of the server's GPUs, is contended: it does not count toward decay. 1: never.
    contention_max_share: Annotated[float, Field(gt=0.0, le=1.0)] = 0.2
    # /ready says "saturated" (503) while every slot is busy and more requests than this wait for one: a
    # balancer or a router then sends new requests elsewhere before their first byte, rather than into a queue.
    ready_max_queued: Annotated[int, Field(ge=0, le=100_000)] = 0
    # How much slower the engine may decode the proof's prompt after a change of its fingerprint (driver, kernel,
    # build, CPU) before LlmApplianceEngineRegressed fires: 0.1 = below 0.9x of the figure before the change.
    engine_regression: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.1
    baseline_file: FilePath = paths.BASELINE


class Restart(Strict):
    cooldown_seconds: Annotated[int, Field(ge=0, le=86400)] = 600
    max_per_hour: Annotated[int, Field(ge=0, le=60)] = 3
    idle_timeout_seconds: Annotated[int, Field(ge=0, le=86400)] = 300
    schedule: Line = "*-*-* 04:00:00"
    randomized_delay_seconds: Annotated[int, Field(ge=0, le=86400)] = 0

    @field_validator("schedule")
    @classmethod
    def _calendar_text(cls, value: str) -> str:
        # systemd expands %-specifiers in OnCalendar=; no calendar expression has one. The expression itself is
        # checked by systemd's own parser in validate (plan/sandbox.py).
        if not value.strip() or "%" in value:
            raise ValueError("must be one systemd OnCalendar expression, e.g. '*-*-* 04:00:00' or 'daily'")
        return value


class Versions(Strict):
    driver: Line = ""
    cuda: Line = ""
    llama_cpp: Line = ""
    on_mismatch: Literal["refuse", "warn"] = "warn"


AlertFor = Annotated[int, Field(ge=0, le=604_800)]


class AlertForSeconds(Strict):
    """How long each alert's condition must hold before it fires (the rule's `for:`), in seconds."""

    server_down: AlertFor = 900  # longer than a model load (the server unit allows 15 minutes to start)
    decode_decay: AlertFor = 600
    vram_creep: AlertFor = 900
    gpu_headroom_low: AlertFor = 600
    speculation_not_engaged: AlertFor = 900
    acceptance_low: AlertFor = 1800
    speculation_not_paying: AlertFor = 1800
    box_shared: AlertFor = 1800
    version_mismatch: AlertFor = 60
    version_drift: AlertFor = 60
    engine_regressed: AlertFor = 60
    restart_budget_exhausted: AlertFor = 60
    restarts_frequent: AlertFor = 300
    health_daemon_down: AlertFor = 300


# Labels the rendered rules and scrape jobs set themselves; `instance` may be overridden on purpose.
RESERVED_LABELS = ("job", "severity", "alertname")


class Prometheus(Strict):
    host: Address = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 9478
    labels: dict[str, str] = {}
    scrape_interval_seconds: Annotated[int, Field(ge=1, le=3600)] = 15
    # The one key the llama-server scrape job sends (one line of server.api_key_file): Prometheus sends a
    # credentials file whole, as one bearer token. Required when server.api_key_file holds several keys.
    scrape_key_file: FilePath | None = None
    alert_for_seconds: AlertForSeconds = AlertForSeconds()

    @field_validator("labels")
    @classmethod
    def _label_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", name) or name.startswith("__"):
                raise ValueError(f"{name!r} is not a Prometheus label name; use letters, digits and _")
            if name in RESERVED_LABELS:
                raise ValueError(f"{name!r} is set by the rendered rules and scrape jobs; choose another label name")
        return value


HOST_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


def _ready_url(value: str) -> str:
    # The host goes bare into the ruleset (the daemon's egress to its peers): an address or a DNS name, and
    # nothing else, so no text of a URL can close a rule and open another.
    url = http_url(value)
    if url is None or url.scheme != "http" or url.path != "/ready":
        raise ValueError(
            f"{value!r} is not a peer's /ready URL; write http://ADDRESS:PORT/ready with the peer's IP address "
            "(or a DNS name), e.g. http://192.168.1.12:9478/ready"
        )
    return value


ReadyUrl = Annotated[str, AfterValidator(_one_line), AfterValidator(_ready_url)]


class FleetMember(Strict):
    """This host's place in a fleet behind a balancer; written by `llm-appliance fleet render` (fleet/hosts.py),
    not by hand. Absent on a single appliance: then no balancer waits on /ready and a restart drains nothing."""

    host: Annotated[str, Field(pattern=HOST_NAME.pattern)]
    # The other hosts' /ready, by host name: a restart waits while fewer than min_ready of them answer 200.
    peers: dict[str, ReadyUrl] = {}
    min_ready: Annotated[int, Field(ge=0, le=1000)] = 1
    # How long a draining host stays up not-ready before it may restart: the balancer's check interval x fall
    # (and a margin), the time HAProxy takes to stop sending it new requests.
    drain_seconds: Annotated[int, Field(ge=0, le=3600)] = 0
    # How long a peer back from its restart must have been ready before it counts as serving: the balancer's
    # check interval x rise (and a margin), the time HAProxy takes to send it requests again.
    settle_seconds: Annotated[int, Field(ge=0, le=3600)] = 0
    # Who settles whose turn it is to restart: "peers", the daemons among themselves (/ready's claims, the
    # min_ready guard above); "eviction", Kubernetes (the daemon evicts its own pod through the Eviction API, and
    # the PodDisruptionBudget answers 429 while the restart would leave too few ready). Written by `fleet render`
    # and `k8s render`.
    turns: Literal["peers", "eviction"] = "peers"
    # The fleet's shared key (one line; root:llm-appliance, 0640, the same file on every host): each /ready
    # answer proves itself under it, so no other host can answer for a peer. Required with peers taking turns.
    key_file: FilePath | None = None

    @field_validator("peers")
    @classmethod
    def _peer_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not HOST_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a host name of the fleet; use lower-case letters, digits and -")
        return value

    @model_validator(mode="after")
    def _reachable(self) -> FleetMember:
        if self.min_ready > len(self.peers):
            raise ValueError(
                f"min_ready = {self.min_ready} with {len(self.peers)} peers: this host could never restart; "
                "render the fleet again (`llm-appliance fleet render`)"
            )
        if self.host in self.peers:
            raise ValueError(f"{self.host!r} is this host, not a peer; render the fleet again")
        if self.peers and self.turns == "peers" and self.key_file is None:
            raise ValueError(
                "peers without key_file: any host that answers at a peer's address could block every restart or "
                "fake a peer's readiness; create one key for the fleet (install -m 0640 -o root -g llm-appliance "
                "/dev/null FILE && openssl rand -hex 32 > FILE), install the same file on every host, and set "
                "key_file = FILE (in a fleet file: [fleet] key_file)"
            )
        return self


HOURS_PER_YEAR = 8766  # 365.25 days


class Cost(Strict):
    """What a token costs, for `bench`: the electricity it takes and the hardware's depreciation over its
    lifetime, both per million generated tokens, in one currency."""

    currency: Annotated[Line, Field(max_length=8)] = ""  # shown beside the figures: "EUR"
    price_per_kwh: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    hardware_price: Annotated[float, Field(ge=0.0, le=1e9)] | None = None
    lifetime_years: Annotated[float, Field(gt=0.0, le=50.0)] | None = None
    lifetime_hours: Annotated[float, Field(gt=0.0, le=50.0 * HOURS_PER_YEAR)] | None = None
    # The share of its lifetime the box spends generating: depreciation per token grows as it idles.
    utilization: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0

    @model_validator(mode="after")
    def _complete(self) -> Cost:
        lifetimes = [name for name in ("lifetime_years", "lifetime_hours") if getattr(self, name) is not None]
        if self.price_per_kwh is None and self.hardware_price is None:
            raise ValueError("states no price; set price_per_kwh, or hardware_price with its lifetime_years")
        if len(lifetimes) > 1:
            raise ValueError("states the lifetime twice; keep lifetime_years or lifetime_hours")
        if self.hardware_price is not None and not lifetimes:
            raise ValueError("hardware_price needs the hardware's lifetime; set lifetime_years (or lifetime_hours)")
        if self.hardware_price is None and lifetimes:
            raise ValueError(f"{lifetimes[0]} without hardware_price; set the price the hardware cost")
        return self

    @property
    def lifetime_seconds(self) -> float | None:
        hours = self.lifetime_hours or (self.lifetime_years or 0.0) * HOURS_PER_YEAR
        return hours * 3600 if hours else None


class Engine(Strict):
    """Which rung of the engine ladder serves (ops/engine_proof.py): "auto" lets the proof find the fastest
    that works on this machine; a rung's name pins it, and only that rung is proven."""

    rung: Literal["auto", "as-built", "no-repack", "no-amx", "portable"] = "auto"


class Spec(Strict):
    server: Server = Server()
    models: Models
    speculative: Speculative = Speculative()
    memory: Memory = Memory()
    network: Network = Network()
    health: Health = Health()
    restart: Restart = Restart()
    versions: Versions = Versions()
    engine: Engine = Engine()
    prometheus: Prometheus = Prometheus()
    tuning: Tuning = Tuning()
    fleet: FleetMember | None = None
    cost: Cost | None = None
    fallback: Fallback | None = None
