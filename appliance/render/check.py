"""Check rendered files with the tools that will read them, before apply writes any of them.

Validation should stop every bad value, but a template can still print one that a reader refuses
(a quote in YAML, a calendar expression systemd cannot parse). Written under /etc, such a file takes the
appliance down at the next daemon-reload or Prometheus reload; checked here, apply writes nothing instead.
The tools check a private copy of the tree: what they say is shown with paths relative to the root.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from appliance.system import paths
from appliance.system.run import CommandFailed, run
from appliance.system.users import account

# Each checker reads a few small files in well under a second; a minute means it hangs.
TIMEOUT = 60.0
UNIT_DIR = "etc/systemd/system/"
RENDERED_DIR = f"{paths.RENDERED.relative_to('/')}/"
SBIN = "/usr/sbin:/sbin"  # nft is root's tool: a user's PATH may not name these


@dataclass(frozen=True)
class Rejection:
    path: str  # the rendered file, relative to the root
    checker: str  # the tool as it was run, e.g. "systemd-analyze verify"
    words: tuple[str, ...]  # the lines of its output that say what is wrong

    def __str__(self) -> str:
        return f"{self.path} ({self.checker}):" + "".join(f"\n    {line}" for line in self.words)


@dataclass(frozen=True)
class Checked:
    rejections: tuple[Rejection, ...] = ()
    notes: tuple[str, ...] = ()  # checkers that did not run, and why: e.g. "promtool not found, ..."

    def __add__(self, other: Checked) -> Checked:
        return Checked(self.rejections + other.rejections, self.notes + other.notes)


class RenderRejected(Exception):
    """A rendered file failed its checker; nothing was written."""

    def __init__(self, rejections: Iterable[Rejection]) -> None:
        self.rejections = tuple(rejections)
        super().__init__(
            "the rendered files fail their own checks; nothing was written:\n"
            + "\n".join(f"  {rejection}" for rejection in self.rejections)
            + "\nThe spec validated, so validation let through the value these lines name: change it in the "
            "spec, and report the spec to llm-appliance."
        )


@dataclass(frozen=True)
class Tree:
    """The rendered files written under `root`, a private directory."""

    root: Path
    files: dict[str, str]

    def path(self, relative: str) -> Path:
        return self.root / relative

    def ending(self, suffix: str) -> list[str]:
        """The rendered files whose names end in `suffix`, in a fixed order. Only under rendered/: the spec
        installed beside it has a name of the admin's choosing, which may end in .json or .nft too."""
        return sorted(r for r in self.files if r.startswith(RENDERED_DIR) and r.endswith(suffix))

    def lines(self, output: str) -> list[str]:
        """A tool's output, non-blank lines, with the private directory taken out of the paths it names."""
        return [
            # rstrip: nft marks the fault with carets under its source line, aligned by the leading blanks.
            line.replace(f"{self.root}/", "").replace(f"{self.root.parent}/", "").rstrip()
            for line in output.splitlines()
            if line.strip()
        ]


def tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=SBIN)


def check_tree(files: dict[str, str]) -> Checked:
    """Every checker that applies, run over `files` ({path relative to the root: text})."""
    top = Path(tempfile.mkdtemp(prefix="llm-appliance-check-"))  # mode 0700: nobody else reads or swaps them
    try:
        tree = Tree(top / "root", files)
        for relative, text in files.items():
            tree.path(relative).parent.mkdir(parents=True, exist_ok=True)
            tree.path(relative).write_text(text)
        checked = Checked()
        for checker in CHECKERS:
            checked += checker(tree)
        return checked
    finally:
        shutil.rmtree(top, ignore_errors=True)


def require_accepted(files: dict[str, str], note: Callable[[str], None]) -> None:
    """Check `files`, tell `note` which checkers were skipped, and raise RenderRejected on any rejection."""
    checked = check_tree(files)
    for line in checked.notes:
        note(line)
    if checked.rejections:
        raise RenderRejected(checked.rejections)


def _run(argv: list[str]) -> tuple[int | None, str]:
    try:
        # quiet: a read-only probe of a private copy; its verdict is what apply reports.
        result = run(argv, check=False, timeout=TIMEOUT, quiet=True)
    except CommandFailed as exc:  # could not start, or hung: no verdict, so no pass either
        return None, str(exc)
    return result.returncode, result.stdout + result.stderr


def _skipped(name: str, what: str) -> Checked:
    return Checked(notes=(f"{name} not found, {what} not checked",))


# --- systemd units ---


def _cli_not_installed(line: str) -> bool:
    # Units name the installed CLI. Before install has put it there (a first `apply --root` into a staging
    # directory, the tests) verify says it is missing: true of this machine, not a fault of the units.
    # Only that one complaint is excused; any other missing command stays a rejection.
    return (
        re.fullmatch(rf"\S+: Command {re.escape(str(paths.CLI))} is not executable: No such file or directory", line)
        is not None
    )


def units(tree: Tree) -> Checked:
    names = [relative for relative in sorted(tree.files) if relative.startswith(UNIT_DIR)]
    if not names:
        return Checked()
    analyze = tool("systemd-analyze")
    if analyze is None:
        return _skipped("systemd-analyze", "units")
    code, output = _run([analyze, "verify", *(str(tree.path(name)) for name in names)])
    lines = tree.lines(output)
    said: dict[str, list[str]] = {}
    excused = False
    for line in lines:
        # verify exits 0 on unknown keys and unparsable values: a line naming a unit is a rejection either way.
        unit = next((name for name in names if Path(name).name in line), None)
        if unit is not None and _cli_not_installed(line):
            excused = True
        elif unit is not None:
            said.setdefault(unit, []).append(line)
    if said:
        return Checked(tuple(Rejection(unit, "systemd-analyze verify", tuple(words)) for unit, words in said.items()))
    if code != 0 and not excused:
        return Checked((Rejection(names[0], "systemd-analyze verify", tuple(lines) or (f"exited {code}",)),))
    return Checked()


# --- nftables ---


def ruleset(tree: Tree) -> Checked:
    checked = Checked()
    for name in tree.ending(".nft"):
        nft = tool("nft")
        if nft is None:
            return _skipped("nft", "ruleset")
        if os.geteuid() != 0:
            return Checked(notes=("nft -c needs root (it asks the kernel), ruleset not checked",))
        if "meta skuid" in tree.files[name] and account() is None:
            # nft resolves the user name while checking: before install creates it, every ruleset would fail.
            return Checked(
                notes=(f"user {paths.SERVICE_USER} does not exist yet (nft resolves it), ruleset not checked",)
            )
        code, output = _run([nft, "-c", "-f", str(tree.path(name))])
        if code != 0:
            checked += Checked((Rejection(name, "nft -c -f", tuple(tree.lines(output))),))
    return checked


# --- Prometheus ---


def _promtool_said(tree: Tree, output: str) -> tuple[str, ...]:
    # Its progress lines name the files; FAILED: alone heads the lines that say why.
    return tuple(
        dict.fromkeys(  # a YAML error is said twice
            line.strip()
            for line in tree.lines(output)
            if line.strip() != "FAILED:" and not line.strip().startswith(("Checking ", "SUCCESS"))
        )
    )


def prometheus(tree: Tree) -> Checked:
    rules, scrapes = tree.ending(".rules.yml"), tree.ending("scrape.yml")
    if not rules and not scrapes:
        return Checked()
    promtool = tool("promtool")
    if promtool is None:
        return _skipped("promtool", "alert rules and scrape jobs")
    checked, accepted = Checked(), []
    for name in rules:
        code, output = _run([promtool, "check", "rules", str(tree.path(name))])
        if code == 0:
            accepted.append(name)
        else:
            checked += Checked((Rejection(name, "promtool check rules", _promtool_said(tree, output)),))
    for name in scrapes:
        # The snippet is a list of jobs for scrape_configs:, so it is checked inside a config, as the README
        # says to use it. Rules already rejected stay out: their words are reported once, above.
        config = tree.root.parent / "prometheus.yml"
        config.write_text(_wrapper(tree.files[name], [tree.path(r) for r in accepted]))
        code, output = _run([promtool, "check", "config", str(config)])
        if code != 0:
            checked += Checked((Rejection(name, "promtool check config", _promtool_said(tree, output)),))
    return checked


def _wrapper(snippet: str, rule_files: list[Path]) -> str:
    jobs = "".join(f"  {line}" if line.strip() else line for line in snippet.splitlines(keepends=True))
    listed = "".join(f"  - {path}\n" for path in rule_files)
    return f"global:\n  scrape_interval: 15s\nrule_files:\n{listed}scrape_configs:\n{jobs}"


# --- JSON ---


def json_files(tree: Tree) -> Checked:
    checked = Checked()
    for name in tree.ending(".json"):
        try:
            json.loads(tree.files[name])
        except ValueError as exc:
            checked += Checked((Rejection(name, "json", (str(exc),)),))
    return checked


CHECKERS: tuple[Callable[[Tree], Checked], ...] = (units, ruleset, prometheus, json_files)
