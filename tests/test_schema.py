"""The committed JSON Schema is the spec model's, and the shipped examples conform to it."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLE_FACTS, EXAMPLES

from appliance.cli.commands import spec_schema

SCHEMA = Path(__file__).resolve().parent.parent / "schema" / "llm-appliance.schema.json"
REGENERATE = "regenerate it: llm-appliance schema > schema/llm-appliance.schema.json"


def _committed() -> dict[str, Any]:
    if not SCHEMA.is_file():
        pytest.fail(f"{SCHEMA} is missing; {REGENERATE}")
    return json.loads(SCHEMA.read_text())  # type: ignore[no-any-return]


def test_committed_schema_is_the_spec_models() -> None:
    assert _committed() == spec_schema(), f"{SCHEMA.name} is out of date with appliance/spec.py; {REGENERATE}"


def test_committed_schema_is_the_commands_output() -> None:
    expected = json.dumps(spec_schema(), indent=2, sort_keys=True) + "\n"
    assert SCHEMA.read_text() == expected, f"{SCHEMA.name} is not byte for byte `llm-appliance schema`; {REGENERATE}"


def test_schema_describes_the_spec() -> None:
    schema = _committed()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["title"] == "llm-appliance spec"
    assert schema["additionalProperties"] is False
    assert {"server", "models", "speculative", "memory", "network", "prometheus"} <= set(schema["properties"])
    assert schema["$defs"]["Models"]["required"] == ["target"]


@pytest.fixture(scope="module")
def validator() -> Any:
    jsonschema = pytest.importorskip("jsonschema")
    schema = _committed()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("name", sorted(EXAMPLE_FACTS))
def test_example_conforms_to_the_schema(validator: Any, name: str) -> None:
    document = tomllib.loads((EXAMPLES / name).read_text())
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]
    assert errors == []


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["speculative"].update(type=["draft-simple", "ngram-mod"]),
        lambda d: d["speculative"].update(type="draft-simple,ngram-mod"),
        lambda d: d["speculative"].update(type="ngram-mod", ngram_mod={"n_match": 16, "n_min": 8, "n_max": 32}),
        lambda d: d["speculative"].update(ngram_map_k={"size_n": 12, "size_m": 48, "min_hits": 1}),
    ],
)
def test_schema_accepts_the_speculation_types_and_their_parameters(validator: Any, change: Any) -> None:
    document = tomllib.loads((EXAMPLES / "appliance.toml").read_text())
    change(document)
    assert [e.message for e in validator.iter_errors(document)] == []


@pytest.mark.parametrize(
    ("change", "where"),
    [
        (lambda d: d["server"].update(prot=8080), "server"),  # unknown key
        (lambda d: d["server"].update(port="8080"), "server.port"),  # wrong type
        (lambda d: d["server"].update(port=70000), "server.port"),  # out of range
        # which names exist is the binary's to say (test_dialect.py); the schema holds their shape
        (lambda d: d["speculative"].update(type="draft magic"), "speculative.type"),
        (lambda d: d["speculative"].update(type=[]), "speculative.type"),
        (lambda d: d["speculative"].update(ngram_mod={"n_matchh": 16}), "speculative.ngram_mod"),  # unknown key
        (lambda d: d["speculative"].update(ngram_simple={"size_n": 2000}), "speculative.ngram_simple"),  # above 1024
        (lambda d: d["models"].pop("target"), "models"),  # required
    ],
)
def test_schema_rejects_a_broken_example(validator: Any, change: Any, where: str) -> None:
    document = tomllib.loads((EXAMPLES / "appliance.toml").read_text())
    change(document)
    locations = [".".join(map(str, e.absolute_path)) for e in validator.iter_errors(document)]
    assert where in locations
