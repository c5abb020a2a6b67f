"""Rules about where code lives, read from the source with `ast` so they hold for code not yet written."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "appliance"
RUNNER = "system/run.py"


def imported_modules(source: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_imported_modules_sees_every_spelling_of_an_import(tmp_path: Path) -> None:
    source = tmp_path / "sample.py"
    source.write_text(
        "import os, subprocess as sp\nfrom subprocess import run\ndef f():\n    import shlex\nfrom . import sibling\n"
    )
    assert imported_modules(source) == {"os", "subprocess", "shlex"}


def test_only_the_runner_imports_subprocess() -> None:
    importers = {
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if "subprocess" in {m.split(".")[0] for m in imported_modules(path)}
    }
    assert RUNNER in importers  # the walk does see the imports
    strays = importers - {RUNNER}
    assert strays == set(), f"{sorted(strays)} start programs themselves; go through appliance.system.run"
