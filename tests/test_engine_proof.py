"""No engine serves before it is proven on the machine it runs on (ops/engine_proof.py).

The crashes are real processes dying by real signals: wrappers around the real llama-server (tests/fake_engines.py)
that die by SIGILL while loading unless a flag is given, or by SIGSEGV after their first token, so the ladder,
its messages and its record are proven on every machine. On a CPU that reports AMX the real engine's own
build is proven too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import fake_engines
import pytest
from conftest import UpProcess

from appliance.facts.cpu import AMX, read_cpu
from appliance.facts.engine_manifest import Manifest
from appliance.facts.engine_record import RECORD, EngineRecord, Rung, Trial, record_file, stale_reason
from appliance.ops import engine_proof
from appliance.ops.engine_build import PINNED
from appliance.ops.engine_ladder import SWITCH_MARGIN, ensure_proven, fastest
from appliance.ops.engine_proof import EngineUnproven
from appliance.plan.priority import PRIORITIES
from appliance.plan.validate import validate
from appliance.runtime.server_api import ServerApi, ServerUnreachable
from appliance.runtime.server_death import LAST_EXIT
from appliance.runtime.server_process import free_port, temporary_key
from appliance.system import paths
from appliance.system.users import account

pytestmark = pytest.mark.engine
SIGILL_WORDS = "died by SIGILL (exit status 132): an instruction this CPU or this build cannot run"
SIGSEGV_WORDS = "died by SIGSEGV (exit status 139): an invalid memory access"


class FakeBuilds:
    """The ladder's rebuilds, each a wrapper of its own; `install` makes one the engine, as the real one does."""

    def __init__(self, engine_dir: Path, variants: dict[str, Path]) -> None:
        self.engine_dir, self.variants, self.installed = engine_dir, variants, []

    def binary(self, variant: str) -> Path | None:
        assert variant in self.variants, f"the ladder asked for a {variant} build it should not have needed"
        return self.variants[variant]

    def install(self, variant: str) -> Manifest:
        shutil.copy2(self.variants[variant], self.engine_dir / "bin" / "llama-server")
        self.installed.append(variant)
        manifest = dataclasses.replace(built_manifest(self.engine_dir), build=variant)
        manifest.write(self.engine_dir)
        return manifest


def built_manifest(engine_dir: Path) -> Manifest:
    """The manifest of an engine built by llm-appliance for this CPU, AMX included."""
    sets = [*read_cpu().instruction_sets, *sorted(AMX)]
    return Manifest(
        str(engine_dir / "bin" / "llama-server"),
        "built",
        "version: 0.5.0-dev (build 1, commit 0c1e570)",
        {"sha256": PINNED.sha256},
        ["CPU"],
        ["-DGGML_NATIVE=ON"],
        "2026-12-07T00:00:00Z",
        build="native",
        instruction_sets=list(dict.fromkeys(sets)),
    )


def said() -> tuple[list[str], Callable[[str], None]]:
    lines: list[str] = []
    return lines, lines.append


def test_a_crash_while_loading_is_named_and_the_ladder_keeps_no_repack(
    engine_dir: Path, engine_binary: Path, outside_tmp: Path, spec_of: Callable[..., Path]
) -> None:
    binary = fake_engines.sigill_unless(engine_dir / "bin" / "llama-server", engine_binary.resolve())
    built_manifest(engine_dir).write(engine_dir)
    # The rebuild without AMX dies too here: what is left is the same binary with --no-repack.
    no_amx = fake_engines.sigill_unless(
        outside_tmp / f"{engine_dir.name}-no-amx" / "llama-server", engine_binary, "--never"
    )
    builds = FakeBuilds(engine_dir, {"no-amx": no_amx, "portable": no_amx})
    lines, say = said()
    record, proved = ensure_proven(validate(spec_of(binary)), say, engine_dir=engine_dir, builds=builds)
    assert proved
    assert record.rung == "no-repack", record
    assert record.extra_args == ("--no-repack",)
    first = record.trials[0]
    assert first.rung == "as-built" and not first.passed
    # The operator's words: the signal by name and meaning, the exit status, the CPU features involved.
    assert SIGILL_WORDS in first.failure, first.failure
    assert "llama.cpp printed no error first" in first.failure
    assert "no usable GPU" not in first.failure  # the notice is not the reason
    if read_cpu().amx:
        assert "the build uses AMX-TILE, AMX-INT8, AMX-BF16, which this CPU" in first.failure
    kept = record.kept
    assert kept.decode_tps > 0 and kept.prompt_tps > 0 and len(kept.output_sha256) == 64
    # Measured, not assumed: the rebuild was tried and failed, so no-repack was kept, not installed over.
    assert [t.rung for t in record.trials] == ["as-built", "no-repack", "no-amx"]
    assert builds.installed == []
    assert "serving from rung no-repack" in lines[-1]
    # Whom it ran as: the service user, never root.
    who = account()
    assert who is not None and fake_engines.ran_as(binary) == who.uid
    assert (
        fake_engines.ran_at(binary) == PRIORITIES["high"].nice
    )  # the demo's server.priority: its figures are the server's
    # Written where it is read, and it holds until the engine changes.
    written = EngineRecord.read(engine_dir / RECORD)
    assert written == record
    assert stale_reason(binary, written, Manifest.read(engine_dir)) is None
    again, proved_again = ensure_proven(validate(spec_of(binary)), say, engine_dir=engine_dir, builds=builds)
    assert not proved_again and again == record
    binary.write_text(binary.read_text() + "\n# rebuilt\n")
    assert "engine files" in (stale_reason(binary, written, Manifest.read(engine_dir)) or "")


def test_the_rebuild_that_works_is_installed(
    engine_dir: Path, engine_binary: Path, outside_tmp: Path, spec_of: Callable[..., Path]
) -> None:
    # Neither the build nor its --no-repack run here; the rebuild for this CPU less AMX does.
    binary = fake_engines.sigill_unless(engine_dir / "bin" / "llama-server", engine_binary, "--never")
    built_manifest(engine_dir).write(engine_dir)
    no_amx = fake_engines.working(outside_tmp / f"{engine_dir.name}-no-amx" / "llama-server", engine_binary)
    builds = FakeBuilds(engine_dir, {"no-amx": no_amx})
    if not read_cpu().amx:
        pytest.skip("this CPU reports no AMX: the ladder skips the no-AMX rebuild (tested below)")
    record, _ = ensure_proven(validate(spec_of(binary)), say=lambda _: None, engine_dir=engine_dir, builds=builds)
    assert record.rung == "no-amx"
    assert builds.installed == ["no-amx"]
    assert record.extra_args == ()
    assert record.fingerprint.build == "no-amx"
    assert "kept a rebuild for this CPU's instruction sets less AMX" in record.reason
    assert SIGILL_WORDS in record.reason  # the story names what failed above it


def test_the_portable_build_is_the_last_rung_and_then_nothing(
    engine_dir: Path, engine_binary: Path, outside_tmp: Path, spec_of: Callable[..., Path]
) -> None:
    binary = fake_engines.sigill_unless(engine_dir / "bin" / "llama-server", engine_binary, "--never")
    built_manifest(engine_dir).write(engine_dir)
    dead = fake_engines.sigill_unless(
        outside_tmp / f"{engine_dir.name}-dead" / "llama-server", engine_binary, "--never"
    )
    portable = fake_engines.working(outside_tmp / f"{engine_dir.name}-portable" / "llama-server", engine_binary)
    builds = FakeBuilds(engine_dir, {"no-amx": dead, "portable": portable})
    record, _ = ensure_proven(validate(spec_of(binary)), say=lambda _: None, engine_dir=engine_dir, builds=builds)
    assert record.rung == "portable"
    assert builds.installed == ["portable"]
    # Nothing works: nothing is recorded, and the error names every rung's failure.
    (engine_dir / RECORD).unlink()
    shutil.copy2(dead, engine_dir / "bin" / "llama-server")
    built_manifest(engine_dir).write(engine_dir)
    builds = FakeBuilds(engine_dir, {"no-amx": dead, "portable": dead})
    with pytest.raises(EngineUnproven) as refused:
        ensure_proven(validate(spec_of(binary)), say=lambda _: None, engine_dir=engine_dir, builds=builds)
    message = str(refused.value)
    assert message.startswith("no engine works on this machine")
    for rung in ("as-built", "no-repack", "portable"):
        assert f"{rung}: llama-server {SIGILL_WORDS}" in message
    assert not (engine_dir / RECORD).exists()


def test_the_fastest_rung_that_answers_is_kept(
    engine_dir: Path, engine_binary: Path, outside_tmp: Path, spec_of: Callable[..., Path]
) -> None:
    binary = fake_engines.sigill_unless(engine_dir / "bin" / "llama-server", engine_binary)
    built_manifest(engine_dir).write(engine_dir)
    no_amx = fake_engines.working(outside_tmp / f"{engine_dir.name}-no-amx" / "llama-server", engine_binary)
    builds = FakeBuilds(engine_dir, {"no-amx": no_amx})
    record, _ = ensure_proven(validate(spec_of(binary)), say=lambda _: None, engine_dir=engine_dir, builds=builds)
    passed = [t for t in record.trials if t.passed]
    assert len(passed) == (2 if read_cpu().amx else 1)
    # By measurement, whichever it is: the fastest, unless the installed build is within the margin of it.
    best = max(passed, key=lambda t: t.decode_tps)
    if record.kept != best:
        assert record.rung == "no-repack" and record.kept.decode_tps >= (1 - SWITCH_MARGIN) * best.decode_tps
    assert (builds.installed == ["no-amx"]) == (record.rung == "no-amx")


def test_a_rebuild_replaces_the_installed_build_only_beyond_the_margin() -> None:
    def trial(rung: Rung, decode: float) -> Trial:
        return Trial(rung, True, decode_tps=decode)

    installed = lambda t: t.rung in ("as-built", "no-repack")  # noqa: E731
    assert fastest([trial("no-repack", 100.0), trial("no-amx", 105.0)], installed).rung == "no-repack"
    assert fastest([trial("no-repack", 100.0), trial("no-amx", 120.0)], installed).rung == "no-amx"
    assert fastest([trial("no-amx", 120.0)], installed).rung == "no-amx"


def test_a_pinned_rung_is_the_only_one_proven(
    engine_dir: Path, engine_binary: Path, spec_of: Callable[..., Path]
) -> None:
    binary = fake_engines.sigill_unless(engine_dir / "bin" / "llama-server", engine_binary)
    built_manifest(engine_dir).write(engine_dir)
    spec = spec_of(binary, rung="no-repack")
    record, _ = ensure_proven(
        validate(spec), say=lambda _: None, engine_dir=engine_dir, builds=FakeBuilds(engine_dir, {})
    )
    assert [t.rung for t in record.trials] == ["no-repack"]
    assert record.pinned and record.reason.startswith("pinned by the spec (engine.rung = 'no-repack')")
    # Pinning another rung later makes the record stale: that rung is proven next.
    assert "pins engine.rung = 'as-built'" in (
        stale_reason(binary, record, Manifest.read(engine_dir), pin="as-built") or ""
    )


def test_a_crash_after_the_first_token_fails_the_proof_and_reads_the_same_in_the_launcher(
    engine_dir: Path, engine_binary: Path, spec_of: Callable[..., Path], tmp_path: Path
) -> None:
    binary = fake_engines.sigsegv_after_first_token(engine_dir / "bin" / "llama-server", engine_binary)
    with pytest.raises(EngineUnproven) as refused:
        ensure_proven(validate(spec_of(binary)), say=lambda _: None, engine_dir=engine_dir)
    message = str(refused.value)
    assert f"as-built: llama-server {SIGSEGV_WORDS}" in message, message
    # Not built by llm-appliance: no rebuild is tried, and it says so.
    assert "skipped: " in message and "is not built by llm-appliance" in message
    # The server unit's launcher (the journal, `up`) words the same death the same way, and leaves it for `status`.
    argv = list(validate(spec_of(binary)).plan.argv)
    port = str(free_port())
    argv[argv.index("--port") + 1] = port
    state = tmp_path / "state"
    state.mkdir()
    plan = {"argv": argv, "health": f"http://127.0.0.1:{port}/health", "state": str(state)}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, json.dumps(plan)], stderr=subprocess.PIPE, text=True)
    try:
        api = ServerApi(f"http://127.0.0.1:{port}", timeout=5)
        assert wait_for(lambda: _health(api) == 200 or launcher.poll() is not None, 120)
        with contextlib.suppress(ServerUnreachable):  # it dies under the request: that is the point
            api.chat([{"role": "user", "content": "Say hello."}], 16, timeout=60)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGSEGV, err
    assert f"llama-server exited unexpectedly: it {SIGSEGV_WORDS}" in err, err
    assert SIGSEGV_WORDS in (state / LAST_EXIT).read_text()


# The server unit's ExecStart as a process of its own, with a state directory of the test's.
LAUNCHER = """
import json, logging, sys
from pathlib import Path
from appliance.runtime.launch import Launcher, LaunchPlan
from appliance.runtime.notify import Notifier
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
given = json.loads(sys.argv[1])
plan = LaunchPlan(tuple(given["argv"]), given["health"], None, False, True, 0, Path(given["state"]))
sys.exit(Launcher(plan, Notifier(enabled=False), stop_timeout=5).run())
"""


def _health(api: ServerApi) -> int:
    try:
        return api.health()
    except ServerUnreachable:
        return 0


def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_up_proves_a_crashing_engine_serves_from_its_rung_and_status_and_explain_name_it(
    outside_tmp: Path, engine_binary: Path, spec_of: Callable[..., Path], appliance_up: UpProcess, tmp_path: Path
) -> None:
    """The demo's first run on an AMX Xeon, end to end: `up` proves the engine, which dies by SIGILL; the ladder
    keeps --no-repack; it serves; `explain` and `status` say which rung and why."""
    binary = fake_engines.sigill_unless(outside_tmp / "user-engine" / "llama-server", engine_binary)
    text = spec_of(binary).read_text()
    server, exporter = free_port(), free_port()
    spec = tmp_path / "demo.toml"
    spec.write_text(text.replace("port = 8080", f"port = {server}").replace("port = 9478", f"port = {exporter}"))
    record = record_file(binary, paths.ENGINE_DIR)
    try:
        process, output = appliance_up(spec)
        ready = "llama-server is ready after"
        assert wait_for(lambda: any(ready in line for line in output) or process.poll() is not None, 300)
        shown = "".join(output)
        assert process.poll() is None, shown
        assert f"engine: as-built: llama-server {SIGILL_WORDS}" in shown
        assert shown.count("engine: serving from rung no-repack") == 1, shown  # said once
        served = next(line for line in output if "+ " in line and f"--port {server} " in line)
        assert served.split()[2] == str(binary) and "--no-repack" in served.split(), served
        explained = cli("explain", spec)
        assert (
            "engine rung: no-repack" in explained.stdout
            and "adds to the llama-server argv: --no-repack" in explained.stdout
        )
        argv_start = explained.stdout.index("llama-server argv:")
        assert "--no-repack" in explained.stdout[argv_start:]
        seen = cli("status", spec, "--state-dir", tmp_path / "state")
        assert any(line.startswith("engine   rung: no-repack, proven ") for line in seen.stdout.splitlines()), (
            seen.stdout
        )
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        record.unlink(missing_ok=True)


def cli(*words: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "appliance.cli.main", *map(str, words)], capture_output=True, text=True, timeout=120
    )


def test_the_real_engine_is_proven_on_this_cpu(
    smollm2: Path, engine_binary: Path, spec_of: Callable[..., Path]
) -> None:
    """The installed engine holds its proof here (tests/run proves it), and on a CPU that reports AMX the
    native build itself is run: it answers, or it dies as the ladder expects and --no-repack answers."""
    manifest = Manifest.read(paths.ENGINE_DIR)
    record = EngineRecord.read(paths.ENGINE_DIR / RECORD)
    assert record is not None, "the installed engine has no proof: tests/run runs `llm-appliance engine prove`"
    assert stale_reason(engine_binary, record, manifest) is None
    assert record.kept.passed and record.kept.decode_tps > 0
    cpu = read_cpu()
    native = Path(f"/var/cache/llm-appliance/engine/build/{PINNED.package}-{PINNED.version}-cpu/bin/llama-server")
    if not cpu.amx or not native.is_file():
        print(
            f"\nthe installed engine ({record.rung}) proven: {record.kept.summary()}; no AMX here, nothing more to run"
        )
        return
    validated = validate(spec_of(native))
    trials = []
    for rung, flags in (("as-built", ()), ("no-repack", ("--no-repack",))):
        with temporary_key(engine_proof.proof_user()) as (key_file, key):
            port = free_port()
            argv = [*engine_proof.proof_plan(validated, port, key_file), *flags]
            sets = (
                tuple(manifest.instruction_sets)
                if manifest and manifest.variant == "native"
                else tuple(cpu.instruction_sets)
            )
            trials.append(engine_proof.run_proof(argv, engine_proof.proof_user(), key, port, sets, cpu, rung))  # type: ignore[arg-type]
    print(f"\nran the real native build on {cpu.model} (AMX): " + "; ".join(t.summary() for t in trials))
    as_built, no_repack = trials
    assert no_repack.passed, no_repack.failure
    if not as_built.passed:
        assert "died by SIG" in as_built.failure, as_built.failure
        assert record.rung != "as-built"  # the ladder did not keep what dies here
