"""The fleet file as written: hosts, the balancer in front of them, and the rules they keep together.

Modelled like the spec (strict, unknown keys refused), so its errors read like the spec's. A host's spec is
the shared one (or its own), with `overrides` merged over it table by table; the fleet then sets what it owns
(see hosts.py): the listen addresses, the balancer in network.allow, the restart schedule.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field, field_validator, model_validator

from appliance.spec.address import ip_address
from appliance.spec.base import FilePath, Line, Strict
from appliance.spec.fallback import Fallback

HOST_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
CLOCK = re.compile(r"^([01][0-9]|2[0-3]):([0-5][0-9])$")
Port = Annotated[int, Field(ge=1, le=65535)]


def _ip(value: str) -> str:
    # An address, not a name: it goes into network.allow (as a /32 or /128) and into haproxy.cfg verbatim.
    if ip_address(value) is None:
        raise ValueError(f"{value!r} is not an IP address; write the address, e.g. 192.168.1.11")
    return value


IP = Annotated[str, AfterValidator(_ip)]


class Balancer(Strict):
    """HAProxy on its own host. It passes each client's Authorization header through unchanged: every host
    must accept the same keys (the same server.api_key_file content), and the balancer holds none."""

    address: IP
    port: Port = 8000
    # HAProxy's own Prometheus endpoint (`http-request use-service prometheus-exporter`) and /stats.
    stats_port: Port = 8404
    # A host that goes not-ready leaves the rotation after check_interval x fall; the daemon's drain waits that.
    check_interval_seconds: Annotated[int, Field(ge=1, le=60)] = 2
    fall: Annotated[int, Field(ge=1, le=10)] = 2
    rise: Annotated[int, Field(ge=1, le=10)] = 2
    # Attempts after a refused or empty answer, each on another host (option redispatch).
    retries: Annotated[int, Field(ge=0, le=10)] = 3
    connect_timeout_seconds: Annotated[int, Field(ge=1, le=60)] = 5
    # The longest a generation may take before HAProxy gives up on it (and the client's idle limit too).
    server_timeout_seconds: Annotated[int, Field(ge=10, le=86400)] = 600
    # How long a request may wait in HAProxy's queue for a free slot (maxconn per host = its server.parallel).
    queue_timeout_seconds: Annotated[int, Field(ge=1, le=86400)] = 60


class Rules(Strict):
    min_ready: Annotated[int, Field(ge=1, le=1000)] = 1
    # Scheduled restarts: the first host at restart_first (daily), each next one restart_spacing_minutes later,
    # so no two share a time (and a restart's drain, load and warm-up fit in between).
    restart_first: Line = "04:00"
    restart_spacing_minutes: Annotated[int, Field(ge=5, le=720)] = 30
    # LlmApplianceFleetBelowMinReady fires after this long short of min_ready: longer than one restart takes.
    below_min_ready_alert_seconds: Annotated[int, Field(ge=0, le=86400)] = 300

    @field_validator("restart_first")
    @classmethod
    def _clock(cls, value: str) -> str:
        if not CLOCK.fullmatch(value):
            raise ValueError("is not a time of day as HH:MM (24 h), e.g. '04:00'")
        return value


class FleetPrometheus(Strict):
    """The Prometheus that watches the fleet: its address joins every host's network.allow (it scrapes the
    exporter and llama-server), and it reads the targets files from `files_dir`."""

    address: IP | None = None
    files_dir: FilePath = Path("/etc/prometheus/llm-appliance")


DNS_LABEL = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
# An image reference as the OCI distribution spec writes it ([registry[:port]/]path[:tag][@sha256:digest]): the
# manifests are dumped as YAML, but the kubelet reads the text, so it holds nothing else.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REGISTRY = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*(?::[0-9]+)?/)?"
IMAGE = re.compile(
    rf"^{_REGISTRY}{_COMPONENT}(?:/{_COMPONENT})*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?(?:@sha256:[a-f0-9]{{64}})?$"
)


def _image(value: str) -> str:
    if not IMAGE.fullmatch(value):
        raise ValueError(
            f"{value!r} is not an image reference; write [REGISTRY/]NAME[:TAG][@sha256:DIGEST], "
            "e.g. registry.example/llm-appliance:0.1.0"
        )
    return value


Image = Annotated[str, AfterValidator(_image)]


def _cidr(value: str) -> str:
    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise ValueError(f"{value!r} is not an address or network; write e.g. 10.0.0.1/32") from None
    return value


CIDR = Annotated[str, AfterValidator(_cidr)]


class ModelsVolume(Strict):
    """Where the pods find the model files the spec names: a node directory (read-only hostPath), staged on each
    node as on a host under systemd, or a PersistentVolumeClaim; exactly one. Mounted read-only at the directory
    of the spec's model files."""

    host_path: FilePath | None = None
    claim: Annotated[str, Field(pattern=DNS_LABEL)] | None = None

    @model_validator(mode="after")
    def _one(self) -> ModelsVolume:
        if (self.host_path is None) == (self.claim is None):
            raise ValueError("set exactly one of host_path (a node directory) and claim (a PersistentVolumeClaim)")
        return self


class Kubernetes(Strict):
    """The fleet on a cluster (`llm-appliance k8s render`): what a spec does not say because a host needs none
    of it, the image above all."""

    # The image holds llm-appliance at /opt/llm-appliance/venv and llama-server, as install.sh lays them out.
    image: Image | None = None
    namespace: Annotated[str, Field(pattern=DNS_LABEL)] = "llm-appliance"
    models: ModelsVolume = ModelsVolume(host_path=Path("/var/lib/llm-appliance/models"))
    # The service user's uid and gid in the image (the pods run as them, never as root).
    run_as_user: Annotated[int, Field(ge=1, le=2147483647)] = 10001
    run_as_group: Annotated[int, Field(ge=1, le=2147483647)] = 10001
    # Where the Prometheus that reads the PodMonitors runs: its pods may scrape the appliances and HAProxy.
    monitoring_namespace: Annotated[str, Field(pattern=DNS_LABEL)] = "monitoring"
    # The API server's address as pods reach it after the Service's DNAT (`kubectl get endpoints kubernetes`):
    # the one egress besides DNS, for the daemon's Eviction. Required where a pod's egress is denied.
    api_server: CIDR | None = None
    cluster_domain: Annotated[str, Field(pattern=r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$")] = "cluster.local"
    haproxy_image: Image = "haproxy:2.6"


class Host(Strict):
    name: str
    address: IP
    spec: FilePath | None = None  # relative to the fleet file; default: the fleet's shared spec
    # Tables of the spec, merged over it: {server = {threads = 8}} or [hosts.overrides.server] below the host.
    overrides: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not HOST_NAME.fullmatch(value):
            raise ValueError(
                "is not a host name of the fleet; use lower-case letters, digits and -, e.g. gpu-1 (it becomes "
                "an HAProxy server name, a directory and a Prometheus label)"
            )
        return value


class FleetOptions(Strict):
    # The `appliance` label of every target and alert of this fleet.
    name: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")]
    spec: FilePath | None = None  # the shared spec, relative to the fleet file
    # The fleet's shared key, as every host names it ([fleet] key_file of its spec): the same file on each,
    # root:llm-appliance 0640. `fleet render` requires it; `k8s render` has the cluster settle the turns.
    key_file: FilePath | None = None
    # Tables of the spec merged over every host's (before the host's own overrides), e.g. the API key file.
    overrides: dict[str, dict[str, Any]] = Field(default_factory=dict)


class Fleet(Strict):
    fleet: FleetOptions
    balancer: Balancer
    rules: Rules = Rules()
    prometheus: FleetPrometheus = FleetPrometheus()
    # A router on the balancer's host, in front of HAProxy, with this upstream as the fallback: clients connect
    # to balancer.address at fallback.port; HAProxy's /ready (stats_port) says when no host can take a request.
    fallback: Fallback | None = None
    kubernetes: Kubernetes | None = None  # `k8s render` only; `fleet render` ignores it
    hosts: Annotated[list[Host], Field(min_length=1)]
