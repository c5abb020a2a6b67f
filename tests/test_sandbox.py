"""The units follow what validate found about the sandbox: files bound out of homes, files in /tmp refused, the
one capability for a low port, access tried as the service user. The nspawn tests start these units for real."""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import EXAMPLE_FACTS, service_settings

import appliance.cli.main as cli
from appliance.cli.commands import EXIT_INVALID
from appliance.plan.resolved import resolve
from appliance.plan.validate import validate
from appliance.render.apply import installed_spec_path
from appliance.render.check import check_tree
from appliance.render.render import render
from appliance.spec.problems import SpecInvalid
from appliance.system import paths
from appliance.system.users import Access, account, denied_as, drop_to

SERVICE = account()
needs_service_user = pytest.mark.skipif(
    SERVICE is None, reason="the llm-appliance user does not exist (.ci/run makes it)"
)


def _units(spec: Path) -> dict[str, dict[str, list[str]]]:
    files = render(resolve(validate(spec, facts=EXAMPLE_FACTS["demo-draft.toml"]).plan, installed_spec_path(spec)))
    return {
        name: service_settings(files[f"etc/systemd/system/{unit}"])
        for name, unit in (
            ("server", paths.SERVER_UNIT),
            ("health", paths.HEALTH_UNIT),
            ("restart", paths.RESTART_UNIT),
        )
    }


def _demo(example: Callable[..., Path], **edits: str) -> Path:
    return example("demo-draft.toml", {'path = "$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf"': "", **edits})


def test_a_model_in_a_home_is_bound_alone_and_the_rest_stays_hidden(
    example: Callable[..., Path], home_dir: Path, fixture_models: Path
) -> None:
    model = home_dir / "models" / "smol.gguf"
    model.parent.mkdir(exist_ok=True)
    shutil.copy(fixture_models / "SmolLM2-135M-Instruct.Q4_1.gguf", model)
    spec = example("demo-draft.toml")
    spec.write_text(spec.read_text().replace(str(fixture_models / "SmolLM2-135M-Instruct.Q4_1.gguf"), str(model)))
    units = _units(spec)
    assert units["server"]["ProtectHome"] == ["tmpfs"]
    assert units["server"]["BindReadOnlyPaths"] == [f'"{model}"']
    # Only the server opens models: the other units keep their homes shut.
    assert units["health"]["ProtectHome"] == ["yes"] and "BindReadOnlyPaths" not in units["health"]
    assert units["restart"]["ProtectHome"] == ["yes"]
    files = render(resolve(validate(spec, facts=EXAMPLE_FACTS["demo-draft.toml"]).plan, installed_spec_path(spec)))
    assert check_tree(files).rejections == ()


def test_a_link_into_a_home_binds_the_file_it_leads_to(
    example: Callable[..., Path], home_dir: Path, fixture_models: Path, outside_tmp: Path
) -> None:
    blob = home_dir / "blobs" / "9f86d08"
    blob.parent.mkdir(exist_ok=True)
    shutil.copy(fixture_models / "SmolLM2-135M-Instruct.Q4_1.gguf", blob)
    link = outside_tmp / "linked.gguf"
    link.unlink(missing_ok=True)
    link.symlink_to(blob)
    spec = example("demo-draft.toml")
    spec.write_text(spec.read_text().replace(str(fixture_models / "SmolLM2-135M-Instruct.Q4_1.gguf"), str(link)))
    assert _units(spec)["server"]["BindReadOnlyPaths"] == [f'"{blob}"']


def test_a_model_in_tmp_is_refused_and_nothing_written(
    example: Callable[..., Path], smollm2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As a user meets it: a model fetched into a private directory in /tmp. The server unit has PrivateTmp=
    (its own, empty /tmp), `up` runs as a user the 0700 directory shuts out, and boot empties /tmp."""
    closed = tmp_path / "mine"
    closed.mkdir(mode=0o700)
    model = closed / "smol.gguf"
    shutil.copy(smollm2, model)
    model.chmod(0o644)
    spec = _with_model(example, model)
    before = sorted(tmp_path.rglob("*"))
    assert cli.main(["validate", str(spec)]) == EXIT_INVALID
    out, err = capsys.readouterr()
    line = spec.read_text().splitlines().index(f'path = "{model}"') + 1
    assert f"{spec}:{line}: error: models.target.path: {model} is in a temporary directory (/tmp)" in err, err
    assert "PrivateTmp=" in err and "fix: move it to /var/lib/llm-appliance/models/ and set models.target.path" in err
    assert err.count("error:") == 1, err  # one problem for the file: the move is its fix, whatever else is in the way
    assert out == "" and sorted(tmp_path.rglob("*")) == before


def test_a_link_into_tmp_is_refused_too(
    example: Callable[..., Path], smollm2: Path, outside_tmp: Path, tmp_path: Path
) -> None:
    model = tmp_path / "smol.gguf"
    shutil.copy(smollm2, model)
    model.chmod(0o644)
    link = outside_tmp / "link-into-tmp.gguf"
    link.symlink_to(model)
    with pytest.raises(SpecInvalid) as caught:
        validate(_with_model(example, link), facts=EXAMPLE_FACTS["demo-draft.toml"])
    (problem,) = caught.value.errors
    assert problem.field == "models.target.path"
    assert problem.message.startswith(f"{link} leads to {model}, which is in a temporary directory (/tmp)")


@needs_service_user
def test_a_bound_model_still_needs_its_way_open_to_the_service_user(
    example: Callable[..., Path], home_dir: Path, smollm2: Path
) -> None:
    """A file in a home is bound alone into the server unit, but `up` opens it as the service user with no
    sandbox: a 0700 directory on the way is refused, naming it."""
    closed = home_dir / "private-models"
    closed.mkdir(mode=0o700)
    model = closed / "smol.gguf"
    shutil.copy(smollm2, model)
    model.chmod(0o644)
    spec = _with_model(example, model)
    with pytest.raises(SpecInvalid) as caught:
        validate(spec, facts=EXAMPLE_FACTS["demo-draft.toml"])
    (problem,) = caught.value.errors
    assert problem.field == "models.target.path"
    assert f"{closed} (mode 0700) does not let llm-appliance reach it" in problem.message
    assert problem.fix == f"let it: chmod o+x {closed}; or move the file to /var/lib/llm-appliance/models/"
    closed.chmod(0o711)  # the fix, as said: then the unit binds it
    assert _units(spec)["server"]["BindReadOnlyPaths"] == [f'"{model}"']


@pytest.mark.parametrize(("port", "granted"), [(8080, False), (80, True)])
def test_a_low_server_port_gets_the_one_capability(example: Callable[..., Path], port: int, granted: bool) -> None:
    units = _units(example("demo-draft.toml", {"port = 8080": f"port = {port}"}))
    server = units["server"]
    if granted:
        assert server["CapabilityBoundingSet"] == ["CAP_NET_BIND_SERVICE"]
        assert server["AmbientCapabilities"] == ["CAP_NET_BIND_SERVICE"]
        assert "PrivateUsers" not in server  # in a user namespace of its own the capability would not count
    else:
        assert server["CapabilityBoundingSet"] == [""] and server["AmbientCapabilities"] == [""]
        assert server["PrivateUsers"] == ["yes"]
    assert units["health"]["CapabilityBoundingSet"] == [""]


def test_a_low_exporter_port_gets_the_capability_in_the_health_unit(example: Callable[..., Path]) -> None:
    units = _units(example("demo-draft.toml", {"port = 9478": "port = 443"}))
    assert units["health"]["AmbientCapabilities"] == ["CAP_NET_BIND_SERVICE"]
    assert units["server"]["AmbientCapabilities"] == [""]


@pytest.mark.parametrize(
    ("name", "refused"),
    [
        ("appliance.toml", False),
        ("my appliance.toml", False),
        ("a\nExecStartPre=x.toml", True),
        ("a\u2028b.toml", True),
    ],
)
def test_the_spec_files_name_cannot_break_a_header_line(
    tmp_path: Path, example: Callable[..., Path], name: str, refused: bool
) -> None:
    spec = tmp_path / name
    spec.write_text(example("demo-draft.toml").read_text())
    if not refused:
        validate(spec, facts=EXAMPLE_FACTS["demo-draft.toml"])
        return
    with pytest.raises(SpecInvalid) as caught:
        validate(spec, facts=EXAMPLE_FACTS["demo-draft.toml"])
    assert [p.field for p in caught.value.errors] == ["(the spec file's name)"]
    assert "rename the file" in caught.value.errors[0].fix


def test_a_schedule_in_the_past_is_warned_of(example: Callable[..., Path]) -> None:
    spec = example("demo-draft.toml", {"max_per_hour = 6": 'max_per_hour = 6\nschedule = "2020-01-01"'})
    warnings = validate(spec, facts=EXAMPLE_FACTS["demo-draft.toml"]).warnings
    assert [(w.field, "never comes again" in w.message) for w in warnings] == [("restart.schedule", True)]


# --- access as the service user, for real -------------------------------------------------------------------


@needs_service_user
def test_access_is_tried_as_the_service_user(outside_tmp: Path) -> None:
    assert SERVICE is not None
    closed = outside_tmp / "access-closed"
    closed.mkdir(mode=0o700, exist_ok=True)
    inside = closed / "model.gguf"
    inside.write_text("x")
    inside.chmod(0o644)
    secret = outside_tmp / "access-secret.gguf"
    secret.write_text("x")
    secret.chmod(0o600)
    group = outside_tmp / "access-group.gguf"
    group.write_text("x")
    os.chown(group, 0, SERVICE.gid)
    group.chmod(0o640)
    wanted = [Access(inside), Access(secret), Access(group)]
    refused = denied_as(SERVICE, wanted)
    assert set(refused) == {Access(inside), Access(secret)}
    assert f"{closed} (mode 0700) does not let llm-appliance reach it" in refused[Access(inside)]


def _root_only_model(outside_tmp: Path, smollm2: Path, name: str) -> tuple[Path, Path]:
    """(the 0700 root directory, a model in it): not in pytest's tmp_path, whose parents are 0700 already and which
    validate refuses for being in /tmp, but on a way the service user could pass but for the one directory."""
    closed = outside_tmp / name
    closed.mkdir(mode=0o700)
    assert os.stat(outside_tmp).st_mode & 0o001 and os.stat(outside_tmp.parent).st_mode & 0o001
    model = closed / "smol.gguf"
    try:
        os.link(smollm2, model)  # 0644 as fetched; not chmod-ed here, the link shares the original's mode
    except OSError:
        shutil.copy(smollm2, model)
        model.chmod(0o644)
    return closed, model


def _with_model(example: Callable[..., Path], model: Path) -> Path:
    """The demo pair, its target `model`, its draft where the service user reads it: one problem, the target's."""
    spec = example("demo-draft.toml")
    text = spec.read_text()
    start = text.index("[models.draft]")
    target = re.search(r'^path = "(.*)"$', text[:start], re.MULTILINE)
    assert target is not None
    spec.write_text(text[:start].replace(target.group(1), str(model)) + text[start:])
    return spec


@needs_service_user
def test_a_model_under_a_root_only_directory_is_refused_naming_the_directory(
    example: Callable[..., Path], outside_tmp: Path, smollm2: Path
) -> None:
    """validate => starts: root reads the model, the service user cannot reach it, so the unit would fail at load."""
    closed, model = _root_only_model(outside_tmp, smollm2, "root-only")
    link = outside_tmp / "root-only-link.gguf"
    link.symlink_to(model)
    for path in (model, link):  # a link's way is the way of the file it leads to
        spec = _with_model(example, path)
        with pytest.raises(SpecInvalid) as caught:
            validate(spec, facts=EXAMPLE_FACTS["demo-draft.toml"])
        (problem,) = caught.value.errors
        assert problem.field == "models.target.path", problem.render()
        assert problem.line == spec.read_text().splitlines().index(f'path = "{path}"') + 1, problem.render()
        assert problem.message == (
            f"llm-appliance, the user the units run as, cannot read {path}: {closed} (mode 0700) does not let "
            "llm-appliance reach it"
        )
        assert problem.fix == f"let it: chmod o+x {closed}; or move the file to /var/lib/llm-appliance/models/"
    closed.chmod(0o711)  # the fix, as said
    validate(spec, facts=EXAMPLE_FACTS["demo-draft.toml"])


def test_without_the_service_user_files_are_checked_as_any_other_user(
    example: Callable[..., Path], outside_tmp: Path, smollm2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """validate on a machine the appliance is not installed on: the user install.sh creates will be "other"."""
    import appliance.plan.sandbox

    monkeypatch.setattr(appliance.plan.sandbox, "account", lambda *_: None)
    closed, model = _root_only_model(outside_tmp, smollm2, "root-only-no-user")
    spec = _with_model(example, model)
    with pytest.raises(SpecInvalid) as caught:
        validate(spec, facts=EXAMPLE_FACTS["demo-draft.toml"])
    (problem,) = caught.value.errors
    assert problem.message == (
        f"any other user cannot read {model}: {closed} (mode 0700) does not let any other user reach it "
        "(llm-appliance, the user the units will run as, does not exist here yet: checked as any other user, "
        "which it will be to this file)"
    )
    assert problem.fix == f"let it: chmod o+x {closed}; or move the file to /var/lib/llm-appliance/models/"
    closed.chmod(0o711)
    (warning,) = validate(spec, facts=EXAMPLE_FACTS["demo-draft.toml"]).warnings
    assert warning.message.startswith("llm-appliance does not exist on this machine yet: the files its units open ")


@needs_service_user
def test_dropping_to_the_service_user_can_keep_the_bind_capability_alone() -> None:
    """`up` started by root for a port below 1024 keeps CAP_NET_BIND_SERVICE, ambient, as the unit would."""
    assert SERVICE is not None
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - reports through the pipe
        answers = []
        try:
            drop_to(SERVICE, bind_low_ports=True)
            with socket.socket() as low:
                low.bind(("127.0.0.1", 0))  # any port: the point is the capability set below
            status = Path("/proc/self/status").read_text()
            answers = [line.split()[1] for line in status.splitlines() if line.startswith(("CapEff", "CapAmb", "Uid"))]
        finally:
            os.write(write_end, " ".join(answers).encode())
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        said = pipe.read().split()
    os.waitpid(pid, 0)
    assert said == [str(SERVICE.uid), "0000000000000400", "0000000000000400"]  # bit 10: CAP_NET_BIND_SERVICE
