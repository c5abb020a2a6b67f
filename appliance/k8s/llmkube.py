"""The same fleet as LLMKube resources (inference.llmkube.dev/v1alpha1): per StatefulSet's spec a Model for
the target, one for the draft, and an InferenceService serving them; beside them what LLMKube does not make,
selecting its pods by the labels the InferenceService gives them: the PDB, the NetworkPolicy, the
PodMonitor and our alert rules.

LLMKube runs llama-server itself, so what the appliance adds around it is lost on this route (LOSSES).
"""

from __future__ import annotations

from pathlib import Path

from appliance.fleet.fleet_render import JOBS
from appliance.fleet.model import Fleet
from appliance.k8s.members import ApplianceSet
from appliance.k8s.monitoring import RULES_FILE, relabel, rule_groups
from appliance.k8s.names import API_KEYS, APPLIANCE, MONITORING_API, Manifest, instance, labels, meta, secret_name
from appliance.k8s.policy import appliance_policy, disruption_budget
from appliance.render.render import render

LLMKUBE = "inference.llmkube.dev/v1alpha1"
# What losing the appliance around llama-server costs, said by `k8s render --flavor llmkube` and README.
LOSSES = (
    "no health daemon: no decay, VRAM-creep or speculation detectors, no idle-aware restarts, no /ready "
    "(readiness is llama-server's /health: a saturated or degraded pod still takes requests)",
    "no drain: a pod stopping drops the requests it is serving; rollouts are LLMKube's Recreate (every pod "
    "of the service down at once), not one pod at a time behind a drain",
    "no eviction turn-taking: the PodDisruptionBudget still holds node drains to rules.min_ready, but nothing "
    "restarts a pod for its own health",
    "no draft model: LLMKube's llamacpp runtime has no draft field; the draft Model is staged, and n-gram "
    "speculation flags pass through extraArgs, but a draft model's path inside LLMKube's pod is not known here",
    "one API key: llama-server reads it from the Secret through LLAMA_ARG_API_KEY, so the key file must hold "
    "a single key (no comments)",
    "the daemon's metrics and alerts (llm_appliance_*) do not exist; of our rules only llama-server's own "
    "series and `up` can fire",
)
# argv flags LLMKube sets itself (or that name a path inside our pod): left out of extraArgs with their value.
OWN_FLAGS = {
    "--host",
    "--port",
    "-m",
    "--model",
    "-c",
    "--ctx-size",
    "-np",
    "--parallel",
    "--api-key-file",
    "-md",
    "--model-draft",
    "--spec-draft-model",
}


def losses_text() -> str:
    return "On the llmkube route the fleet loses:\n" + "".join(f"  - {loss}\n" for loss in LOSSES)


def llmkube_objects(fleet: Fleet, members: list[ApplianceSet]) -> list[Manifest]:
    found: list[Manifest] = []
    for member in members:
        found += _models(fleet, member)
        found += [
            _inference_service(fleet, member),
            appliance_policy(fleet, member, members),
            _pod_monitor(fleet, member),
            meta(fleet, "PrometheusRule", MONITORING_API, member.name, labels(fleet, APPLIANCE, member.name))
            | {"spec": rule_groups(render(member.appliance)[RULES_FILE])},
        ]
    return [*found, disruption_budget(fleet)]


def _source(fleet: Fleet, member: ApplianceSet, path_in_pod: Path) -> str:
    """The model file as LLMKube fetches it: from the claim, or from the node directory, where it is staged."""
    assert fleet.kubernetes is not None
    models = fleet.kubernetes.models
    relative = path_in_pod.relative_to(member.models_dir)
    if models.claim:
        return f"pvc://{models.claim}/{relative}"
    return f"{models.host_path}/{relative}"


def _models(fleet: Fleet, member: ApplianceSet) -> list[Manifest]:
    spec = member.appliance.spec
    own = labels(fleet, APPLIANCE, member.name)
    found = []
    for role, model in (("target", spec.models.target), ("draft", spec.models.draft)):
        if model is None:
            continue
        hardware: Manifest = {"accelerator": "cuda" if member.gpus else "cpu"}
        if member.gpus:
            hardware["gpu"] = {"enabled": True, "count": member.gpus, "vendor": "nvidia"}
        found.append(
            meta(fleet, "Model", LLMKUBE, f"{member.name}-{role}", own)
            | {"spec": {"source": _source(fleet, member, model.path), "format": "gguf", "hardware": hardware}}
        )
    return found


def _extra_args(member: ApplianceSet) -> list[str]:
    args = list(member.appliance.argv[1:])
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in OWN_FLAGS:
            skip = True
        else:
            kept.append(arg)
    return kept


def _inference_service(fleet: Fleet, member: ApplianceSet) -> Manifest:
    a = member.appliance
    server = a.spec.server
    resources: Manifest = {"cpu": str(server.threads)}
    if member.gpus:
        resources["gpu"] = member.gpus
    spec: Manifest = {
        "modelRef": f"{member.name}-target",
        "replicas": member.replicas,
        "contextSize": server.ctx_size,
        "parallelSlots": server.parallel,
        "endpoint": {"port": a.server.port, "path": "/v1/chat/completions"},
        "resources": resources,
        "extraArgs": _extra_args(member),
        # Our PDB, NetworkPolicy and PodMonitor select the pods by these.
        "podLabels": labels(fleet, APPLIANCE, member.name),
        # LLMKube's llama.cpp image chooses its user; the rest of our pods' restrictions hold.
        "podSecurityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    if a.api_key_file is not None:
        key = {"secretKeyRef": {"name": secret_name(fleet), "key": API_KEYS}}
        spec["env"] = [{"name": "LLAMA_ARG_API_KEY", "valueFrom": key}]
    return meta(fleet, "InferenceService", LLMKUBE, member.name, labels(fleet, APPLIANCE, member.name)) | {"spec": spec}


def _pod_monitor(fleet: Fleet, member: ApplianceSet) -> Manifest:
    """llama-server's own metrics, under the job name and labels our rules select."""
    a = member.appliance
    own = [relabel(name, value) for name, value in sorted(a.spec.prometheus.labels.items())]
    endpoint: Manifest = {
        "targetPort": a.server.port,
        "path": "/metrics",
        "relabelings": [relabel("job", JOBS["server"]), *own],
    }
    if a.api_key_file is not None:
        endpoint["authorization"] = {"type": "Bearer", "credentials": {"name": secret_name(fleet), "key": API_KEYS}}
    return meta(fleet, "PodMonitor", MONITORING_API, member.name, labels(fleet, APPLIANCE, member.name)) | {
        "spec": {"selector": {"matchLabels": instance(member)}, "podMetricsEndpoints": [endpoint]}
    }
