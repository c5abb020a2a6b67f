"""The installer's steps staged into a directory (--root): idempotence, the admin's specs kept, uninstall.
The live path (users, systemctl) runs for real in tests/test_system_nspawn.py."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from conftest import REPO

from appliance.ops import layout
from appliance.ops.install import Options, Report, copy_specs, driver_packages, hold_driver, install, uninstall
from appliance.ops.models import SMOLLM2
from appliance.system.users import account, exposure

SERVICE = account()
as_root_with_a_service_user = pytest.mark.skipif(
    os.geteuid() != 0 or SERVICE is None, reason="needs root and the llm-appliance user (install.sh creates it)"
)

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


def _edit_the_admins_spec(staged: Path) -> tuple[Path, str]:
    install(options(staged))
    installed = staged / "etc/llm-appliance/appliance.toml"
    edited = installed.read_text().replace("temperature = 0.6", "temperature = 0.2")
    installed.write_text(edited)
    return installed, edited


def _shipped_anew(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "etc", repo / "etc")
    shipped = repo / "etc/llm-appliance/appliance.toml"
    shipped.write_text(shipped.read_text() + "\n# a new release\n")
    return repo


@as_root_with_a_service_user
def test_a_record_forged_in_the_service_users_old_directory_does_not_overwrite_the_admins_spec(
    staged: Path, tmp_path: Path
) -> None:
    assert SERVICE is not None
    installed, edited = _edit_the_admins_spec(staged)
    # The layout before: the record lay in /var/lib/llm-appliance, the service user's. It claims the
    # admin's spec is the shipped one, so that the next install replaces it.
    lib = staged / "var/lib/llm-appliance"
    forged = lib / "shipped-etc.json"
    forged.write_text(json.dumps({"appliance.toml": hashlib.sha256(edited.encode()).hexdigest()}))
    for path in (lib, forged):
        os.chown(path, SERVICE.uid, SERVICE.gid)
    install(options(staged, _shipped_anew(tmp_path)))
    assert installed.read_text() == edited


@as_root_with_a_service_user
def test_the_record_is_not_trusted_where_the_service_user_could_have_rewritten_it(
    staged: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert SERVICE is not None
    installed, edited = _edit_the_admins_spec(staged)
    record = staged / "var/lib/llm-appliance/shipped-specs.json"
    record.write_text(json.dumps({"appliance.toml": hashlib.sha256(edited.encode()).hexdigest()}))
    os.chown(record, SERVICE.uid, SERVICE.gid)
    copy_specs(options(staged, _shipped_anew(tmp_path)), Report(), who=SERVICE)
    assert installed.read_text() == edited
    assert f"ignored {record}: {record} can be changed by llm-appliance" in capsys.readouterr().out


def test_a_staged_install_lays_out_root_s_directories_and_the_state_directory(staged: Path) -> None:
    install(options(staged))
    lib = staged / "var/lib/llm-appliance"
    assert sorted(p.name for p in lib.iterdir()) == ["models", "shipped-specs.json", "state"]
    for directory in (lib, lib / "models", lib / "state"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o755, directory  # staged: nothing is chowned


def _owned(path: Path, mode: int | None = None) -> Path:
    assert SERVICE is not None
    os.chown(path, SERVICE.uid, SERVICE.gid, follow_symlinks=False)
    if mode is not None:
        path.chmod(mode)
    return path


@as_root_with_a_service_user
def test_the_layout_before_is_taken_back_from_the_service_user(tmp_path: Path) -> None:
    assert SERVICE is not None
    said: list[str] = []
    canary = tmp_path / "canary"
    canary.write_text("root's\n")
    lib = tmp_path / "var/lib/llm-appliance"
    models = lib / "models"
    models.mkdir(parents=True)
    _owned(lib, 0o755)
    _owned(models, 0o775)
    model = models / SMOLLM2
    model.write_bytes(b"GGUF")
    _owned(model, 0o664)
    (models / "planted.gguf").symlink_to(canary)
    _owned(models / "planted.gguf")
    (lib / "baseline.json").write_text("{}")  # root's, written by bench: stays
    (lib / "shipped-etc.json").write_text("{}")  # the old record: dropped whoever owns it
    (lib / "health-state.json").write_text('{"restarts": [], "totals": {"decay": 2}}')
    _owned(lib / "health-state.json")  # the daemon's restart history: moves into state/
    (lib / "elsewhere").symlink_to(tmp_path)
    _owned(lib / "elsewhere")
    (lib / "stash").mkdir()
    (lib / "stash" / "link").symlink_to(canary)
    _owned(lib / "stash")
    cron = tmp_path / "etc-cron.d"
    cron.mkdir()
    (lib / "state").symlink_to(cron)  # where root would move the restart history
    _owned(lib / "state")

    layout.ensure(tmp_path, SERVICE, said.append)

    assert sorted(p.name for p in lib.iterdir()) == ["baseline.json", "models", "state"]
    assert [p.name for p in models.iterdir()] == [SMOLLM2]
    for path, mode in ((lib, 0o755), (models, 0o755), (model, 0o644)):
        found = path.stat()
        assert (found.st_uid, found.st_gid, stat.S_IMODE(found.st_mode)) == (0, 0, mode), path
    state = lib / "state"
    assert (state.stat().st_uid, stat.S_IMODE(state.stat().st_mode)) == (SERVICE.uid, 0o700)
    assert json.loads((state / "health-state.json").read_text())["totals"] == {"decay": 2}
    assert canary.read_text() == "root's\n"
    assert list(cron.iterdir()) == []
    assert not state.is_symlink()
    assert exposure(lib, SERVICE) is None and exposure(models, SERVICE) is None
    assert f"took {lib} back from llm-appliance" in said
    said.clear()
    layout.ensure(tmp_path, SERVICE, said.append)
    assert said == []  # a second run changes nothing


@as_root_with_a_service_user
def test_a_set_id_file_the_service_user_planted_is_not_made_root_s_binary(tmp_path: Path) -> None:
    """The attack of issue 36: a 04777 file of the service user among the old layout's models came back as
    -rwsr-xr-x root (chown, then chmod to the old mode less group and other write)."""
    assert SERVICE is not None
    lib = tmp_path / "var/lib/llm-appliance"
    models = lib / "models"
    (models / "sub").mkdir(parents=True)
    _owned(lib, 0o755)
    _owned(models, 0o775)
    _owned(models / "sub", 0o3777)  # setgid and sticky: a directory others could fill
    shell = models / "sh"
    shell.write_bytes(b"\x7fELF")
    _owned(shell, 0o4777)
    _owned(shell, 0o4777)  # chown cleared the bit it set before: set it again, as the service user could
    both = models / "sub" / "both"
    both.write_bytes(b"\x7fELF")
    _owned(both, 0o6777)
    _owned(both, 0o6777)
    outside = tmp_path / "outside"
    outside.write_bytes(b"\x7fELF")
    _owned(outside, 0o4777)
    _owned(outside, 0o4777)
    (models / "link").symlink_to(outside)
    _owned(models / "link")

    layout.ensure(tmp_path, SERVICE, lambda _: None)

    for path, mode in ((shell, 0o755), (both, 0o755), (models / "sub", 0o755), (models, 0o755)):
        found = path.lstat()
        assert (found.st_uid, found.st_gid, stat.S_IMODE(found.st_mode)) == (0, 0, mode), path
        assert not found.st_mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX | 0o022), path
    assert not (models / "link").is_symlink()  # the link is gone, and what it named is untouched:
    found = outside.stat()
    assert (found.st_uid, stat.S_IMODE(found.st_mode)) == (SERVICE.uid, 0o4777)
