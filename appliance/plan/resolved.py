"""The appliance as resolved: the spec as written plus every fact derived from it, computed once.

Two layers, as in Knot Resolver's manager: `spec` is what the user wrote (validated), the other fields are
what it means on this machine with these model files. Render, the launcher, the health daemon, bench and
tune read these fields instead of re-deriving them. `apply` writes the resolved appliance into the
rendered tree as a JSON snapshot; the server and health units start from that snapshot alone, so what runs
is always what was applied and checked, whatever the spec file on disk says since.
"""

from __future__ import annotations

import json
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ConfigDict, TypeAdapter, ValidationError

from appliance.plan.budget import MIB
from appliance.plan.devices import draft_devices, gpu_devices
from appliance.plan.endpoint import Endpoint
from appliance.plan.plan import Plan
from appliance.plan.router import Router, router_of
from appliance.spec.address import ip_address, is_ipv6, network_of
from appliance.spec.model import Spec
from appliance.system import paths

# The snapshot's format: its fields are the Appliance's, every one required. A snapshot of another version
# (or lacking a field) is refused, and apply writes a new one: it never reads as something it does not say.
SNAPSHOT_VERSION = 4
SNAPSHOT = paths.RENDERED / "appliance.json"
REAPPLY = "re-run `llm-appliance apply SPEC`"
# Device nodes a CUDA process opens besides /dev/nvidiaN of its GPUs (nvidia-uvm-tools is for profilers);
# NVML opens only the control node and the GPUs', read-write like CUDA.
NVIDIA_CONTROL = "/dev/nvidiactl"
GPU_COMMON_NODES = (NVIDIA_CONTROL, "/dev/nvidia-uvm")


class SnapshotError(Exception):
    """The applied snapshot is missing, unreadable or from another version; the message says what to run."""


@dataclass(frozen=True)
class Appliance:
    """Each field is one line of the snapshot (`spec` and `spec_file` at its top, the rest under "resolved")."""

    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(extra="forbid")

    spec: Spec
    spec_file: Path  # where apply installs the spec; the units and alerts name it
    binary: str
    argv: tuple[str, ...]
    alias: str  # the model's name in the API (--alias): what clients send as `model`
    server: Endpoint
    exporter: Endpoint
    peers: tuple[Endpoint, ...]  # each fleet peer's exporter, whose /ready a restart reads (none alone)
    allow_v4: tuple[str, ...]  # network.allow, IPv4 networks
    allow_v6: tuple[str, ...]  # ...and IPv6 ones
    egress_deny: bool  # network.egress = "deny": the units and the ruleset filter what the appliance dials
    api_key_file: Path | None
    scrape_key_file: Path | None  # what the llama-server scrape job sends as its bearer token
    draft_in_use: bool
    speculation: bool  # llama-server speculates: with its draft model, or n-gram types without one
    on_gpu: bool  # the target model is offloaded to a GPU
    mlock: bool  # load_mode locks the weights in RAM
    server_devices: tuple[str, ...]  # every GPU the server uses (target and draft)
    server_device_nodes: tuple[str, ...]  # what the server's sandbox opens for them (read-write)
    health_device_nodes: tuple[str, ...]  # what NVML opens for the health daemon (read-write)
    planned_vram_bytes: dict[str, int]
    min_free_bytes: int
    planned_host_bytes: int  # the host budget's use; 0 when the machine's RAM was unknown
    host_usable_bytes: int  # what validation held it to (MemTotal x host_memory_utilization); 0: unknown
    memory_high_mib: int | None  # the server unit's MemoryHigh=: host_usable_bytes in MiB, rounded up
    health_watchdog_seconds: int  # the health unit's WatchdogSec=: three intervals, at least 30 s
    slot_ctx: int
    state_file: Path
    baseline_file: Path
    # Files each unit binds read-only out of a home directory its ProtectHome= hides ("-": may be missing).
    server_binds: tuple[str, ...]
    health_binds: tuple[str, ...]
    restart_binds: tuple[str, ...]
    router: Router | None  # [fallback]: a router in front of the server, with the upstream as its second backend

    @property
    def router_ip_allow(self) -> tuple[str, ...]:
        """The router unit's IPAddressAllow= besides localhost: its clients (network.allow), its own address
        beyond loopback, and the upstream, the one address it dials out to."""
        if self.router is None:
            return ()
        own = self.router.endpoint.own_address + self.server.own_address + self.exporter.own_address
        # A name is only possible with egress = "allow", where the unit filters no address (spec checks).
        upstream = self.router.upstream.host
        dialled = (network_of(upstream),) if ip_address(upstream) else ()
        return _unique((*self.allow_v4, *self.allow_v6, *own, *dialled))

    @property
    def health_url(self) -> str:
        return f"{self.server.url}/health"

    @property
    def server_ip_allow(self) -> tuple[str, ...]:
        """The server unit's IPAddressAllow= besides localhost: network.allow (IPv4 first) and the server's own
        address (the launcher's /health probe goes there). Only with egress = "deny": systemd's filter holds
        both directions, so with "allow" the unit has none and the nftables input chain filters the clients."""
        return _unique((*self.allow_v4, *self.allow_v6, *self.server.own_address))

    @property
    def health_ip_allow(self) -> tuple[str, ...]:
        """The health unit's IPAddressAllow= besides localhost: the server's own address (the daemon probes it
        there) and, when the exporter listens beyond loopback, network.allow and the exporter's own address."""
        allow = (*self.allow_v4, *self.allow_v6)
        exporter = () if self.exporter.loopback_only else (*allow, *self.exporter.own_address)
        return _unique((*self.server.own_address, *exporter))

    # -- the snapshot --

    def document(self) -> dict[str, Any]:
        """JSON-ready: the spec as written (normalised) and the resolved facts beside it."""
        resolved = _snapshot().dump_python(self, mode="json", exclude={"spec"})
        spec_file = resolved.pop("spec_file")
        spec = _spec_document(self.spec)
        return {"snapshot_version": SNAPSHOT_VERSION, "spec_file": spec_file, "spec": spec, "resolved": resolved}

    @classmethod
    def from_document(cls, document: Any) -> Appliance:
        """The appliance a document() holds; SnapshotError for another version or a field missing or wrong."""
        if not isinstance(document, dict) or not isinstance(document.get("resolved"), dict):
            raise SnapshotError(f"not an applied appliance; {REAPPLY}")
        if document.get("snapshot_version") != SNAPSHOT_VERSION:
            version = document.get("snapshot_version")
            raise SnapshotError(f"snapshot version {version!r}, expected {SNAPSHOT_VERSION}; {REAPPLY}")
        fields = {**document["resolved"], **{k: document[k] for k in ("spec", "spec_file") if k in document}}
        try:
            # JSON's types: a list for a tuple, a string for a path.
            return _snapshot().validate_python(fields, strict=False)
        except ValidationError as exc:
            raise SnapshotError(f"{_invalid(exc)}; {REAPPLY}") from None

    def to_json(self, header: str) -> str:
        return json.dumps({"generated": header, **self.document()}, indent=2, sort_keys=True) + "\n"

    @classmethod
    def read(cls, path: Path = SNAPSHOT) -> Appliance:
        """The applied appliance, as the units start it."""
        try:
            document = json.loads(path.read_text())
        except FileNotFoundError:
            raise SnapshotError(f"{path} does not exist: nothing is applied; run `llm-appliance apply SPEC`") from None
        except (OSError, ValueError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise SnapshotError(f"cannot read {path}: {reason}; {REAPPLY}") from None
        try:
            return cls.from_document(document)
        except SnapshotError as exc:
            raise SnapshotError(f"cannot read {path}: {exc}") from None


@cache
def _snapshot() -> TypeAdapter[Appliance]:
    return TypeAdapter(Appliance)


def _invalid(exc: ValidationError) -> str:
    """What is wrong with a snapshot, by its keys: every field missing, else the first one unknown or wrong."""

    def key(loc: tuple[int | str, ...]) -> str:
        name = ".".join(str(part) for part in loc)
        return name if loc[0] in ("spec", "spec_file") else f"resolved.{name}"

    errors = exc.errors()
    missing = [key(error["loc"]) for error in errors if error["type"] == "missing"]
    if missing:
        return f"it lacks {', '.join(missing)}"
    first = errors[0]
    if first["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        return f"{key(first['loc'])} is no field of snapshot version {SNAPSHOT_VERSION}"
    return f"{key(first['loc'])}: {first['msg']}"


def resolve(plan: Plan, spec_file: Path, state_dir: Path = paths.STATE) -> Appliance:
    """The one place each derived fact is computed."""
    spec = plan.spec
    devices = tuple(sorted(set(gpu_devices(spec.models.target)) | set(draft_devices(spec))))
    gpu_nodes = tuple(f"/dev/nvidia{d.removeprefix('CUDA')}" for d in devices if d.startswith("CUDA"))
    peers = [urllib.parse.urlsplit(url) for url in spec.fleet.peers.values()] if spec.fleet else []
    host_usable_bytes = plan.host.usable_bytes if plan.host else 0
    return Appliance(
        spec=spec,
        spec_file=spec_file,
        binary=plan.argv[0],
        argv=plan.argv,
        alias=plan.alias,
        server=Endpoint(spec.server.host, spec.server.port),
        exporter=Endpoint(spec.prometheus.host, spec.prometheus.port),
        peers=tuple(Endpoint(peer.hostname or "", peer.port or 80) for peer in peers),
        allow_v4=tuple(cidr for cidr in spec.network.allow if not is_ipv6(cidr)),
        allow_v6=tuple(cidr for cidr in spec.network.allow if is_ipv6(cidr)),
        egress_deny=spec.network.egress == "deny",
        api_key_file=spec.server.api_key_file,
        # validate refuses a key file of several keys without a scrape key of its own
        scrape_key_file=spec.prometheus.scrape_key_file or spec.server.api_key_file,
        draft_in_use=plan.draft_in_use,
        speculation=plan.speculation,
        on_gpu=bool(gpu_devices(spec.models.target)),
        mlock="mlock" in spec.server.load_mode,
        server_devices=devices,
        server_device_nodes=gpu_nodes + GPU_COMMON_NODES if devices else (),
        health_device_nodes=(NVIDIA_CONTROL, *gpu_nodes) if devices else (),
        planned_vram_bytes={b.device: b.used_bytes for b in plan.budgets},
        min_free_bytes=spec.health.min_free_mib << 20,
        planned_host_bytes=plan.host.used_bytes if plan.host else 0,
        host_usable_bytes=host_usable_bytes,
        memory_high_mib=-(-host_usable_bytes // MIB) or None,
        # The daemon beats after each check, every interval: three missed (never under 30 s) and systemd kills it.
        health_watchdog_seconds=max(3 * spec.health.interval_seconds, 30),
        slot_ctx=spec.server.slot_ctx,
        state_file=state_dir / "health-state.json",
        baseline_file=spec.health.baseline_file,
        server_binds=plan.sandbox.server_binds,
        health_binds=plan.sandbox.health_binds,
        restart_binds=plan.sandbox.restart_binds,
        router=router_of(spec, plan.alias),
    )


def _unique(items: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def changed_fields(applied: Appliance, proposed: Appliance) -> list[str]:
    """What differs between two appliances, a line per field: spec fields as written, then resolved facts."""
    old, new = _flatten(applied.document()), _flatten(proposed.document())
    return [
        f"{key}: {_change(old.get(key), new.get(key))}"
        for key in sorted(old.keys() | new.keys(), key=lambda k: (k.startswith("resolved."), k))
        if old.get(key) != new.get(key)
    ]


def _flatten(document: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in document.items():
        name = f"{prefix}{key}".removeprefix("spec.")
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _change(old: Any, new: Any) -> str:
    if isinstance(old, list) and isinstance(new, list) and len(old) + len(new) > 8:
        # A long list (the argv) reads better as what left it and what joined it.
        # Counted, not looked up: an argv may hold the same word twice ("8192" as context and as cache).
        gone = list((Counter(old) - Counter(new)).elements())
        added = list((Counter(new) - Counter(old)).elements())
        return f"without {json.dumps(gone)}, with {json.dumps(added)}"
    return f"{json.dumps(old)} -> {json.dumps(new)}"


def _spec_document(spec: Spec) -> dict[str, Any]:
    # A single appliance has no [fleet] (nor, mostly, a [cost]): left out, its snapshot reads as before they existed.
    document = spec.model_dump(mode="json")
    for optional in ("fleet", "cost", "fallback"):
        if document.get(optional) is None:
            document.pop(optional, None)
    if document.get("engine") == {"rung": "auto"}:  # the default: left out, as before a rung could be pinned
        del document["engine"]
    # Nor, mostly, the n-gram types' sub-tables.
    for table in [
        name for name, value in document["speculative"].items() if name.startswith("ngram_") and value is None
    ]:
        del document["speculative"][table]
    return document
