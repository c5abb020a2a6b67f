"""Every shipped example validates, and renders to the committed golden files."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import EXAMPLE_FACTS, INSTALLED_MODELS

from appliance.plan.resolved import resolve
from appliance.plan.validate import validate
from appliance.render.apply import installed_spec_path
from appliance.render.render import render

GOLDEN = Path(__file__).parent / "golden"


def rendered(example: Callable[[str], Path], name: str, fixture_models: Path) -> dict[str, str]:
    spec = example(name)
    result = validate(spec, facts=EXAMPLE_FACTS[name])
    files = render(resolve(result.plan, installed_spec_path(spec)))
    return {path: text.replace(str(fixture_models), INSTALLED_MODELS) for path, text in files.items()}


@pytest.mark.parametrize("name", sorted(EXAMPLE_FACTS))
def test_example_validates_without_warnings(example: Callable[[str], Path], name: str) -> None:
    result = validate(example(name), facts=EXAMPLE_FACTS[name])
    assert [p.render() for p in result.warnings] == []


@pytest.mark.parametrize("name", sorted(EXAMPLE_FACTS))
def test_example_renders_its_golden_files(example: Callable[[str], Path], name: str, fixture_models: Path) -> None:
    files = rendered(example, name, fixture_models)
    golden = GOLDEN / name.removesuffix(".toml")
    if os.environ.get("UPDATE_GOLDEN"):
        for path, text in files.items():
            (golden / path).parent.mkdir(parents=True, exist_ok=True)
            (golden / path).write_text(text)
    expected = {str(p.relative_to(golden)): p.read_text() for p in golden.rglob("*") if p.is_file()}
    assert sorted(files) == sorted(expected)
    for path, text in files.items():
        assert text == expected[path], f"{path} differs from its golden; UPDATE_GOLDEN=1 rewrites them after review"


@pytest.mark.parametrize("name", sorted(EXAMPLE_FACTS))
def test_rendering_is_deterministic(example: Callable[[str], Path], name: str, fixture_models: Path) -> None:
    assert rendered(example, name, fixture_models) == rendered(example, name, fixture_models)
