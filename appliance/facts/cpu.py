"""What the CPU says it can run (/proc/cpuinfo), in the words of ggml's build options.

ggml compiles its CPU kernels for a set of x86 instruction sets: all the build machine has with GGML_NATIVE=ON
(`-march=native`), or those its options switch on. An engine runs only where the CPU reports every one of them,
and where the code for each works: ggml's AMX path dies by SIGILL on some machines that do report AMX
(llama.cpp #28756). This table is what the engine ladder rebuilds from and what a crash is explained with.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class InstructionSet:
    option: str  # ggml's CMake option
    name: str  # as an operator reads it
    flags: tuple[str, ...]  # what /proc/cpuinfo lists when the CPU has it (all of them)


# In ggml's own order (ggml/src/ggml-cpu/CMakeLists.txt): each option adds its -m flags.
INSTRUCTION_SETS = (
    InstructionSet("GGML_SSE42", "SSE4.2", ("sse4_2",)),
    InstructionSet("GGML_F16C", "F16C", ("f16c",)),
    InstructionSet("GGML_FMA", "FMA", ("fma",)),
    InstructionSet("GGML_BMI2", "BMI2", ("bmi2",)),
    InstructionSet("GGML_AVX", "AVX", ("avx",)),
    InstructionSet("GGML_AVX2", "AVX2", ("avx2",)),
    InstructionSet("GGML_AVX_VNNI", "AVX-VNNI", ("avx_vnni",)),
    InstructionSet("GGML_AVX512", "AVX-512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    InstructionSet("GGML_AVX512_VBMI", "AVX-512 VBMI", ("avx512vbmi",)),
    InstructionSet("GGML_AVX512_VNNI", "AVX-512 VNNI", ("avx512_vnni",)),
    InstructionSet("GGML_AVX512_BF16", "AVX-512 BF16", ("avx512_bf16",)),
    InstructionSet("GGML_AMX_TILE", "AMX-TILE", ("amx_tile",)),
    InstructionSet("GGML_AMX_INT8", "AMX-INT8", ("amx_int8",)),
    InstructionSet("GGML_AMX_BF16", "AMX-BF16", ("amx_bf16",)),
)
AMX = frozenset(s.option for s in INSTRUCTION_SETS if s.option.startswith("GGML_AMX"))
# What runs on every x86-64 CPU of the last fifteen years (x86-64-v2): the ladder's last rung.
PORTABLE = frozenset({"GGML_SSE42"})


@dataclass(frozen=True)
class Cpu:
    model: str
    flags: frozenset[str]
    cores: int

    def has(self, option: str) -> bool:
        wanted = next((s for s in INSTRUCTION_SETS if s.option == option), None)
        return wanted is not None and all(flag in self.flags for flag in wanted.flags)

    @property
    def instruction_sets(self) -> tuple[str, ...]:
        """The ggml options this CPU can run, in ggml's order: what GGML_NATIVE=ON compiles in."""
        return tuple(s.option for s in INSTRUCTION_SETS if self.has(s.option))

    @classmethod
    def of_sets(cls, model: str, options: tuple[str, ...]) -> Cpu:
        """A CPU known by the instruction sets recorded of it (the units' sandbox hides /proc/cpuinfo)."""
        flags = frozenset(flag for s in INSTRUCTION_SETS if s.option in options for flag in s.flags)
        return cls(model, flags, os.cpu_count() or 1)

    @property
    def amx(self) -> bool:
        return any(self.has(option) for option in AMX)


def read_cpu(path: Path = CPUINFO) -> Cpu:
    """The first processor's model and flags (every core of a machine reports the same); empty when unreadable."""
    model, flags = "", frozenset[str]()
    try:
        text = path.read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        if model and flags:
            break
    return Cpu(model or "unknown CPU", flags, os.cpu_count() or 1)


def names(options: tuple[str, ...] | frozenset[str]) -> str:
    """AVX2, AVX-512, AMX-TILE: options as an operator reads them, in ggml's order."""
    return ", ".join(s.name for s in INSTRUCTION_SETS if s.option in options) or "none"
