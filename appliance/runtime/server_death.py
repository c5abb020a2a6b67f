"""How llama-server ended, as an operator reads it: the signal by name and what it means, the exit status a
shell would show, llama.cpp's own error (not the GPU notice it prints at every start on a machine without
one), and, for an instruction the CPU cannot run, the instruction sets involved. One wording for `up`, the
server unit's journal, `status`, `explain` and the engine's proof."""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable
from pathlib import Path

from appliance.facts.cpu import AMX, Cpu, names, read_cpu
from appliance.facts.engine_manifest import Manifest
from appliance.facts.engine_record import EngineRecord, record_file
from appliance.system import paths

# The launcher leaves the last exit's description in the state directory; `status` shows it while the server is down.
LAST_EXIT = "server-last-exit.txt"
SIGNAL_MEANINGS = {
    signal.SIGILL: "an instruction this CPU or this build cannot run",
    signal.SIGSEGV: "an invalid memory access (a fault in the engine, or a damaged model file)",
    signal.SIGBUS: "a bus error (the model file shrank or changed while mapped, or failing memory)",
    signal.SIGFPE: "an arithmetic fault in the engine",
    signal.SIGABRT: "it aborted (a failed check in llama.cpp; its last lines say which)",
    signal.SIGKILL: "killed outright (the kernel's out-of-memory killer, a watchdog, or kill -9)",
    signal.SIGTERM: "asked to stop (SIGTERM)",
}
# What llama.cpp prints at every start on a machine without a usable GPU, or about its build: no error.
NOTICES = (
    "no usable gpu found",
    "compiled without gpu support",
    "consult docs/build.md",
    "--gpu-layers option will be ignored",
    "ggml_cuda_init",
    "no cuda devices",
)
ERROR_WORDS = ("error", "failed", "unable", "invalid", "cannot", "not found", "out of memory")
# llama.cpp's log lines: an optional time stamp, the level letter, the text ("0.00.002.361 E srv  load_model: ...").
LEVELLED = re.compile(r"^(?:[\d.]+\s+)?([DIWE])\s")


def llama_error(lines: Iterable[str]) -> str | None:
    """The first line that is llama.cpp's own error, not one of its notices; None when it printed none."""
    for line in (raw.strip() for raw in lines):
        lower = line.lower()
        if not line or any(notice in lower for notice in NOTICES):
            continue
        level = LEVELLED.match(line)
        letter = level.group(1) if level else None
        # An error line, or an unlevelled or warning line that says something failed (an info line saying
        # "failed" is llama.cpp narrating a fallback, not why it died).
        if letter == "E" or (letter in (None, "W") and any(word in lower for word in ERROR_WORDS)):
            return line
    return None


def exit_status(code: int) -> str:
    """`code` as Popen gives it (negative: killed by that signal), as the shell and systemd show it."""
    if code < 0:
        return f"{signal.Signals(-code).name} (exit status {128 - code})"
    return f"exit status {code}"


def describe_exit(code: int, lines: Iterable[str], build_sets: tuple[str, ...] = (), cpu: Cpu | None = None) -> str:
    """One line: how it ended, what that means, what llama.cpp said, and the instruction sets involved."""
    kept = [line for line in lines if line.strip()]
    said = llama_error(kept)
    if code < 0:
        number = -code
        meaning = SIGNAL_MEANINGS.get(signal.Signals(number), "killed by a signal")
        parts = [f"died by {exit_status(code)}: {meaning}"]
    else:
        parts = [f"exited with {exit_status(code)}"]
    if said:
        parts.append(f"llama.cpp said: {said}")
    elif code < 0:
        last = [line.strip() for line in kept if not any(n in line.lower() for n in NOTICES)]
        parts.append(
            f"llama.cpp printed no error first (its last line: {last[-1][:160]})"
            if last
            else "llama.cpp printed no error first (nothing but its no-GPU notice)"
        )
    else:
        parts.append(f"its last line: {kept[-1].strip()[:200]}" if kept else "it printed nothing")
    if code == -signal.SIGILL:
        parts.append(instruction_sets_involved(build_sets, cpu))
    return "; ".join(parts)


def instruction_sets_involved(build_sets: tuple[str, ...], cpu: Cpu | None) -> str:
    """The build's instruction sets against the CPU's: one it lacks, or the AMX path that dies where it is."""
    if not build_sets:
        return "the build's instruction sets are not recorded (a binary not built by llm-appliance)"
    if cpu is None or not cpu.flags:
        return f"the build uses {names(tuple(build_sets))}; this CPU's flags cannot be read here"
    lacking = tuple(option for option in build_sets if not cpu.has(option))
    if lacking:
        return f"the build uses {names(lacking)}, which this CPU ({cpu.model}) does not report: it was built for another CPU"
    amx = tuple(option for option in build_sets if option in AMX)
    if amx:
        return (
            f"the build uses {names(amx)}, which this CPU ({cpu.model}) reports: ggml's AMX kernels die so on "
            "some of them (llama.cpp #28756); `llm-appliance engine prove` finds a rung without them"
        )
    return f"the build uses {names(tuple(build_sets))}, all of which this CPU ({cpu.model}) reports"


def engine_facts(binary: Path, engine_dir: Path = paths.ENGINE_DIR) -> tuple[tuple[str, ...], Cpu]:
    """What explains a death by SIGILL: the build's instruction sets (its manifest) and the CPU's (from
    /proc/cpuinfo, else as the engine's proof recorded them: the server unit's sandbox hides /proc/cpuinfo)."""
    manifest = Manifest.read(engine_dir)
    sets = tuple(manifest.instruction_sets) if manifest and Path(manifest.binary) == binary else ()
    cpu = read_cpu()
    if not cpu.flags:
        record = EngineRecord.read(record_file(binary, engine_dir))
        if record is not None:
            cpu = Cpu.of_sets(record.fingerprint.cpu_model, record.cpu_instruction_sets)
    return sets, cpu
