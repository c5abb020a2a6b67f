"""The machine's own memory: /proc/meminfo."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from appliance.facts.machine import gather
from appliance.facts.meminfo import HostMemory, MeminfoError, parse_meminfo, read_meminfo
from appliance.spec.model import Spec

# SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x (K + V) x f16
SMOLLM2_KV_PER_TOKEN = 30 * 3 * 64 * 2 * 2

# --- /proc/meminfo ---


def test_reads_this_machines_meminfo() -> None:
    memory = read_meminfo()
    text = Path("/proc/meminfo").read_text()
    total_kib = int(re.search(r"^MemTotal:\s+(\d+) kB$", text, re.M).group(1))  # type: ignore[union-attr]
    assert memory.total_bytes == total_kib * 1024
    assert memory.available_bytes is not None and 0 < memory.available_bytes <= memory.total_bytes


def test_parses_meminfo_text() -> None:
    text = "MemTotal:       24683796 kB\nMemFree:        23666572 kB\nMemAvailable:   23400000 kB\nHugePages_Total:       0\n"
    assert parse_meminfo(text) == HostMemory(24683796 * 1024, 23400000 * 1024)
    # Linux before 3.14 has no MemAvailable
    assert parse_meminfo("MemTotal: 1024 kB\n") == HostMemory(1024 * 1024, None)


@pytest.mark.parametrize("text", ["", "MemFree: 10 kB\n", "MemTotal: lots\n", "MemTotal: 0 kB\n"])
def test_meminfo_without_a_total_is_an_error(text: str) -> None:
    with pytest.raises(MeminfoError, match="no MemTotal"):
        parse_meminfo(text)


def test_gather_reads_the_meminfo_it_is_given(tmp_path: Path, smollm2: Path) -> None:
    spec = Spec.model_validate({"models": {"target": {"path": str(smollm2)}}})
    fake = tmp_path / "meminfo"
    fake.write_text("MemTotal: 2048 kB\nMemAvailable: 1024 kB\n")
    assert gather(spec, meminfo=fake).host_memory == HostMemory(2 << 20, 1 << 20)
    missing = gather(spec, meminfo=tmp_path / "absent")
    assert missing.host_memory is None
    assert missing.host_memory_error == f"cannot read {tmp_path / 'absent'}: No such file or directory"
