"""apply checks the rendered files with their real checkers before it writes any: a rejection is reported in
the checker's own words and nothing is written; a checker that is not installed is skipped, with a note.

Validation should stop bad values before rendering, so the bad files are made here directly: the demo's real
render, with one file corrupted the way a template printing an unchecked value would.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

import appliance.cli.commands
import appliance.render.check
from appliance.cli.commands import EXIT_INVALID, EXIT_OK
from appliance.cli.main import main
from appliance.plan.resolved import Appliance, resolve
from appliance.plan.validate import validate
from appliance.render.apply import installed_spec_path
from appliance.render.check import check_tree
from appliance.render.render import render
from appliance.system import paths

pytestmark = pytest.mark.system

TIMER = f"etc/systemd/system/{paths.RESTART_TIMER}"
SERVER = f"etc/systemd/system/{paths.SERVER_UNIT}"
NFT = "etc/llm-appliance/rendered/llm-appliance.nft"
RULES = "etc/llm-appliance/rendered/prometheus/llm-appliance.rules.yml"
SCRAPE = "etc/llm-appliance/rendered/prometheus/scrape.yml"
SNAPSHOT = "etc/llm-appliance/rendered/appliance.json"
Corruption = Callable[[dict[str, str]], None]


def _replace(path: str, old: str, new: str) -> Corruption:
    def corrupt(files: dict[str, str]) -> None:
        assert old in files[path], f"{old!r} not in {path}"
        files[path] = files[path].replace(old, new, 1)

    return corrupt


# Each checker kind: (file, corruption, checker as reported, the checker's own words).
CORRUPTIONS = {
    "systemd-analyze": (
        TIMER,
        _replace(TIMER, "OnCalendar=", "OnCalendar=whenever it suits\n# was: "),
        "systemd-analyze verify",
        "Failed to parse calendar specification, ignoring: whenever it suits",
    ),
    "nft": (NFT, _replace(NFT, "chain input {", "chain input {{"), "nft -c -f", "Error: syntax error"),
    "promtool-rules": (
        RULES,
        _replace(RULES, "== 0\n", "== 0 +\n"),
        "promtool check rules",
        "could not parse expression",
    ),
    "promtool-config": (
        SCRAPE,
        _replace(SCRAPE, "scrape_interval: ", "scrape_interval: fortnight #"),
        "promtool check config",
        'not a valid duration string: "fortnight',
    ),
    "json": (SNAPSHOT, _replace(SNAPSHOT, "{", "{,"), "json", "Expecting property name enclosed in double quotes"),
}


@pytest.fixture
def demo(example: Callable[..., Path]) -> Path:
    return example("demo-draft.toml")


def corrupted_render(monkeypatch: pytest.MonkeyPatch, corrupt: Corruption) -> None:
    """The CLI's render, with one file corrupted after the real render."""

    def bad_render(appliance: Appliance) -> dict[str, str]:
        files = render(appliance)
        corrupt(files)
        return files

    monkeypatch.setattr(appliance.cli.commands, "render", bad_render)


def cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
@pytest.mark.parametrize("command", ["apply", "apply --dry-run", "render --out"])
def test_a_rejected_file_is_reported_in_its_checkers_words_and_nothing_is_written(
    kind: str,
    command: str,
    demo: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, corrupt, checker, words = CORRUPTIONS[kind]
    corrupted_render(monkeypatch, corrupt)
    root = tmp_path / "root"
    root.mkdir()
    verb, *options = command.split()
    where = ["--out", root] if verb == "render" else ["--root", root, *options]
    code, out, err = cli(capsys, verb, demo, *where)
    assert (code, out) == (EXIT_INVALID, ""), err
    assert err.startswith(
        f"{verb}: the rendered files fail their own checks; nothing was written:\n  {path} ({checker}):\n"
    )
    assert words in err
    assert str(tmp_path) not in err  # the private copy's paths are shown relative to the root
    assert list(root.iterdir()) == []
    assert "Traceback" not in err


def test_apply_with_an_earlier_install_leaves_it_unchanged(
    demo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    assert cli(capsys, "apply", demo, "--root", root)[0] == EXIT_OK
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    demo.write_text(demo.read_text().replace("temperature = 0.0 ", "temperature = 0.2 "))  # changes the snapshot
    corrupted_render(monkeypatch, CORRUPTIONS["systemd-analyze"][1])
    code, _, err = cli(capsys, "apply", demo, "--root", root)
    assert code == EXIT_INVALID and "whenever it suits" in err
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before


def test_every_rejection_is_reported_at_once(
    demo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def corrupt_all(files: dict[str, str]) -> None:
        for _, corrupt, _, _ in CORRUPTIONS.values():
            corrupt(files)

    corrupted_render(monkeypatch, corrupt_all)
    code, _, err = cli(capsys, "apply", demo, "--root", tmp_path / "root")
    assert code == EXIT_INVALID
    for path, _, checker, words in CORRUPTIONS.values():
        assert f"  {path} ({checker}):\n" in err and words in err
    assert not (tmp_path / "root").exists()


# --- what check_tree says, directly ---


def demo_files(demo: Path) -> dict[str, str]:
    return render(resolve(validate(demo).plan, installed_spec_path(demo)))


def test_the_demo_passes_every_checker_and_the_private_copy_is_removed(
    demo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(appliance.render.check.tempfile, "tempdir", str(private))
    checked = check_tree(demo_files(demo))
    assert (checked.rejections, checked.notes) == ((), ())
    assert list(private.iterdir()) == []


def test_the_private_copy_is_private(demo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    modes: list[int] = []
    real_units = appliance.render.check.units

    def units(tree: appliance.render.check.Tree) -> appliance.render.check.Checked:
        modes.append(tree.root.parent.stat().st_mode & 0o777)
        return real_units(tree)

    monkeypatch.setattr(appliance.render.check, "CHECKERS", (units,))
    check_tree(demo_files(demo))
    assert modes == [0o700]


def test_a_missing_tool_is_skipped_with_a_note(demo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A PATH with every tool but promtool (nft is also found in sbin, as root's PATH would).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("systemd-analyze", "nft"):
        found = appliance.render.check.tool(name)
        assert found is not None
        (bin_dir / name).symlink_to(found)
    monkeypatch.setenv("PATH", str(bin_dir))
    files = demo_files(demo)
    _replace(RULES, "== 0\n", "== 0 +\n")(files)  # promtool would reject it; it does not run
    checked = check_tree(files)
    assert checked.notes == ("promtool not found, alert rules and scrape jobs not checked",)
    assert checked.rejections == ()
    # The others still run.
    _replace(TIMER, "OnCalendar=", "OnCalendar=whenever it suits\n# was: ")(files)
    assert [r.path for r in check_tree(files).rejections] == [TIMER]


def test_the_cli_prints_the_note_and_applies(
    demo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(appliance.render.check, "tool", lambda name: None)
    code, _, err = cli(capsys, "apply", demo, "--root", tmp_path / "root")
    assert code == EXIT_OK
    assert err.splitlines() == [
        "check: systemd-analyze not found, units not checked",
        "check: nft not found, ruleset not checked",
        "check: promtool not found, alert rules and scrape jobs not checked",
    ]


def test_nft_is_skipped_before_the_service_user_exists(demo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # nft resolves `meta skuid "llm-appliance"` while checking; the user is created by install.
    monkeypatch.setattr(appliance.render.check, "account", lambda: None)
    files = demo_files(demo)
    _replace(NFT, "chain input {", "chain input {{")(files)
    checked = check_tree(files)
    assert checked.notes == (f"user {paths.SERVICE_USER} does not exist yet (nft resolves it), ruleset not checked",)
    assert checked.rejections == ()


def test_a_cli_not_installed_yet_is_excused_but_no_other_missing_command(
    demo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rendered for a CLI that is not there: verify says so for each unit that runs it, and exits 1.
    monkeypatch.setattr(paths, "CLI", tmp_path / "not-installed" / "llm-appliance")
    files = demo_files(demo)
    assert str(paths.CLI) in files[SERVER]
    assert check_tree(files).rejections == ()
    _replace(SERVER, "ExecStartPre=+/usr/sbin/nft", "ExecStartPre=+/usr/sbin/no-such-nft")(files)
    (rejection,) = check_tree(files).rejections
    assert rejection.path == SERVER and rejection.checker == "systemd-analyze verify"
    assert rejection.words == (
        f"{paths.SERVER_UNIT}: Command /usr/sbin/no-such-nft is not executable: No such file or directory",
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="runs as root to check that nft does run then")
def test_nft_runs_as_root(demo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = demo_files(demo)
    _replace(NFT, "chain input {", "chain input {{")(files)
    assert [r.checker for r in check_tree(files).rejections] == ["nft -c -f"]
    monkeypatch.setattr(appliance.render.check.os, "geteuid", lambda: 1000)
    checked = check_tree(files)
    assert (checked.rejections, checked.notes) == ((), ("nft -c needs root (it asks the kernel), ruleset not checked",))


def test_the_installed_spec_is_not_taken_for_a_rendered_file(demo: Path) -> None:
    # apply installs the spec beside rendered/ under a name of the admin's choosing.
    files = demo_files(demo)
    spec_text = demo.read_text()
    for name in ("demo.json", "demo.nft", "scrape.yml", "demo.rules.yml"):
        files[f"etc/llm-appliance/{name}"] = spec_text
    assert check_tree(files).rejections == ()
    files["etc/llm-appliance/rendered/extra.json"] = spec_text  # but any rendered JSON is parsed
    assert [(r.path, r.checker) for r in check_tree(files).rejections] == [
        ("etc/llm-appliance/rendered/extra.json", "json")
    ]
