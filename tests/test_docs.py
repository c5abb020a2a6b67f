"""The manual stays true to the code: README.md and docs/*.md link only to files and headings that exist, the
operations page names every command of the real parser with its options, the floor table is test_floors.py's,
and the README stays a front page that fits a screen or two."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

from appliance.cli.parser import parser

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 200
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, file:


def prose(text: str) -> str:
    """The text a reader sees as markdown: fenced blocks and inline code blanked (lines kept, for line numbers)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"`[^`\n]*`", "", re.sub(r"``.+?``", "", line)))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor, with GitHub's -1, -2 for a repeated one."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose(text).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of a page that lead nowhere: a missing file, or an anchor no heading there has."""
    broken = []
    for number, line in enumerate(prose(page.read_text()).splitlines(), 1):
        for target in LINK.findall(line):
            if EXTERNAL.match(target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.name}:{number}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest.read_text())):
                broken.append(f"{where} (no heading #{anchor} in {dest.name})")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert not broken_links(page)


def test_the_link_check_sees_a_missing_file_and_heading(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## The router's virtualenv\n\n## install.sh\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#the-routers-virtualenv) [ok](other.md#installsh) [ok](#page) [ok](https://x.org/a)\n"
        "`[in code](gone.md)`\n```\n[in a block](gone.md)\n```\n"
        "[gone](gone.md) [no such heading](other.md#nothing) [here neither](#nowhere) ![chart](gone.png)\n"
    )
    assert [entry.split(": ", 1)[1] for entry in broken_links(page)] == [
        "gone.md (no such file)",
        "other.md#nothing (no heading #nothing in other.md)",
        "#nowhere (no heading #nowhere in page.md)",
        "gone.png (no such file)",
    ]


def test_slugs_are_githubs() -> None:
    assert slug("A fleet's fallback") == "a-fleets-fallback"
    assert slug("bench and tune") == "bench-and-tune"
    assert slug("`status`, the journal (and more)") == "status-the-journal-and-more"
    assert slug("snake_case and dash-case") == "snake_case-and-dash-case"
    assert anchors("# Notes\n## Notes\n## Notes\n") == {"notes", "notes-1", "notes-2"}


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = (REPO / "README.md").read_text()
    assert [page.name for page in PAGES[1:] if f"](docs/{page.name}" not in readme] == []


def commands() -> dict[str, list[str]]:
    """Every command of the real parser ("engine prove", "status"), with its long options."""
    found: dict[str, list[str]] = {}

    def walk(p: argparse.ArgumentParser, prefix: list[str]) -> None:
        groups = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not groups and prefix:
            options = [o for a in p._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
            found[" ".join(prefix)] = options
        for group in groups:
            for name, sub in group.choices.items():
                walk(sub, [*prefix, name])

    walk(parser(), [])
    return found


COMMANDS = commands()


def command_rows(text: str, command: str) -> list[str]:
    """The table rows of a page that describe `llm-appliance COMMAND` (not a longer command it prefixes)."""
    return [line for line in text.splitlines() if re.match(rf"\| `llm-appliance {re.escape(command)}[ `]", line)]


def test_the_parser_walk_finds_every_kind_of_command() -> None:
    assert {"status", "engine prove", "models fetch", "fleet validate", "k8s render"} <= set(COMMANDS)
    assert "engine" not in COMMANDS and "--flavor" in COMMANDS["k8s render"]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_is_on_the_operations_page_with_its_options(command: str) -> None:
    rows = command_rows((DOCS / "operations.md").read_text(), command)
    assert len(rows) == 1, f"docs/operations.md needs one row for `llm-appliance {command}`, has {len(rows)}"
    assert [option for option in COMMANDS[command] if option not in rows[0]] == []


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_is_on_the_front_page(command: str) -> None:
    assert len(command_rows((REPO / "README.md").read_text(), command)) == 1


def test_the_command_check_sees_a_missing_command_and_option() -> None:
    text = "| `llm-appliance router-install` | x |\n| `llm-appliance status [--json]` | x |\n"
    assert command_rows(text, "router") == [] and command_rows(text, "router-install") != []
    assert "--state-dir" not in command_rows(text, "status")[0]


def floors_of_the_test() -> dict[str, int]:
    """tests/test_floors.py's FLOORS, read as the literal it is (a test module imports no other)."""
    tree = ast.parse((REPO / "tests/test_floors.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "FLOORS" for t in node.targets):
            value = ast.literal_eval(node.value)
            assert isinstance(value, dict)
            return value
    raise AssertionError("tests/test_floors.py has no FLOORS")


def floor_table(text: str) -> dict[str, int]:
    """The floors as a page's table says them: its rows `| N | `appliance.a`, `appliance.b` | ... |`."""
    table = {}
    for line in text.splitlines():
        match = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if match:
            table.update({package: int(match.group(1)) for package in re.findall(r"appliance\.(\w+)", match.group(2))})
    return table


def test_the_floor_table_is_test_floors() -> None:
    floors = floors_of_the_test()
    assert floors and floor_table((DOCS / "architecture.md").read_text()) == floors


def test_the_floor_check_sees_a_stale_table() -> None:
    stale = "| 6 | `appliance.ops`, `appliance.measure`, `appliance.fleet` | x |\n| 7 | `appliance.cli` | x |\n"
    table = floor_table(stale)
    assert table == {"ops": 6, "measure": 6, "fleet": 6, "cli": 7}
    assert table != {k: v for k, v in floors_of_the_test().items() if k in table}


def test_the_readme_is_a_front_page() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move the rest into docs/"
