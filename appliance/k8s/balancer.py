"""The fleet's HAProxy on the cluster: the fleet's haproxy.cfg (fleet/haproxy.cfg.j2) with the servers found
through each StatefulSet's headless Service, as a ConfigMap, a Deployment of the haproxy image and the
Service clients use."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from appliance.fleet.fleet_render import haproxy_view
from appliance.fleet.model import Fleet
from appliance.k8s.members import ApplianceSet
from appliance.k8s.names import BALANCER, Manifest, balancer_name, component, labels, meta, namespace_of
from appliance.render.templates import template

CONFIG_DIR = "/usr/local/etc/haproxy"  # where the haproxy image reads haproxy.cfg
HAPROXY_UID = 99  # the haproxy image's own user: runAsNonRoot needs it as a number
PRIVILEGED_PORTS = 1024


@dataclass(frozen=True)
class ServerTemplate:
    """One StatefulSet's servers: a slot per pod, named PREFIX1..PREFIXn, filled from its Service's records."""

    prefix: str
    slots: int
    fqdn: str
    port: int
    check_port: int
    maxconn: int


@dataclass(frozen=True)
class ClusterView:
    sets: tuple[ServerTemplate, ...]
    hold: str  # how long an address is kept after DNS last gave it (and re-asked for while valid)


def haproxy_cfg(fleet: Fleet, members: list[ApplianceSet], header: str) -> str:
    b = fleet.balancer
    assert fleet.kubernetes is not None
    domain = f"{namespace_of(fleet)}.svc.{fleet.kubernetes.cluster_domain}"
    sets = tuple(
        ServerTemplate(
            prefix=f"{m.name}-",
            slots=m.replicas,
            fqdn=f"{m.name}.{domain}",
            port=m.appliance.server.port,
            check_port=m.appliance.exporter.port,
            maxconn=m.appliance.spec.server.parallel,
        )
        for m in members
    )
    slots = sum(s.slots * s.maxconn for s in sets)
    max_queued = max(m.appliance.spec.health.ready_max_queued for m in members)
    view = haproxy_view(b, header, slots, (f"*:{b.port}", f"*:{b.stats_port}"), max_queued)
    cluster = ClusterView(sets, f"{b.check_interval_seconds * b.fall}s")
    return template("k8s/haproxy.cfg.j2").render(v=view, k=cluster)


def balancer(fleet: Fleet, members: list[ApplianceSet], header: str) -> list[Manifest]:
    name = balancer_name(fleet)
    own = labels(fleet, BALANCER, name)
    config = haproxy_cfg(fleet, members, header)
    b = fleet.balancer
    ports = [{"name": "api", "containerPort": b.port}, {"name": "stats", "containerPort": b.stats_port}]
    low_port = min(b.port, b.stats_port) < PRIVILEGED_PORTS
    container: Manifest = {
        "name": "haproxy",
        "image": fleet.kubernetes.haproxy_image if fleet.kubernetes else "haproxy:2.6",
        "ports": ports,
        "readinessProbe": {"tcpSocket": {"port": "api"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "stats"}, "periodSeconds": 10},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": HAPROXY_UID,
            "runAsGroup": HAPROXY_UID,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"], **({"add": ["NET_BIND_SERVICE"]} if low_port else {})},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}],
    }
    return [
        meta(fleet, "ConfigMap", "v1", name, own) | {"data": {"haproxy.cfg": config}},
        meta(fleet, "Deployment", "apps/v1", name, own)
        | {
            "spec": {
                # One HAProxy: maxconn per pod (its slots) and leastconn hold only where one balancer counts
                # every request; a second would send each pod its slots again.
                "replicas": 1,
                "selector": {"matchLabels": component(fleet, BALANCER)},
                "template": {
                    "metadata": {
                        "labels": own,
                        "annotations": {
                            "llm-appliance/haproxy-cfg-sha256": hashlib.sha256(config.encode()).hexdigest()
                        },
                    },
                    "spec": {
                        "automountServiceAccountToken": False,
                        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                        "containers": [container],
                        "volumes": [{"name": "config", "configMap": {"name": name}}],
                    },
                },
            }
        },
        # What clients use: the fleet's API, as the balancer's address is on hosts.
        meta(fleet, "Service", "v1", fleet.fleet.name, own)
        | {
            "spec": {
                "selector": component(fleet, BALANCER),
                "ports": [
                    {"name": "api", "port": b.port, "targetPort": "api"},
                    {"name": "stats", "port": b.stats_port, "targetPort": "stats"},
                ],
            }
        },
    ]
