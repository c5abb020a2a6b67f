"""The fleet's Prometheus and Grafana side on the cluster (prometheus-operator's kinds): PodMonitors that give
the series the same job and labels the hosts' scrape jobs give them, PrometheusRules holding the very rules
`apply` and `fleet render` write, and each StatefulSet's dashboard as a ConfigMap for Grafana's sidecar."""

from __future__ import annotations

from typing import Any

import yaml

from appliance.fleet.fleet_render import JOBS, fleet_rules
from appliance.fleet.model import Fleet
from appliance.k8s.members import ApplianceSet
from appliance.k8s.names import (
    API_KEYS,
    APPLIANCE,
    BALANCER,
    MONITORING_API,
    SCRAPE_KEY,
    Manifest,
    balancer_name,
    component,
    instance,
    labels,
    meta,
    namespace_of,
    secret_name,
)
from appliance.render.render import FILES, render

RULES_FILE = next(path for path, name in FILES.items() if name == "alerts.rules.yml.j2")
DASHBOARD_FILE = next(path for path, name in FILES.items() if name == "grafana.json.j2")


def monitoring(fleet: Fleet, members: list[ApplianceSet], header: str) -> list[Manifest]:
    found: list[Manifest] = []
    for member in members:
        files = render(member.appliance)
        own = labels(fleet, APPLIANCE, member.name)
        found += [
            _pod_monitor(fleet, member),
            meta(fleet, "PrometheusRule", MONITORING_API, member.name, own) | {"spec": rule_groups(files[RULES_FILE])},
            # Grafana's dashboard sidecar loads every ConfigMap labelled so.
            meta(fleet, "ConfigMap", "v1", f"{member.name}-dashboard", own | {"grafana_dashboard": "1"})
            | {"data": {f"{member.name}.json": files[DASHBOARD_FILE]}},
        ]
    idle = max(m.appliance.spec.restart.idle_timeout_seconds for m in members)
    stats = f"{fleet.fleet.name}.{namespace_of(fleet)}.svc:{fleet.balancer.stats_port}"
    rules = fleet_rules(fleet, len(fleet.hosts), idle, stats, header)
    name = f"{fleet.fleet.name}-fleet"
    found.append(
        meta(fleet, "PrometheusRule", MONITORING_API, name, labels(fleet, APPLIANCE, name))
        | {"spec": rule_groups(rules)}
    )
    found.append(_balancer_monitor(fleet))
    return found


def rule_groups(rules_yaml: str) -> dict[str, Any]:
    document = yaml.safe_load(rules_yaml)
    return {"groups": document["groups"]}


def relabel(target: str, value: str) -> Manifest:
    return {"action": "replace", "targetLabel": target, "replacement": value}


def _pod_monitor(fleet: Fleet, member: ApplianceSet) -> Manifest:
    """Both of a pod's endpoints, with the job names and the labels (the spec's) its rules select."""
    a = member.appliance
    own = [relabel(name, value) for name, value in sorted(a.spec.prometheus.labels.items())]
    interval = f"{a.spec.prometheus.scrape_interval_seconds}s"
    server: Manifest = {
        "port": "api",
        "path": "/metrics",
        "interval": interval,
        "relabelings": [relabel("job", JOBS["server"]), *own],
    }
    if a.scrape_key_file is not None:
        key = SCRAPE_KEY if a.spec.prometheus.scrape_key_file else API_KEYS
        server["authorization"] = {"type": "Bearer", "credentials": {"name": secret_name(fleet), "key": key}}
    return meta(fleet, "PodMonitor", MONITORING_API, member.name, labels(fleet, APPLIANCE, member.name)) | {
        "spec": {
            "selector": {"matchLabels": instance(member)},
            "podMetricsEndpoints": [
                {
                    "port": "metrics",
                    "path": "/metrics",
                    "interval": interval,
                    "relabelings": [relabel("job", JOBS["health"]), *own],
                },
                server,
            ],
        }
    }


def _balancer_monitor(fleet: Fleet) -> Manifest:
    name = balancer_name(fleet)
    return meta(fleet, "PodMonitor", MONITORING_API, name, labels(fleet, BALANCER, name)) | {
        "spec": {
            "selector": {"matchLabels": component(fleet, BALANCER)},
            "podMetricsEndpoints": [
                {
                    "port": "stats",
                    "path": "/metrics",
                    "relabelings": [relabel("job", JOBS["balancer"]), relabel("appliance", fleet.fleet.name)],
                }
            ],
        }
    }
