"""`k8s render`'s output: a kustomize tree per flavour, one file per object and a kustomization.yaml listing
them, as YAML a person reads (multi-line text as literal blocks, keys in the order written). Pure: the same
fleet gives the same bytes."""

from __future__ import annotations

import yaml

from appliance import __version__
from appliance.fleet.load import LoadedFleet
from appliance.k8s.balancer import balancer
from appliance.k8s.llmkube import llmkube_objects
from appliance.k8s.members import ApplianceSet
from appliance.k8s.monitoring import monitoring
from appliance.k8s.names import Manifest, namespace_of
from appliance.k8s.policy import appliance_policy, balancer_policy, disruption_budget
from appliance.k8s.workload import workload

FLAVORS = ("plain", "llmkube")


class _Dumper(yaml.SafeDumper):
    """Block style throughout; text of several lines (a spec, haproxy.cfg, a dashboard) as a literal block; no
    anchors (a label set used twice is printed twice, as a person writes it)."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


def dump(manifest: Manifest, header: str) -> str:
    body = yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)
    return f"# {header}\n{body}"


def header_of(fleet: LoadedFleet, flavor: str) -> str:
    return (
        f"generated from {fleet.path.name} by llm-appliance {__version__}; edit the fleet file and run "
        f"`llm-appliance k8s render --flavor {flavor}`, not this file"
    )


def plain_objects(fleet: LoadedFleet, members: list[ApplianceSet]) -> list[Manifest]:
    f = fleet.fleet
    header = header_of(fleet, "plain")
    found: list[Manifest] = [_namespace(fleet)]
    for member in members:
        found += [*workload(f, member), appliance_policy(f, member, members)]
    found += [disruption_budget(f), *balancer(f, members, header), balancer_policy(f, members)]
    return found + monitoring(f, members, header)


def render_tree(fleet: LoadedFleet, members: list[ApplianceSet], flavor: str) -> dict[str, str]:
    """Every file of the flavour's tree, by path relative to it."""
    objects = (
        plain_objects(fleet, members)
        if flavor == "plain"
        else [_namespace(fleet), *llmkube_objects(fleet.fleet, members)]
    )
    header = header_of(fleet, flavor)
    files = {f"{o['kind'].lower()}-{o['metadata']['name']}.yaml": dump(o, header) for o in objects}
    assert len(files) == len(objects), "two objects of one kind share a name"
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": namespace_of(fleet.fleet),
        "resources": list(files),
    }
    return files | {"kustomization.yaml": dump(kustomization, header)}


def _namespace(fleet: LoadedFleet) -> Manifest:
    name = namespace_of(fleet.fleet)
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
