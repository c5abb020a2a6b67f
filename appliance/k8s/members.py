"""The fleet as a cluster runs it: one StatefulSet per distinct spec its hosts derive (hosts whose spec and
overrides come out the same share one, a pod each), named after the first of them.

Each set's spec is derived as `fleet render` derives a host's (fleet/hosts.py: the same merge of overrides, the
same labels and drain), then what a pod differs in: both listeners on every address of the pod (its IP is not
known before it runs; the NetworkPolicy says who may connect), and turns = "eviction": Kubernetes settles whose
turn it is to restart through the PodDisruptionBudget, so the spec keeps no min_ready of its own. Its peers are
every pod of the fleet, by its stable DNS name (this pod's own entry skipped at run time): the fleet-wide decay
hold reads their /ready. It is validated as `fleet render` validates a host's, except the key files, which come from a Secret.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomlkit

from appliance import __version__
from appliance.facts.machine import MachineFacts
from appliance.fleet.hosts import (
    drain_seconds,
    exporter_port,
    merged,
    schedule,
    settle_seconds,
    table_of,
    where_written,
)
from appliance.fleet.load import LoadedFleet
from appliance.fleet.model import Host, Kubernetes
from appliance.plan.resolved import Appliance, resolve
from appliance.plan.validate import validate_loaded
from appliance.render.apply import installed_spec_path
from appliance.spec.load import parse_spec
from appliance.spec.problems import Problem, Severity, SpecInvalid, error

EVERY_ADDRESS = "0.0.0.0"


@dataclass(frozen=True)
class ApplianceSet:
    """One StatefulSet: the hosts of the fleet it stands for (a pod each) and the spec they all run."""

    name: str
    hosts: tuple[Host, ...]
    source: Path  # the spec file it derives from
    text: str  # the derived spec, as the pods read it from their ConfigMap
    appliance: Appliance

    @property
    def replicas(self) -> int:
        return len(self.hosts)

    @property
    def pod_names(self) -> tuple[str, ...]:
        """The StatefulSet's pods, by their ordinal: what its Role may evict, by name."""
        return tuple(f"{self.name}-{ordinal}" for ordinal in range(self.replicas))

    @property
    def spec_path(self) -> Path:
        """Where the pods find the spec: where `apply` would install it on a host."""
        return self.appliance.spec_file

    @property
    def models_dir(self) -> Path:
        """The directory holding the model files the spec names: the models volume is mounted there."""
        spec = self.appliance.spec
        files = [spec.models.target.path, *([spec.models.draft.path] if spec.models.draft else [])]
        return Path(os.path.commonpath([str(path.parent) for path in files]))

    @property
    def gpus(self) -> int:
        """GPUs a pod asks the device plugin for: the spec's CUDA devices (none for a CPU spec)."""
        return sum(device.startswith("CUDA") for device in self.appliance.server_devices)


def kubernetes_of(fleet: LoadedFleet) -> Kubernetes:
    """The fleet's [kubernetes] table with its image; SpecInvalid, located, without one."""
    table = fleet.fleet.kubernetes
    if table is None or table.image is None:
        problem = error(
            "kubernetes.image" if table else "kubernetes",
            "`k8s render` needs the image the pods run, and the fleet file names none",
            'add [kubernetes] with image = "REGISTRY/llm-appliance:VERSION" (an image holding llm-appliance and '
            "llama-server as install.sh lays them out)",
        )
        raise SpecInvalid([fleet.locate(problem)])
    return table


def appliance_sets(fleet: LoadedFleet, facts: MachineFacts | None = None) -> tuple[list[ApplianceSet], list[Problem]]:
    """Every StatefulSet's spec derived, validated and resolved, and the warnings; SpecInvalid with every
    problem, located where it was written, otherwise."""
    groups: dict[tuple[Path, str], list[Host]] = {}
    for host in fleet.fleet.hosts:
        key = (fleet.spec_of(host), tomlkit.dumps(merged(fleet, host)))
        groups.setdefault(key, []).append(host)
    found: list[Problem] = []
    done: list[ApplianceSet] = []
    peers = _pods_ready(fleet, [hosts for hosts in groups.values()])
    for index, hosts in enumerate(groups.values()):
        first = hosts[0]
        source = fleet.spec_of(first)
        text = _derived(fleet, first, index, peers)
        try:
            validated = validate_loaded(parse_spec(text, source), facts, key_files=False)
        except SpecInvalid as exc:
            found += [p if p.file == fleet.path else where_written(p, fleet, first, source) for p in exc.problems]
            continue
        found += [where_written(p, fleet, first, source) for p in validated.warnings]
        appliance = resolve(validated.plan, installed_spec_path(source))
        member = ApplianceSet(first.name, tuple(hosts), source, text, appliance)
        found += [where_written(p, fleet, first, source) for p in _device_problems(member)]
        done.append(member)
    found += _api_server_problems(fleet, done)
    if any(p.severity is Severity.ERROR for p in found):
        raise SpecInvalid(found)
    return done, found


def _api_server_problems(fleet: LoadedFleet, members: list[ApplianceSet]) -> list[Problem]:
    """A pod whose egress is denied reaches DNS, its peers and, for its daemon's Eviction (turns = "eviction"),
    the API server: at its address, or the NetworkPolicy could only say "any address on 443 and 6443", and a
    private pod could send its code to any HTTPS server."""
    table = kubernetes_of(fleet)
    denied = [m.name for m in members if m.appliance.egress_deny]
    if table.api_server is not None or not denied:
        return []
    problem = error(
        "kubernetes.api_server",
        f'{", ".join(denied)} deny egress (network.egress = "deny"), and their daemons evict their own pods: '
        "the NetworkPolicy lets them reach the API server alone, whose address the fleet file does not name",
        'add api_server = "ADDRESS/32" to [kubernetes], the address pods reach it at after the Service\'s DNAT '
        "(`kubectl get endpoints kubernetes -n default`)",
    )
    return [fleet.locate(problem)]


def _pods_ready(fleet: LoadedFleet, groups: list[list[Host]]) -> dict[str, str]:
    """Every pod's /ready by pod name: NAME-i.NAME (its StatefulSet's headless Service) in the namespace."""
    table = kubernetes_of(fleet)
    domain = f"{table.namespace}.svc.{table.cluster_domain}"
    return {
        f"{hosts[0].name}-{i}": f"http://{hosts[0].name}-{i}.{hosts[0].name}.{domain}:{exporter_port(merged(fleet, hosts[0]))}/ready"
        for hosts in groups
        for i in range(len(hosts))
    }


def _derived(fleet: LoadedFleet, host: Host, index: int, peers: dict[str, str]) -> str:
    f = fleet.fleet
    document: Any = merged(fleet, host)
    table_of(document, "server")["host"] = EVERY_ADDRESS
    table_of(document, "prometheus")["host"] = EVERY_ADDRESS
    labels = table_of(document, "prometheus").get("labels")
    if labels is None:
        labels = table_of(document, "prometheus")["labels"] = tomlkit.inline_table()
    labels.update({"appliance": f.fleet.name, "host": host.name})
    table_of(document, "restart")["schedule"] = schedule(f.rules, index)
    member = tomlkit.table()
    member.comment("written by `llm-appliance k8s render`: the PodDisruptionBudget holds the fleet's min_ready")
    member["host"] = host.name
    member["peers"] = tomlkit.inline_table()
    member["peers"].update(peers)
    member["min_ready"] = 0
    member["drain_seconds"] = drain_seconds(f.balancer)
    member["settle_seconds"] = settle_seconds(f.balancer)
    member["turns"] = "eviction"
    document["fleet"] = member
    header = (
        f"# StatefulSet {host.name} of fleet {f.fleet.name}: generated from {fleet.path.name} by llm-appliance "
        f"{__version__};\n# edit that and run `llm-appliance k8s render`, not this file.\n"
    )
    return header + tomlkit.dumps(document)


def _device_problems(member: ApplianceSet) -> list[Problem]:
    """A pod sees the GPUs the device plugin gives it as CUDA0, CUDA1, ...: the spec must name those."""
    devices = sorted(d for d in member.appliance.server_devices if d.startswith("CUDA"))
    expected = [f"CUDA{n}" for n in range(len(devices))]
    if devices == expected:
        return []
    return [
        error(
            "models.target.devices",
            f"names {', '.join(devices)}; a pod given {len(devices)} GPU(s) sees them as {', '.join(expected)}",
            f"use {', '.join(expected)} for this spec on Kubernetes (hosts[].overrides.models can set it)",
        )
    ]
