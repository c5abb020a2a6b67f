"""What the rendered objects are called and how they find each other: names and labels, said once."""

from __future__ import annotations

from typing import Any

from appliance.fleet.model import Fleet
from appliance.k8s.members import ApplianceSet

Manifest = dict[str, Any]
APPLIANCE, BALANCER = "appliance", "balancer"
API_KEYS = "api-keys"  # the Secret's key holding server.api_key_file's content
SCRAPE_KEY = "scrape-key"  # ...and prometheus.scrape_key_file's, when the spec has one
MONITORING_API = "monitoring.coreos.com/v1"  # prometheus-operator's PodMonitor and PrometheusRule


def labels(fleet: Fleet, component: str, instance: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "llm-appliance",
        "app.kubernetes.io/part-of": fleet.fleet.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/managed-by": "llm-appliance",
    }


def component(fleet: Fleet, name: str) -> dict[str, str]:
    """Every pod of one component of the fleet (all appliances, or the balancer): the PDB, the anti-affinity,
    the PodMonitors and the NetworkPolicies' peers select them so."""
    return {"app.kubernetes.io/part-of": fleet.fleet.name, "app.kubernetes.io/component": name}


def instance(member: ApplianceSet) -> dict[str, str]:
    """One StatefulSet's pods."""
    return {"app.kubernetes.io/instance": member.name, "app.kubernetes.io/component": APPLIANCE}


def balancer_name(fleet: Fleet) -> str:
    return f"{fleet.fleet.name}-balancer"


def secret_name(fleet: Fleet) -> str:
    """The API keys: made by hand (`kubectl create secret`), never rendered; the renderer never reads a key."""
    return f"{fleet.fleet.name}-api-keys"


def namespace_of(fleet: Fleet) -> str:
    assert fleet.kubernetes is not None, "k8s render checks the table first (members.kubernetes_of)"
    return fleet.kubernetes.namespace


def meta(fleet: Fleet, kind: str, api_version: str, name: str, object_labels: dict[str, str]) -> Manifest:
    """An object's head: kind, apiVersion and metadata in the fleet's namespace."""
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": name, "namespace": namespace_of(fleet), "labels": object_labels},
    }
