"""The layout shows the architecture: every import of one subpackage by another points down the floors."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "appliance"
FLOORS = {
    "system": 0,
    "spec": 1,
    "facts": 2,
    "plan": 3,
    "render": 4,
    "runtime": 4,
    "health": 5,
    "ops": 6,
    "measure": 6,
    "fleet": 6,
    "k8s": 7,
    "cli": 8,
}


def imports(path: Path) -> set[str]:
    """The appliance subpackages a module imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        found |= {name.split(".")[1] for name in names if name.startswith("appliance.")}
    return found


def test_every_subpackage_has_a_floor() -> None:
    assert {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()} == set(FLOORS)


@pytest.mark.parametrize("module", sorted(PACKAGE.glob("*/*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(module: Path) -> None:
    own = module.parent.name
    upward = {name for name in imports(module) - {own} if FLOORS[name] >= FLOORS[own]}
    assert not upward, f"{module.relative_to(PACKAGE)} (floor {FLOORS[own]}) imports {sorted(upward)}"


def test_the_floor_check_sees_an_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "probe.py"
    module.write_text("def f():\n    from appliance.cli.main import main\n    import appliance.health.daemon\n")
    assert imports(module) == {"cli", "health"}
