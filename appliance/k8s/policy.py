"""What the cluster enforces for the fleet: the PodDisruptionBudget that settles restart turns (the fleet's
min_ready) and the NetworkPolicies that stand in for the hosts' nftables rulesets and units' IP filters."""

from __future__ import annotations

from appliance.fleet.model import Fleet
from appliance.k8s.members import ApplianceSet
from appliance.k8s.names import APPLIANCE, BALANCER, Manifest, balancer_name, component, instance, labels, meta
from appliance.spec.address import is_loopback

DNS_PORT = 53
# The API server as pods reach it: the Service's port 443, and 6443 where the policy sees the endpoint's port
# after the Service's DNAT (most CNIs).
API_SERVER_PORTS = (443, 6443)


def disruption_budget(fleet: Fleet) -> Manifest:
    """minAvailable = rules.min_ready over every appliance pod of the fleet: an Eviction (a daemon's restart, a
    node drain) that would leave fewer ready is refused with 429, and the daemon waits for its turn."""
    return meta(fleet, "PodDisruptionBudget", "policy/v1", fleet.fleet.name, labels(fleet, APPLIANCE, "fleet")) | {
        "spec": {
            "minAvailable": fleet.rules.min_ready,
            "selector": {"matchLabels": component(fleet, APPLIANCE)},
            # A pod that is not ready serves nobody: its restart takes nothing from min_ready (as the peers'
            # guard counts it on hosts), so the budget never holds it back.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        }
    }


def appliance_policy(fleet: Fleet, member: ApplianceSet, members: list[ApplianceSet]) -> Manifest:
    """Who may reach the pods: the balancer, Prometheus, the fleet's other pods (their daemons read /ready for the
    fleet-wide decay hold), and the spec's network.allow (loopback aside: inside the pod it is never filtered);
    with network.egress = "deny", what they may reach: DNS, the other pods' /ready and, for the daemon's
    Eviction, the API server."""
    a = member.appliance
    ports = [{"protocol": "TCP", "port": port} for port in (a.server.port, a.exporter.port)]
    allowed = [cidr for cidr in (*a.allow_v4, *a.allow_v6) if not is_loopback(cidr.split("/")[0])]
    appliances = {"podSelector": {"matchLabels": component(fleet, APPLIANCE)}}
    exporters = sorted({m.appliance.exporter.port for m in members})
    ingress: list[Manifest] = [
        {"from": [{"podSelector": {"matchLabels": component(fleet, BALANCER)}}], "ports": ports},
        {"from": [_monitoring(fleet)], "ports": ports},
        {"from": [appliances], "ports": [{"protocol": "TCP", "port": a.exporter.port}]},
    ]
    if allowed:
        ingress.append({"from": [{"ipBlock": {"cidr": cidr}} for cidr in allowed], "ports": ports})
    spec: Manifest = {"podSelector": {"matchLabels": instance(member)}, "policyTypes": ["Ingress"], "ingress": ingress}
    if a.egress_deny:
        spec["policyTypes"] = ["Ingress", "Egress"]
        to_peers = {"to": [appliances], "ports": [{"protocol": "TCP", "port": port} for port in exporters]}
        spec["egress"] = [_dns(), to_peers, _api_server(fleet)]
    return meta(fleet, "NetworkPolicy", "networking.k8s.io/v1", member.name, labels(fleet, APPLIANCE, member.name)) | {
        "spec": spec
    }


def balancer_policy(fleet: Fleet, members: list[ApplianceSet]) -> Manifest:
    """The balancer is the fleet's front door: any client may reach its API port, Prometheus its stats; it
    reaches DNS (server-template) and the appliances' API and exporter ports, nothing else."""
    b = fleet.balancer
    appliance_ports = sorted({p for m in members for p in (m.appliance.server.port, m.appliance.exporter.port)})
    name = balancer_name(fleet)
    return meta(fleet, "NetworkPolicy", "networking.k8s.io/v1", name, labels(fleet, BALANCER, name)) | {
        "spec": {
            "podSelector": {"matchLabels": component(fleet, BALANCER)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {"ports": [{"protocol": "TCP", "port": b.port}]},
                {"from": [_monitoring(fleet)], "ports": [{"protocol": "TCP", "port": b.stats_port}]},
            ],
            "egress": [
                _dns(),
                {
                    "to": [{"podSelector": {"matchLabels": component(fleet, APPLIANCE)}}],
                    "ports": [{"protocol": "TCP", "port": port} for port in appliance_ports],
                },
            ],
        }
    }


def _monitoring(fleet: Fleet) -> Manifest:
    assert fleet.kubernetes is not None
    return {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": fleet.kubernetes.monitoring_namespace}}
    }


def _dns() -> Manifest:
    return {
        "to": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
            }
        ],
        "ports": [{"protocol": protocol, "port": DNS_PORT} for protocol in ("UDP", "TCP")],
    }


def _api_server(fleet: Fleet) -> Manifest:
    # At its address alone (k8s/members.py refuses an egress-denied fleet without one): a rule of ports alone
    # would let a private pod reach any address on 443.
    assert fleet.kubernetes is not None and fleet.kubernetes.api_server is not None
    ports = [{"protocol": "TCP", "port": port} for port in API_SERVER_PORTS]
    return {"to": [{"ipBlock": {"cidr": fleet.kubernetes.api_server}}], "ports": ports}
