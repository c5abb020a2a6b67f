"""Offline checks of rendered Kubernetes objects: the Kubernetes OpenAPI schemas (kubernetes-validate), a
CRD's openAPIV3Schema (jsonschema, unknown fields refused as `kubectl apply`'s strict field validation
refuses them) and its x-kubernetes-validations rules (CEL, by cel-python)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import yaml

KUBERNETES_VERSION = "1.30"
LLMKUBE_CRDS = Path(__file__).parent / "data" / "llmkube"
# prometheus-operator's kinds: no schema of theirs is vendored; their rules are checked by promtool instead.
UNCHECKED_KINDS = {"PodMonitor", "PrometheusRule"}


def load(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(path.read_text())
    return document


def validate_kubernetes(manifest: dict[str, Any]) -> None:
    """Raises kubernetes_validate.ValidationError for an object the API server's schema refuses (strict:
    unknown fields too)."""
    kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def crd_schema(kind: str) -> dict[str, Any]:
    for path in sorted(LLMKUBE_CRDS.glob("*.yaml")):
        crd = load(path)
        if crd["spec"]["names"]["kind"] == kind:
            version = next(v for v in crd["spec"]["versions"] if v["storage"])
            schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
            return schema
    raise KeyError(kind)


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with every object that lists its properties closed to others (as the API server prunes or,
    strict, refuses them), x-kubernetes-* keywords left to the CEL walk."""
    schema = copy.deepcopy(schema)

    def close(node: Any) -> None:
        if isinstance(node, dict):
            open_to_more = "additionalProperties" in node or node.get("x-kubernetes-preserve-unknown-fields")
            if "properties" in node and not open_to_more:
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


def cel_failures(schema: dict[str, Any], value: Any, where: str = "") -> list[str]:
    """Every x-kubernetes-validations rule along `value` that does not hold, by path and message."""
    found: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        environment = celpy.Environment()
        program = environment.program(environment.compile(rule["rule"]))
        if not program.evaluate({"self": celpy.json_to_cel(value)}):
            found.append(f"{where or '.'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for name, child in value.items():
            sub = schema.get("properties", {}).get(name) or schema.get("additionalProperties")
            if isinstance(sub, dict):
                found += cel_failures(sub, child, f"{where}.{name}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, child in enumerate(value):
            found += cel_failures(schema["items"], child, f"{where}[{index}]")
    return found


def validate_crd_object(manifest: dict[str, Any], schema: dict[str, Any]) -> None:
    """Raises jsonschema.ValidationError, or AssertionError naming the CEL rules that fail."""
    jsonschema.validate(manifest, _closed(schema))
    failures = cel_failures(schema, manifest)
    assert not failures, failures
