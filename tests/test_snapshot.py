"""The applied snapshot: each example's resolved appliance reads back from its JSON as the same value, and a
snapshot of another version, or lacking a field, is refused with what to run."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLE_FACTS

from appliance.plan.resolved import SNAPSHOT_VERSION, Appliance, SnapshotError, resolve
from appliance.plan.validate import validate
from appliance.render.apply import installed_spec_path

REAPPLY = "re-run `llm-appliance apply SPEC`"


def resolved(example: Callable[[str], Path], name: str) -> Appliance:
    spec = example(name)
    return resolve(validate(spec, facts=EXAMPLE_FACTS[name]).plan, installed_spec_path(spec))


@pytest.mark.parametrize("name", sorted(EXAMPLE_FACTS))
def test_the_snapshot_reads_back_as_the_resolved_appliance(
    example: Callable[[str], Path], name: str, tmp_path: Path
) -> None:
    appliance = resolved(example, name)
    snapshot = tmp_path / "appliance.json"
    snapshot.write_text(appliance.to_json("test"))
    assert Appliance.read(snapshot) == appliance
    document = json.loads(snapshot.read_text())
    assert document["snapshot_version"] == SNAPSHOT_VERSION
    # every field is a line of the snapshot: the spec and its file at the top, the rest resolved
    fields = {field.name for field in dataclasses.fields(Appliance)}
    assert fields == {"spec", "spec_file", *document["resolved"]}


def refusal(document: dict[str, Any], tmp_path: Path) -> str:
    snapshot = tmp_path / "appliance.json"
    snapshot.write_text(json.dumps(document))
    with pytest.raises(SnapshotError) as refused:
        Appliance.read(snapshot)
    return str(refused.value).removeprefix(f"cannot read {snapshot}: ")


def test_a_snapshot_of_another_version_is_refused(example: Callable[[str], Path], tmp_path: Path) -> None:
    document = resolved(example, "demo.toml").document()
    assert (
        refusal({**document, "snapshot_version": 1}, tmp_path)
        == f"snapshot version 1, expected {SNAPSHOT_VERSION}; {REAPPLY}"
    )
    del document["snapshot_version"]
    assert refusal(document, tmp_path) == f"snapshot version None, expected {SNAPSHOT_VERSION}; {REAPPLY}"


def test_a_snapshot_lacking_a_field_is_refused_not_defaulted(example: Callable[[str], Path], tmp_path: Path) -> None:
    document = resolved(example, "demo.toml").document()
    # what a version-1 snapshot of an older llm-appliance lacked, read then as a silent default
    for name in ("alias", "speculation", "planned_host_bytes"):
        del document["resolved"][name]
    message = "it lacks resolved.alias, resolved.speculation, resolved.planned_host_bytes"
    assert refusal(document, tmp_path) == f"{message}; {REAPPLY}"
    del document["spec"]
    assert refusal(document, tmp_path) == f"it lacks spec, {message.removeprefix('it lacks ')}; {REAPPLY}"


def test_a_snapshot_with_a_field_unknown_or_wrong_is_refused(example: Callable[[str], Path], tmp_path: Path) -> None:
    document = resolved(example, "demo.toml").document()
    unknown = {**document, "resolved": {**document["resolved"], "draft_path": "/x.gguf"}}
    assert (
        refusal(unknown, tmp_path)
        == f"resolved.draft_path is no field of snapshot version {SNAPSHOT_VERSION}; {REAPPLY}"
    )
    wrong = {**document, "resolved": {**document["resolved"], "server": {"host": "127.0.0.1", "port": "http"}}}
    assert refusal(wrong, tmp_path).startswith("resolved.server.port: Input should be a valid integer")
    assert refusal([], tmp_path) == f"not an applied appliance; {REAPPLY}"  # type: ignore[arg-type]
