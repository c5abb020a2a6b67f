"""The command line: exit codes, reports on stderr, and what render and apply write (and do not write).

The CLI gathers this machine's facts: the real llama-server's flag dialect and, with no NVML here, no GPU.
So the commands run on the CPU demo (the real SmolLM2 model) or on a GPU spec that states its memory.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import appliance.facts.machine
import appliance.system.files
from appliance.cli.commands import EXIT_APPLY, EXIT_INVALID, EXIT_OK, EXIT_USAGE, spec_schema
from appliance.cli.main import main
from appliance.facts.gpu import NvmlUnavailable
from appliance.facts.machine import find_binary
from appliance.ops.models import SMOLLM2
from appliance.ops.status import EXIT, EXIT_UNKNOWN
from appliance.plan.resolved import SNAPSHOT
from appliance.render.apply import ApplyError, Change, write
from appliance.spec.load import load_spec

CLI = Path(sys.executable).parent / "llm-appliance"
RENDERED = [
    "etc/llm-appliance/rendered/appliance.json",
    "etc/llm-appliance/rendered/grafana/llm-appliance.json",
    "etc/llm-appliance/rendered/llm-appliance.nft",
    "etc/llm-appliance/rendered/prometheus/llm-appliance.rules.yml",
    "etc/llm-appliance/rendered/prometheus/scrape.yml",
    "etc/systemd/system/llm-appliance-health.service",
    "etc/systemd/system/llm-appliance-restart.service",
    "etc/systemd/system/llm-appliance-restart.timer",
    "etc/systemd/system/llm-appliance-server.service",
    "etc/polkit-1/rules.d/50-llm-appliance.rules",
]
# The spec itself is installed beside the rendered files, where the units name it.
DEMO_FILES = sorted([*RENDERED, "etc/llm-appliance/demo-draft.toml"])
# file:line: error: field: message, then an indented fix.
REPORT_LINE = re.compile(r"^(?P<file>/\S+):(?P<line>\d+): error: (?P<field>[\w.\[\]]+): (?P<message>.+)$", re.M)
Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Run:
    """appliance.cli.main.main in this process: (exit code, stdout, stderr)."""

    def run(*args: str | Path) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def subprocess_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLI), *map(str, args)], capture_output=True, text=True, timeout=120, check=False)


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.fixture
def demo(example: Callable[..., Path]) -> Path:
    return example("demo-draft.toml")


@pytest.fixture
def bad_demo(example: Callable[..., Path]) -> Path:
    """The demo with two errors, in a directory of its own (the example fixture writes tmp_path/demo-draft.toml)."""
    written = example("demo-draft.toml", replace={"n_max = 8": "n_maxx = 8", "port = 8080": "port = 0"})
    (written.parent / "bad").mkdir()
    bad = written.replace(written.parent / "bad" / "demo-draft.toml")
    example("demo-draft.toml")  # the good demo again, for a test that uses both
    return bad


def line_with(spec: Path, text: str) -> int:
    return next(n for n, line in enumerate(spec.read_text().splitlines(), start=1) if text in line)


# --- validate, explain, schema, usage ---


def test_validate_good_spec(cli: Run, demo: Path) -> None:
    code, out, err = cli("validate", demo)
    assert code == EXIT_OK, err
    assert out == f"{demo}: valid (0 warnings)\n"


def test_validate_gpu_spec_with_stated_memory(cli: Run, example: Callable[..., Path]) -> None:
    # No NVML on this machine: the spec says how large CUDA0 is.
    spec = example(
        "appliance.toml",
        replace={"compute_headroom_mib = 1024": "compute_headroom_mib = 1024\ndevice_total_mib = { CUDA0 = 24576 }"},
    )
    code, out, err = cli("validate", spec)
    assert (code, out) == (EXIT_OK, f"{spec}: valid (0 warnings)\n"), err


def test_validate_accepts_a_list_of_types(cli: Run, example: Callable[..., Path]) -> None:
    spec = example("demo-draft.toml", replace={'type = "draft-simple"': 'type = ["draft-simple", "ngram-mod"]'})
    code, out, err = cli("validate", spec)
    assert (code, out) == (EXIT_OK, f"{spec}: valid (0 warnings)\n"), err


def test_validate_accepts_ngram_mod_with_its_parameters(cli: Run, example: Callable[..., Path]) -> None:
    ngram_mod = 'type = "ngram-mod"\n\n[speculative.ngram_mod]\nn_match = 16\nn_min = 8\nn_max = 32\n'
    spec = example("demo.toml", replace={'type = "ngram-mod"\n': ngram_mod})
    code, out, err = cli("validate", spec)
    assert (code, out) == (EXIT_OK, f"{spec}: valid (0 warnings)\n"), err


class NoNvml:
    """NVML as on a machine without the NVIDIA driver (this one; a GPU machine would answer)."""

    def gpus(self) -> list[object]:
        raise NvmlUnavailable("NVML: NVML Shared Library Not Found")

    def driver_version(self) -> str:
        raise NvmlUnavailable("NVML: NVML Shared Library Not Found")

    def cuda_version(self) -> str:
        raise NvmlUnavailable("NVML: NVML Shared Library Not Found")


def test_gpu_spec_without_memory_is_refused_without_nvml(
    cli: Run, example: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(appliance.facts.machine, "Pynvml", NoNvml)
    spec = example("appliance.toml")
    code, out, err = cli("validate", spec)
    assert (code, out) == (EXIT_INVALID, "")
    line = line_with(spec, "[memory]")
    assert err.startswith(
        f"{spec}:{line}: error: memory.device_total_mib.CUDA0: cannot tell how much memory CUDA0 has: "
        "NVML: NVML Shared Library Not Found\n    fix: set memory.device_total_mib = { CUDA0 = 24576 } (MiB)"
    )


def test_validate_prints_warnings_on_stderr(cli: Run, example: Callable[..., Path]) -> None:
    spec = example("demo-draft.toml", replace={"n_max = 8": "n_max = 20"})
    code, out, err = cli("validate", spec)
    assert code == EXIT_OK
    assert out == f"{spec}: valid (1 warning)\n"
    assert f"{spec}:{line_with(spec, 'n_max = 20')}: warning: speculative.n_max: K = 20" in err


def test_invalid_spec_reports_every_error_with_file_line_field_and_fix(cli: Run, bad_demo: Path) -> None:
    code, out, err = cli("validate", bad_demo)
    assert code == EXIT_INVALID
    assert out == ""
    found = {m["field"]: (m["file"], int(m["line"]), m["message"]) for m in REPORT_LINE.finditer(err)}
    assert found == {
        "server.port": (
            str(bad_demo),
            line_with(bad_demo, "port = 0"),
            "Input should be greater than or equal to 1 (got 0)",
        ),
        "speculative.n_maxx": (str(bad_demo), line_with(bad_demo, "n_maxx"), "unknown key"),
    }
    assert "\n    fix: did you mean 'n_max'?\n" in err
    assert err.count("    fix: ") == 2
    assert err.endswith("2 errors; nothing was written\n")
    assert "Traceback" not in err


def test_explain(cli: Run, demo: Path, fixture_models: Path) -> None:
    code, out, err = cli("explain", demo)
    assert code == EXIT_OK, err
    assert f"target: {fixture_models / SMOLLM2} (llama, Q4_1, 30 layers, trained ctx 8192)\n" in out
    assert f"dialect: {find_binary(load_spec(demo).spec)}\n" in out
    assert "    --spec-type draft-simple \\\n" in out
    assert "\nspeculation: draft-simple (llama-server speculates)\n  draft-simple: n_max 8, n_min 0, p_min 0\n" in out
    assert "no GPU device in the plan (CPU only)" in out
    host = out[out.index("\nhost RAM: ") : out.index("\nwarnings:")]
    assert re.search(r"host RAM: \d+\.\d\d of \d+\.\d\d GiB usable \(\d+\.\d\d GiB x 0\.9\)", host), host
    assert "  target KV cache (f16/f16, 30 layers x 4096 cells) on the CPU " in host
    assert re.search(r"  prompt cache \(--cache-ram \d+ MiB: what the budget leaves, at most 8192\) ", host), host
    assert "  (available now, MemAvailable: " in host
    assert out.endswith("warnings:\n  none\n")


def test_explain_shows_the_speculation_types_and_their_parameters(cli: Run, example: Callable[..., Path]) -> None:
    replace = {
        'type = "draft-simple"': 'type = ["draft-simple", "ngram-mod"]',
        "[network]": "[speculative.ngram_mod]\nn_match = 16\n\n[network]",
    }
    spec = example("demo-draft.toml", replace)
    code, out, err = cli("explain", spec)
    assert code == EXIT_OK, err
    assert "\nspeculation: draft-simple, ngram-mod (llama-server speculates)\n" in out
    assert "\n  ngram-mod: n_match 16, n_min engine default, n_max engine default\n" in out
    assert "    --spec-type draft-simple,ngram-mod \\\n" in out
    code, out, err = cli("explain", spec, "--json")
    assert code == EXIT_OK, err
    assert json.loads(out)["speculation"] == {
        "types": ["draft-simple", "ngram-mod"],
        "speculates": True,
        "draft_in_use": True,
        "parameters": {
            "draft-simple": {"n_max": 8, "n_min": 0, "p_min": 0.0},
            "ngram-mod": {"n_match": 16, "n_min": None, "n_max": None},
        },
    }


def test_schema_is_the_spec_schema(cli: Run) -> None:
    code, out, _ = cli("schema")
    assert code == EXIT_OK
    schema = json.loads(out)
    assert schema == spec_schema()
    assert schema["title"] == "llm-appliance spec"
    assert "models" in schema["required"]
    assert schema["$defs"]["Server"]["additionalProperties"] is False


@pytest.mark.parametrize(
    "args",
    [[], ["validate"], ["frobnicate"], ["apply"], ["render", "x.toml", "--bogus"], ["engine"]],
    ids=["nothing", "no-spec", "unknown-command", "apply-no-spec", "unknown-option", "engine-no-action"],
)
def test_usage_errors_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(args)
    assert caught.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("usage: llm-appliance")
    assert "error: " in err


def test_missing_spec_file(cli: Run, tmp_path: Path) -> None:
    code, _, err = cli("validate", tmp_path / "nope.toml")
    assert code == EXIT_INVALID
    assert f"{tmp_path / 'nope.toml'}: error: (file): no such file" in err


# --- render ---


def test_render_out_writes_the_files_and_rewrites_nothing_the_second_time(cli: Run, demo: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    code, out, err = cli("render", demo, "--out", out_dir)
    assert code == EXIT_OK, err
    assert out == f"rendered {len(DEMO_FILES)} files into {out_dir} ({len(DEMO_FILES)} changed)\n"
    assert files_under(out_dir) == DEMO_FILES
    assert (out_dir / "etc/llm-appliance/demo-draft.toml").read_text() == demo.read_text()
    snapshot = json.loads((out_dir / "etc/llm-appliance/rendered/appliance.json").read_text())
    argv = snapshot["resolved"]["argv"]
    assert argv[0] == str(find_binary(load_spec(demo).spec))
    assert argv[argv.index("--spec-type") + 1] == "draft-simple"
    code, out, _ = cli("render", demo, "--out", out_dir)
    assert (code, out) == (EXIT_OK, f"rendered {len(DEMO_FILES)} files into {out_dir} (0 changed)\n")


def test_render_to_stdout_matches_render_out(cli: Run, demo: Path, tmp_path: Path) -> None:
    code, out, _ = cli("render", demo)
    assert code == EXIT_OK
    printed = dict(re.findall(r"^---(.+?)---\n(.*?)(?=^---|\Z)", out, flags=re.M | re.S))
    assert sorted(printed) == DEMO_FILES
    cli("render", demo, "--out", tmp_path / "out")
    for relative, text in printed.items():
        assert (tmp_path / "out" / relative).read_text() == text


def test_render_of_an_invalid_spec_writes_nothing(cli: Run, bad_demo: Path, tmp_path: Path) -> None:
    code, out, err = cli("render", bad_demo, "--out", tmp_path / "out")
    assert out == ""
    assert code == EXIT_INVALID
    assert not (tmp_path / "out").exists()
    assert "nothing was written" in err


# --- apply ---


def test_apply_installs_files_0644_and_a_second_apply_changes_nothing(cli: Run, demo: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    code, out, err = cli("apply", demo, "--root", root)
    assert code == EXIT_OK, err
    assert files_under(root) == DEMO_FILES
    assert out.splitlines() == [
        *(f"create {root / p}" for p in DEMO_FILES),
        f"{len(DEMO_FILES)} files changed under {root}",
    ]
    for relative in DEMO_FILES:
        assert stat.S_IMODE((root / relative).stat().st_mode) == 0o644, relative
    before = {p: ((root / p).stat().st_mtime_ns, (root / p).stat().st_ino) for p in DEMO_FILES}
    code, out, _ = cli("apply", demo, "--root", root)
    assert (code, out) == (EXIT_OK, f"nothing to change under {root}\n")
    assert {p: ((root / p).stat().st_mtime_ns, (root / p).stat().st_ino) for p in DEMO_FILES} == before
    assert not list(root.rglob("*.tmp"))


def test_apply_keeps_mode_0644_under_a_strict_umask(cli: Run, demo: Path, tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        assert cli("apply", demo, "--root", tmp_path / "root")[0] == EXIT_OK
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "root/etc/systemd/system/llm-appliance-server.service").stat().st_mode) == 0o644


def test_apply_dry_run_writes_nothing(cli: Run, demo: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    code, out, _ = cli("apply", demo, "--root", root, "--dry-run")
    assert code == EXIT_OK
    assert out.splitlines() == [f"would create {root / p}" for p in DEMO_FILES]
    assert not root.exists()


def test_status_compares_the_spec_on_disk_with_the_applied_snapshot(cli: Run, demo: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    code, _, err = cli("status", "--root", root)
    assert (code, err) == (
        EXIT_UNKNOWN,
        f"status: {root}/{SNAPSHOT.relative_to('/')} does not exist: nothing is applied; run `llm-appliance apply SPEC`\n",
    )
    assert cli("apply", demo, "--root", root)[0] == EXIT_OK
    installed = root / "etc/llm-appliance/demo-draft.toml"
    code, out, _ = cli("status", "--root", root)
    assert (code, out.splitlines()[-1]) == (EXIT_OK, f"spec: {installed} is what is applied")

    installed.write_text(installed.read_text().replace("ctx_size = 4096", "ctx_size = 8192"))
    code, out, _ = cli("status", "--root", root)
    assert code == EXIT["degraded"]
    lines = out.splitlines()
    assert f"spec: {installed} differs from what is applied; the running appliance still uses the applied one" in lines
    assert "  server.ctx_size: 4096 -> 8192" in lines
    assert '  resolved.argv: without ["4096"], with ["8192"]' in lines
    assert f"  update {root}/etc/llm-appliance/rendered/appliance.json" in lines
    assert f"  update {installed}" not in lines  # it is the file that was edited

    (root / SNAPSHOT.relative_to("/")).write_text("{")
    code, _, err = cli("status", "--root", root)
    assert code == EXIT_UNKNOWN and err.startswith(f"status: cannot read {root}/{SNAPSHOT.relative_to('/')}: ")
    assert "re-run `llm-appliance apply SPEC`" in err and "Traceback" not in err


def test_apply_diff_after_an_edit(cli: Run, demo: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert cli("apply", demo, "--root", root)[0] == EXIT_OK
    demo.write_text(demo.read_text().replace("temperature = 0.0 ", "temperature = 0.2 "))
    launch = root / "etc/llm-appliance/rendered/appliance.json"
    before = launch.read_text()

    code, out, _ = cli("apply", demo, "--root", root, "--diff", "--dry-run")
    assert code == EXIT_OK
    assert "--- a/etc/llm-appliance/rendered/appliance.json\n+++ b/etc/llm-appliance/rendered/appliance.json\n" in out
    assert '       "--temp",\n-      "0",\n+      "0.2",\n' in out
    assert "--- a/etc/llm-appliance/demo-draft.toml\n" in out
    assert "-temperature = 0.0 " in out and "+temperature = 0.2 " in out
    assert f"would update {launch}\n" in out
    assert "scrape.yml" not in out  # unchanged files are neither diffed nor listed
    assert launch.read_text() == before

    code, out, _ = cli("apply", demo, "--root", root, "--diff")
    assert code == EXIT_OK
    assert '+      "0.2",\n' in out
    assert out.endswith(f"2 files changed under {root}\n")
    assert '"0.2"' in launch.read_text()
    assert cli("apply", demo, "--root", root, "--diff")[1] == f"nothing to change under {root}\n"


def test_apply_of_an_invalid_spec_writes_nothing(cli: Run, bad_demo: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    code, out, err = cli("apply", bad_demo, "--root", root)
    assert code == EXIT_INVALID
    assert out == ""
    assert list(root.iterdir()) == []
    assert err.endswith("2 errors; nothing was written\n")


def test_apply_under_a_root_that_is_a_file_exits_3(cli: Run, demo: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.write_text("not a directory\n")
    code, _, err = cli("apply", demo, "--root", root)
    assert code == EXIT_APPLY
    assert err.startswith(f"apply: cannot read {root}/etc/")
    assert "Traceback" not in err
    assert root.read_text() == "not a directory\n"


def test_apply_whose_write_fails_exits_3_and_leaves_no_temporary(
    cli: Run, demo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    assert cli("apply", demo, "--root", root)[0] == EXIT_OK
    demo.write_text(demo.read_text().replace("temperature = 0.0 ", "temperature = 0.2 "))
    before = {p: (root / p).read_text() for p in DEMO_FILES}

    def full_disk(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(appliance.system.files.os, "replace", full_disk)
    code, out, err = cli("apply", demo, "--root", root)
    assert code == EXIT_APPLY
    # The changes were listed before the write failed on the first of them.
    assert out.splitlines() == [
        f"update {root}/etc/llm-appliance/demo-draft.toml",
        f"update {root}/etc/llm-appliance/rendered/appliance.json",
    ]
    assert err == (
        f"apply: cannot write {root}/etc/llm-appliance/demo-draft.toml: No space left on device; nothing after it was written\n"
    )
    assert {p: (root / p).read_text() for p in DEMO_FILES} == before
    assert files_under(root) == DEMO_FILES  # no temporary file left behind


# --- apply's writes, through the one writer (tests/test_files.py tests the writer itself) ---


def test_write_stops_at_the_first_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_replace = os.replace
    calls: list[str] = []

    def second_fails(src: str, dst: str | Path) -> None:
        calls.append(str(dst))
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(appliance.system.files.os, "replace", second_fails)
    found = [Change("a", None, "A\n"), Change("b", None, "B\n"), Change("c", None, "C\n")]
    with pytest.raises(ApplyError, match=r"cannot write .*/b: No space left on device; nothing after it was written"):
        write(found, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    assert len(calls) == 2


def test_a_system_command_that_fails_exits_3_with_what_it_said(
    cli: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "bin" / "dpkg-query"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'dpkg-query: error: database is locked' >&2\nexit 2\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    code, out, err = cli("release-driver")
    assert (code, out) == (EXIT_APPLY, "")
    assert err.endswith(
        "release-driver: `dpkg-query -W -f '${Package} ${Status}\n'` exited 2: dpkg-query: error: database is locked\n"
    )
    assert "Traceback" not in err


# --- the installed command, as a real process ---


def test_subprocess_valid_and_invalid(demo: Path, bad_demo: Path) -> None:
    good = subprocess_cli("validate", demo)
    assert (good.returncode, good.stdout, good.stderr) == (EXIT_OK, f"{demo}: valid (0 warnings)\n", "")
    bad = subprocess_cli("validate", bad_demo)
    assert bad.returncode == EXIT_INVALID
    assert f"{bad_demo}:{line_with(bad_demo, 'port = 0')}: error: server.port: " in bad.stderr
    assert "    fix: " in bad.stderr
    assert "Traceback" not in bad.stderr


def test_subprocess_usage_and_apply(demo: Path, tmp_path: Path) -> None:
    usage = subprocess_cli("validate")
    assert usage.returncode == EXIT_USAGE
    assert "usage: llm-appliance validate" in usage.stderr
    root = tmp_path / "root"
    first = subprocess_cli("apply", demo, "--root", root)
    assert first.returncode == EXIT_OK, first.stderr
    assert files_under(root) == DEMO_FILES
    second = subprocess_cli("apply", demo, "--root", root)
    assert (second.returncode, second.stdout) == (EXIT_OK, f"nothing to change under {root}\n")


def test_provisioning_into_an_unwritable_place_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "fetch", "--dest", "/proc/llm-appliance-models"]) == 4
    assert main(["engine", "install", "--dest", "/proc/llm-appliance-engine"]) == 4
    err = capsys.readouterr().err
    assert "models: cannot write the models into /proc/llm-appliance-models" in err
    assert "engine: cannot write /proc/llm-appliance-engine" in err
    assert "Traceback" not in err


def test_an_exporter_port_in_use_is_a_clear_error(
    example: Callable[..., Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        spec = example("demo-draft.toml", {"port = 9478": f"port = {port}"})
        assert main(["apply", str(spec), "--root", str(tmp_path / "root")]) == EXIT_OK
        assert main(["health", "--snapshot", str(tmp_path / "root" / SNAPSHOT.relative_to("/"))]) == 3
    err = capsys.readouterr().err
    assert f"cannot serve metrics on 127.0.0.1:{port}" in err and "prometheus.port" in err
