"""One StatefulSet per distinct spec, and what belongs to it alone: the spec as a ConfigMap, the headless
Service its pods are found by, and the ServiceAccount and Role with which each pod evicts itself (and no other).

The container runs the appliance itself, as `llm-appliance up` (llama-server and the health daemon in one
process), as the service user; preStop is the daemon's drain: /ready 503, the balancer stops sending, the
requests in flight finish.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from appliance.fleet.hosts import drain_seconds
from appliance.fleet.model import Fleet, Kubernetes
from appliance.k8s.members import ApplianceSet
from appliance.k8s.names import (
    API_KEYS,
    APPLIANCE,
    SCRAPE_KEY,
    Manifest,
    component,
    instance,
    labels,
    meta,
    secret_name,
)
from appliance.plan.budget import MIB
from appliance.system import paths

STATE_DIR = paths.STATE
# Between SIGTERM to `up` and SIGKILL: the launcher's own stop (`up --stop-timeout`, 30 s) and as much again.
STOP_MARGIN_SECONDS = 60
# The startupProbe's patience: a large model loads in minutes; the server unit allows 15 (TimeoutStartSec=).
STARTUP_SECONDS = 15 * 60
STARTUP_PERIOD_SECONDS = 10


def up_command(member: ApplianceSet) -> list[str]:
    """The container's command: what a host runs without systemd, with the state where the pod keeps it."""
    return [str(paths.CLI), "up", str(member.spec_path), "--state-dir", str(STATE_DIR)]


def drain_timeout(fleet: Fleet, member: ApplianceSet) -> int:
    """How long preStop's drain may take: the balancer's drain, then the longest wait for the requests in
    flight (the restart's idle timeout)."""
    return drain_seconds(fleet.balancer) + member.appliance.spec.restart.idle_timeout_seconds


def drain_command(fleet: Fleet, member: ApplianceSet) -> list[str]:
    return [str(paths.CLI), "drain", "--state-dir", str(STATE_DIR), "--timeout", str(drain_timeout(fleet, member))]


def grace_seconds(fleet: Fleet, member: ApplianceSet) -> int:
    """terminationGracePeriodSeconds: preStop's drain, then `up`'s own stop, with room to spare."""
    return drain_timeout(fleet, member) + STOP_MARGIN_SECONDS


def workload(fleet: Fleet, member: ApplianceSet) -> list[Manifest]:
    own = labels(fleet, APPLIANCE, member.name)
    return [
        _spec_config_map(fleet, member, own),
        _headless_service(fleet, member, own),
        meta(fleet, "ServiceAccount", "v1", member.name, own) | {"automountServiceAccountToken": True},
        *_eviction_rights(fleet, member, own),
        _stateful_set(fleet, member, own),
    ]


def _spec_config_map(fleet: Fleet, member: ApplianceSet, own: dict[str, str]) -> Manifest:
    return meta(fleet, "ConfigMap", "v1", f"{member.name}-spec", own) | {"data": {member.spec_path.name: member.text}}


def _headless_service(fleet: Fleet, member: ApplianceSet, own: dict[str, str]) -> Manifest:
    """The pods' DNS names (the StatefulSet's serviceName) and the records HAProxy's server-template resolves:
    ready pods only, so a pod that failed its /ready leaves HAProxy's list too."""
    a = member.appliance
    return meta(fleet, "Service", "v1", member.name, own) | {
        "spec": {
            "clusterIP": "None",
            "selector": instance(member),
            "ports": [
                {"name": "api", "port": a.server.port, "targetPort": "api"},
                {"name": "metrics", "port": a.exporter.port, "targetPort": "metrics"},
            ],
        }
    }


def _eviction_rights(fleet: Fleet, member: ApplianceSet, own: dict[str, str]) -> list[Manifest]:
    """The daemon evicts its own pod for a restart (the PDB answers 429 while that would leave too few ready).
    RBAC cannot select pods by label: the Role names this StatefulSet's pods, so it can evict only those."""
    role = f"{member.name}-evict-own-pods"
    pods = list(member.pod_names)
    return [
        meta(fleet, "Role", "rbac.authorization.k8s.io/v1", role, own)
        | {
            "rules": [
                {"apiGroups": [""], "resources": ["pods/eviction"], "resourceNames": pods, "verbs": ["create"]},
                {"apiGroups": [""], "resources": ["pods"], "resourceNames": pods, "verbs": ["get"]},
            ]
        },
        meta(fleet, "RoleBinding", "rbac.authorization.k8s.io/v1", role, own)
        | {
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": member.name}],
        },
    ]


def _stateful_set(fleet: Fleet, member: ApplianceSet, own: dict[str, str]) -> Manifest:
    k8s = _table(fleet)
    spec_hash = hashlib.sha256(member.text.encode()).hexdigest()
    return meta(fleet, "StatefulSet", "apps/v1", member.name, own) | {
        "spec": {
            "serviceName": member.name,
            "replicas": member.replicas,
            # Each pod loads its model on its own; none waits for the one before it.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": instance(member)},
            "template": {
                # The spec reaches the pod through a subPath, which is not updated in place: a changed spec
                # changes this annotation, and the StatefulSet rolls its pods one at a time.
                "metadata": {"labels": own, "annotations": {"llm-appliance/spec-sha256": spec_hash}},
                "spec": {
                    "serviceAccountName": member.name,
                    "automountServiceAccountToken": True,
                    "terminationGracePeriodSeconds": grace_seconds(fleet, member),
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": k8s.run_as_user,
                        "runAsGroup": k8s.run_as_group,
                        # The Secret's files belong to root and this group, mode 0440: as validate wants the key file.
                        "fsGroup": k8s.run_as_group,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    # One appliance per node, whichever StatefulSet: each takes the node's GPUs and memory.
                    "affinity": {
                        "podAntiAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": [
                                {
                                    "labelSelector": {"matchLabels": component(fleet, APPLIANCE)},
                                    "topologyKey": "kubernetes.io/hostname",
                                }
                            ]
                        }
                    },
                    "initContainers": [_models_check(fleet, member)],
                    "containers": [_appliance_container(fleet, member)],
                    "volumes": _volumes(fleet, member),
                },
            },
        }
    }


def _appliance_container(fleet: Fleet, member: ApplianceSet) -> Manifest:
    a = member.appliance
    b = fleet.balancer
    resources: Manifest = {"requests": {"cpu": str(a.spec.server.threads)}}
    if a.planned_host_bytes:
        resources["requests"]["memory"] = f"{-(-a.planned_host_bytes // MIB)}Mi"
    if member.gpus:
        resources["limits"] = {"nvidia.com/gpu": member.gpus}
    return {
        "name": APPLIANCE,
        "image": _table(fleet).image,
        "command": up_command(member),
        "env": [
            # The daemon evicts its own pod (turns = "eviction"): it names it from these.
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "CUDA_DEVICE_ORDER", "value": "PCI_BUS_ID"},
        ],
        "ports": [
            {"name": "api", "containerPort": a.server.port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": a.exporter.port, "protocol": "TCP"},
        ],
        # The balancer's own check, with its pace: a draining pod leaves the Service's endpoints as it leaves
        # HAProxy's rotation.
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": "metrics"},
            "periodSeconds": b.check_interval_seconds,
            "failureThreshold": b.fall,
            "successThreshold": b.rise,
        },
        # The exporter has no /healthz: that it accepts connections is what liveness can ask of it. A slow or
        # decayed server is the daemon's to restart, not the kubelet's.
        "livenessProbe": {"tcpSocket": {"port": "metrics"}, "periodSeconds": 10, "failureThreshold": 3},
        "startupProbe": {
            "tcpSocket": {"port": "metrics"},
            "periodSeconds": STARTUP_PERIOD_SECONDS,
            "failureThreshold": STARTUP_SECONDS // STARTUP_PERIOD_SECONDS,
        },
        "lifecycle": {"preStop": {"exec": {"command": drain_command(fleet, member)}}},
        "resources": resources,
        "securityContext": _container_security(member),
        "volumeMounts": _mounts(member, state=True),
    }


def _models_check(fleet: Fleet, member: ApplianceSet) -> Manifest:
    """Before `up`: the model files whole and readable where the spec says (`validate` reads each GGUF and the
    draft's vocabulary), so that a missing or cut model is an Init error of its own, not a crash loop."""
    return {
        "name": "models",
        "image": _table(fleet).image,
        "command": [str(paths.CLI), "validate", str(member.spec_path)],
        "securityContext": _container_security(member),
        "volumeMounts": _mounts(member, state=False),
    }


def _container_security(member: ApplianceSet) -> Manifest:
    a = member.appliance
    privileged = a.server.privileged or a.exporter.privileged
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        # A port below 1024 takes the one capability, as the units grant it.
        "capabilities": {"drop": ["ALL"], **({"add": ["NET_BIND_SERVICE"]} if privileged else {})},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _key_files(member: ApplianceSet) -> list[tuple[str, Path]]:
    """The Secret's keys the pod mounts, each at the path the spec reads it from."""
    spec = member.appliance.spec
    found = [(API_KEYS, spec.server.api_key_file)] if spec.server.api_key_file else []
    return found + ([(SCRAPE_KEY, spec.prometheus.scrape_key_file)] if spec.prometheus.scrape_key_file else [])


def _mounts(member: ApplianceSet, state: bool) -> list[Manifest]:
    spec_file = member.spec_path
    mounts: list[Manifest] = [
        {"name": "spec", "mountPath": str(spec_file), "subPath": spec_file.name, "readOnly": True},
        *(
            {"name": "keys", "mountPath": str(path), "subPath": key, "readOnly": True}
            for key, path in _key_files(member)
        ),
        {"name": "models", "mountPath": str(member.models_dir), "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    return mounts + ([{"name": "state", "mountPath": str(STATE_DIR)}] if state else [])


def _volumes(fleet: Fleet, member: ApplianceSet) -> list[Manifest]:
    models = _table(fleet).models
    source: Manifest = (
        {"persistentVolumeClaim": {"claimName": models.claim, "readOnly": True}}
        if models.claim
        else {"hostPath": {"path": str(models.host_path), "type": "Directory"}}
    )
    keys = _key_files(member)
    return [
        {"name": "spec", "configMap": {"name": f"{member.name}-spec"}},
        *(
            [
                {
                    "name": "keys",
                    "secret": {
                        "secretName": secret_name(fleet),
                        "defaultMode": 0o440,
                        "items": [{"key": key, "path": key} for key, _ in keys],
                    },
                }
            ]
            if keys
            else []
        ),
        {"name": "models", **source},
        {"name": "tmp", "emptyDir": {}},
        {"name": "state", "emptyDir": {}},
    ]


def _table(fleet: Fleet) -> Kubernetes:
    assert fleet.kubernetes is not None, "k8s render checks the table first (members.kubernetes_of)"
    return fleet.kubernetes
