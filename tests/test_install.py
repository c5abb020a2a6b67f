"""The installer's steps staged into a directory (--root): idempotence, the admin's specs kept, uninstall.
The live path (users, systemctl) runs for real in tests/test_system_nspawn.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import REPO

from appliance.ops.install import Options, driver_packages, hold_driver, install, uninstall
from appliance.ops.models import SMOLLM2

pytestmark = pytest.mark.engine


@pytest.fixture
def staged(tmp_path: Path, smollm2: Path, engine_binary: Path) -> Path:
    root = tmp_path / "root"
    models = root / "var/lib/llm-appliance/models"
    models.mkdir(parents=True)
    (models / SMOLLM2).symlink_to(smollm2)  # the demo's model is there already: nothing to download
    return root


def options(root: Path, repo: Path = REPO) -> Options:
    return Options(repo=repo, spec=repo / "etc/llm-appliance/demo.toml", root=root, demo=True, start=False)


def test_a_staged_install_then_a_second_one_that_changes_nothing(
    staged: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = install(options(staged))
    assert first.changed
    for path in (
        "etc/systemd/system/llm-appliance-server.service",
        "etc/llm-appliance/rendered/appliance.json",
        "etc/polkit-1/rules.d/50-llm-appliance.rules",
        "etc/llm-appliance/demo.toml",
        "etc/llm-appliance/appliance.toml",
        "opt/llm-appliance/engine/bin/llama-server",
    ):
        assert (staged / path).exists(), path
    capsys.readouterr()
    second = install(options(staged))
    assert second.changed == []
    assert "nothing to change" in capsys.readouterr().out


def test_a_spec_the_admin_changed_is_kept_and_the_new_one_put_beside_it(staged: Path, tmp_path: Path) -> None:
    install(options(staged))
    installed = staged / "etc/llm-appliance/appliance.toml"
    installed.write_text(installed.read_text().replace("temperature = 0.6", "temperature = 0.2"))
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "etc", repo / "etc")
    shipped = repo / "etc/llm-appliance"
    (shipped / "appliance.toml").write_text((shipped / "appliance.toml").read_text() + "\n# a new release\n")
    (shipped / "dual-gpu.toml").write_text((shipped / "dual-gpu.toml").read_text() + "\n# a new release\n")
    report = install(options(staged, repo))
    assert "temperature = 0.2" in installed.read_text()  # the admin's change survives
    assert (staged / "etc/llm-appliance/appliance.toml.dist").read_text().endswith("# a new release\n")
    assert (staged / "etc/llm-appliance/dual-gpu.toml").read_text().endswith("# a new release\n")  # untouched: updated
    assert any("dual-gpu.toml (it was the shipped version)" in line for line in report.changed)


def test_uninstall_removes_what_install_rendered_and_keeps_etc_unless_purged(staged: Path) -> None:
    install(options(staged))
    retired = staged / "etc/llm-appliance/rendered/launch.json"  # what an earlier version rendered
    retired.write_text("{}")
    uninstall(staged)
    assert not retired.exists()
    assert not (staged / "etc/systemd/system/llm-appliance-server.service").exists()
    assert not (staged / "etc/polkit-1/rules.d/50-llm-appliance.rules").exists()
    assert not (staged / "opt/llm-appliance/engine").exists()
    assert (staged / "etc/llm-appliance/demo.toml").exists()
    assert uninstall(staged).changed == []  # a second uninstall: nothing left to remove
    uninstall(staged, purge=True)
    assert not (staged / "etc/llm-appliance").exists()
    assert not (staged / "var/lib/llm-appliance").exists()


def test_driver_packages_are_picked_from_dpkg() -> None:
    listing = "\n".join(
        [
            "nvidia-driver-550 install ok installed",
            "libnvidia-compute-550 install ok installed",
            "cuda-toolkit-12-4 install ok installed",
            "nvidia-old deinstall ok config-files",
            "nftables install ok installed",
            "libcublas-12-4 install ok installed",
        ]
    )
    assert driver_packages(listing) == [
        "cuda-toolkit-12-4",
        "libcublas-12-4",
        "libnvidia-compute-550",
        "nvidia-driver-550",
    ]


def test_hold_and_release_write_and_remove_the_unattended_upgrades_blacklist(tmp_path: Path) -> None:
    blacklist = tmp_path / "51llm-appliance-hold-nvidia"
    held = hold_driver(hold=True, blacklist=blacklist)  # runs the real dpkg-query: no NVIDIA packages here
    assert 'Unattended-Upgrade::Package-Blacklist {\n    "nvidia-";' in blacklist.read_text()
    assert any("wrote" in line for line in held.changed)
    assert hold_driver(hold=True, blacklist=blacklist).changed == []  # idempotent
    hold_driver(hold=False, blacklist=blacklist)
    assert not blacklist.exists()
