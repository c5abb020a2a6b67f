"""The one writer: the old file or the new one, never half of one; the mode and owner asked for; never
through a link planted at the target or at a guessable temporary name, nor into a directory the service user
could redirect."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import appliance.system.files
from appliance.system.files import replacing, write_atomically
from appliance.system.users import account, trusted_status


def test_replaces_the_file_and_sets_the_mode(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "file"
    write_atomically(target, "one\n")
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    inode = target.stat().st_ino
    write_atomically(target, b"two\n", mode=0o600)
    assert target.read_text() == "two\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert target.stat().st_ino != inode  # renamed over, not rewritten in place
    assert [p.name for p in target.parent.iterdir()] == ["file"]


def test_the_mode_is_not_cut_by_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        write_atomically(tmp_path / "world-readable", "x", mode=0o644)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "world-readable").stat().st_mode) == 0o644


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file away")
def test_the_owner_is_set_when_given(tmp_path: Path) -> None:
    target = tmp_path / "owned"
    write_atomically(target, "x", owner=(65534, 65534))
    assert (target.stat().st_uid, target.stat().st_gid) == (65534, 65534)
    write_atomically(target, "y")
    assert (target.stat().st_uid, target.stat().st_gid) == (0, 0)  # by default the writer's


@pytest.mark.parametrize("failing", ["replace", "fsync", "fchmod"])
def test_a_failure_mid_write_keeps_the_old_file_and_leaves_no_temporary(
    failing: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "etc" / "unit.service"
    write_atomically(target, "old\n")

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(appliance.system.files.os, failing, broken)
    with pytest.raises(OSError, match="Input/output error"):
        write_atomically(target, "new\n")
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["unit.service"]


def test_an_interrupt_leaves_the_old_file_and_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "unit.service"
    target.write_text("old\n")

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(appliance.system.files.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_atomically(target, "new\n")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["unit.service"]


def test_a_streamed_write_that_raises_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "model.gguf"
    target.write_bytes(b"old")
    with pytest.raises(ValueError, match="checksum"), replacing(target) as out:
        out.write(b"half of a new one")
        raise ValueError("checksum mismatch")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]
    with replacing(target) as out:
        out.write(b"new ")
        out.write(b"parts")
    assert target.read_bytes() == b"new parts"


def test_a_symlink_planted_at_the_target_is_replaced_not_followed(tmp_path: Path) -> None:
    precious = tmp_path / "shadow"
    precious.write_text("root:secret\n")
    state = tmp_path / "state"
    state.mkdir()
    target = state / "restarts.json"
    target.symlink_to(precious)
    write_atomically(target, "{}")
    assert precious.read_text() == "root:secret\n"
    assert not target.is_symlink()
    assert target.read_text() == "{}"


def test_a_symlink_planted_at_an_old_style_temporary_name_is_not_written_through(tmp_path: Path) -> None:
    # The fixed names writers used to use (`restarts.tmp`, `.NAME.partial`) could be pre-created.
    precious = tmp_path / "shadow"
    precious.write_text("root:secret\n")
    target = tmp_path / "restarts.json"
    for name in ("restarts.tmp", ".restarts.json.partial", ".restarts.json.tmp"):
        (tmp_path / name).symlink_to(precious)
    write_atomically(target, "{}")
    assert precious.read_text() == "root:secret\n"
    assert target.read_text() == "{}"


# -- the service user's directories: it is what a compromised llama-server has ---------------------------

SERVICE = account()
as_root_with_a_service_user = pytest.mark.skipif(
    os.geteuid() != 0 or SERVICE is None, reason="needs root and the llm-appliance user (install.sh creates it)"
)


def _give(path: Path, mode: int = 0o755) -> Path:
    assert SERVICE is not None
    path.mkdir(exist_ok=True)
    os.chown(path, SERVICE.uid, SERVICE.gid)
    path.chmod(mode)
    return path


@as_root_with_a_service_user
def test_root_does_not_write_into_a_directory_of_the_service_user(tmp_path: Path) -> None:
    state = _give(tmp_path / "state")
    with pytest.raises(PermissionError, match=f"{state} belongs to llm-appliance"):
        write_atomically(state / "baseline.json", "{}")
    assert list(state.iterdir()) == []


@as_root_with_a_service_user
def test_a_directory_the_service_user_swapped_for_a_link_is_not_written_through(tmp_path: Path) -> None:
    # The old layout: /var/lib/llm-appliance belonged to the service user, and root fetched models into
    # its models/ directory. The service user replaces models/ by a link to a directory root owns.
    lib = _give(tmp_path / "lib")
    outside = tmp_path / "etc-cron.d"
    outside.mkdir()
    (lib / "models").symlink_to(outside)
    os.chown(lib / "models", SERVICE.uid, SERVICE.gid, follow_symlinks=False)  # type: ignore[union-attr]
    with pytest.raises(PermissionError, match=f"{lib} belongs to llm-appliance"):
        write_atomically(lib / "models" / "model.gguf", "* * * * * root sh -c evil\n")
    assert list(outside.iterdir()) == []


@as_root_with_a_service_user
def test_a_root_owned_link_into_a_directory_of_the_service_user_is_followed_and_refused(tmp_path: Path) -> None:
    state = _give(tmp_path / "state")
    (tmp_path / "alias").symlink_to(state)
    with pytest.raises(PermissionError, match=f"{state} belongs to llm-appliance"):
        write_atomically(tmp_path / "alias" / "sub" / "file", "x")
    assert list(state.iterdir()) == []  # not even the missing directory was created in it


@as_root_with_a_service_user
def test_a_directory_writable_by_the_service_users_group_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, 0, SERVICE.gid)  # type: ignore[union-attr]
    shared.chmod(0o775)
    with pytest.raises(PermissionError, match=f"{shared} is writable by llm-appliance"):
        write_atomically(shared / "file", "x")


@as_root_with_a_service_user
def test_a_sticky_directory_is_fine_but_not_an_entry_of_the_service_user_in_it(tmp_path: Path) -> None:
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    write_atomically(sticky / "root-owned" / "file", "x")  # its entries of root's cannot be swapped
    assert (sticky / "root-owned" / "file").read_text() == "x"
    planted = _give(sticky / "planted")
    with pytest.raises(PermissionError, match=f"{planted} belongs to llm-appliance"):
        write_atomically(planted / "file", "x")


@as_root_with_a_service_user
def test_a_file_the_service_user_could_have_changed_is_not_trusted(tmp_path: Path) -> None:
    assert SERVICE is not None
    record = tmp_path / "record.json"
    record.write_text("{}")
    assert trusted_status(record, SERVICE) is None
    os.chown(record, SERVICE.uid, SERVICE.gid)
    assert trusted_status(record, SERVICE) == f"{record} can be changed by llm-appliance"
    state = _give(tmp_path / "state")
    (state / "record.json").write_text("{}")  # root's file, in the service user's directory
    assert trusted_status(state / "record.json", SERVICE) == f"{state} belongs to llm-appliance"
