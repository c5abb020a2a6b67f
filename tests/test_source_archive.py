"""Unpacking the engine's source on Debian 12's Python 3.11.2, which has no `tarfile` filters: members that
would land outside the tree, devices and set-id bits are refused or cleared, as `filter="data"` would."""

from __future__ import annotations

import io
import stat
import tarfile
from pathlib import Path

import pytest

from appliance.ops.engine_build import EngineError, safe_members


def archive_with(tmp_path: Path, *members: tuple[tarfile.TarInfo, bytes | None]) -> Path:
    path = tmp_path / "source.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            info.size = len(data) if data is not None else 0
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, mode
    return info


def test_a_plain_tree_unpacks_with_set_id_bits_cleared(tmp_path: Path) -> None:
    path = archive_with(
        tmp_path,
        (entry("pkg/", tarfile.DIRTYPE, mode=0o755), None),
        (entry("pkg/run.sh", mode=0o4755), b"#!/bin/sh\n"),
        (entry("pkg/latest", tarfile.SYMTYPE, "run.sh"), None),
    )
    into = tmp_path / "out"
    with tarfile.open(path) as tar:
        tar.extractall(into, members=safe_members(tar, into))
    mode = (into / "pkg/run.sh").stat().st_mode
    assert not mode & (stat.S_ISUID | stat.S_ISGID)
    assert (into / "pkg/latest").read_text() == "#!/bin/sh\n"


@pytest.mark.parametrize(
    "member",
    [
        entry("../escape.txt"),
        entry("/etc/escape.txt"),
        entry("pkg/up", tarfile.SYMTYPE, "../../etc/passwd"),
        entry("pkg/abs", tarfile.SYMTYPE, "/etc/passwd"),
        entry("pkg/hard", tarfile.LNKTYPE, "../outside"),
        entry("pkg/dev", tarfile.CHRTYPE),
        entry("pkg/fifo", tarfile.FIFOTYPE),
    ],
    ids=lambda m: m.name,
)
def test_a_member_outside_the_tree_or_not_a_plain_file_is_refused(tmp_path: Path, member: tarfile.TarInfo) -> None:
    path = archive_with(tmp_path, (member, b"x" if member.isfile() else None))
    into = tmp_path / "out"
    with tarfile.open(path) as tar, pytest.raises(EngineError, match="refusing to unpack"):
        safe_members(tar, into)
    assert not into.exists()
