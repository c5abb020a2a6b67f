"""The machine's own memory: /proc/meminfo, the host budget from real GGUF headers, the refusal of a spec
whose host memory does not fit, the resolved figure and the server unit's MemoryHigh=."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import gpu_facts, resolved

from appliance.facts.gguf import read_model
from appliance.facts.machine import gather
from appliance.facts.meminfo import HostMemory, MeminfoError, parse_meminfo, read_meminfo
from appliance.plan.budget import MIB, gpu_weight_bytes
from appliance.plan.compute import peaks, shape, target_outputs_per_seq
from appliance.plan.host import DEFAULT_CACHE_RAM_MIB, HOST, cache_ram_setting, cpu_weight_bytes, host_budget
from appliance.plan.resolved import Appliance
from appliance.plan.validate import validate
from appliance.render.render import render
from appliance.spec.load import load_spec
from appliance.spec.model import Spec
from appliance.spec.problems import Severity, SpecInvalid

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


# --- the host budget, from real headers ---


def cpu_spec(path: Path, **server: object) -> Spec:
    model = {"path": str(path), "devices": ["none"], "gpu_layers": 0}
    return Spec.model_validate({"server": {"ctx_size": 4096, **server}, "models": {"target": model, "draft": model}})


def test_cpu_only_counts_every_weight_and_the_whole_kv_cache(smollm2: Path) -> None:
    info = read_model(smollm2)
    planned = host_budget(cpu_spec(smollm2), gpu_facts(), info, info)
    budget, problems, per_token = planned.budget, planned.problems, planned.per_token
    assert problems == [] and budget is not None
    assert budget.device == HOST
    assert per_token == 2 * SMOLLM2_KV_PER_TOKEN
    spec = cpu_spec(smollm2)
    target_compute = peaks(info, shape(spec, target_outputs_per_seq(spec, True))).whole
    draft_compute = peaks(info, shape(spec, 1)).whole
    assert [line.bytes for line in budget.lines] == [
        info.weight_bytes,
        SMOLLM2_KV_PER_TOKEN * 4096,
        target_compute,
        info.weight_bytes,
        SMOLLM2_KV_PER_TOKEN * 4096,
        draft_compute,
        256 * MIB,
        DEFAULT_CACHE_RAM_MIB * MIB,
    ]
    assert 17 * MIB < draft_compute < 20 * MIB  # llama-server logs 17.51 MiB here (tests/test_compute.py)
    assert budget.total_bytes == 64 << 30 and budget.usable_bytes == int((64 << 30) * 0.9)


@pytest.mark.parametrize("model", ["smollm2", "target-27b-Q4_K_M.gguf"])
def test_every_weight_is_on_the_cpu_or_the_gpu(model: str, smollm2: Path, fixture_models: Path) -> None:
    """A real header: whatever the split, CPU + GPU hold every tensor once, and the input embedding twice
    when the output is tied to it (llama.cpp copies it to the GPU's output layer)."""
    info = read_model(smollm2 if model == "smollm2" else fixture_models / model)
    embedding = next(t.n_bytes for t in info.tensors if t.name == "token_embd.weight")
    tied = not any(t.name == "output.weight" for t in info.tensors)
    assert cpu_weight_bytes(info, 0) == info.weight_bytes
    for layers in range(1, info.block_count + 2):
        both = cpu_weight_bytes(info, layers) + gpu_weight_bytes(info, layers)
        assert both == info.weight_bytes + (embedding if tied else 0), layers
    assert cpu_weight_bytes(info, info.block_count + 1) == embedding


def test_a_partial_offload_leaves_the_lower_layers_and_their_kv_on_the_host(fixture_models: Path) -> None:
    info = read_model(fixture_models / "target-27b-Q4_K_M.gguf")  # 64 layers, 4 KV heads x 128 dims
    spec = Spec.model_validate({"models": {"target": {"path": str(info.path), "devices": ["CUDA0"], "gpu_layers": 41}}})
    planned = host_budget(spec, gpu_facts(24), info, None)
    budget, problems, per_token = planned.budget, planned.problems, planned.per_token
    assert problems == [] and budget is not None
    # 41 offloaded = the output layer + the last 40 blocks: 24 blocks stay, with their KV cache.
    assert per_token == 24 * 4 * 128 * 2 * 2
    by_label = {line.label: line.bytes for line in budget.lines}
    assert by_label["target KV cache (f16/f16, 24 layers x 8192 cells) on the CPU"] == per_token * 8192
    assert by_label["target weights on the CPU (Q4_K_M, 24 layers + input)"] == cpu_weight_bytes(info, 41)


def test_a_draft_without_devices_follows_the_target_to_the_gpu(smollm2: Path) -> None:
    info = read_model(smollm2)
    spec = Spec.model_validate(
        {"models": {"target": {"path": str(smollm2), "devices": ["CUDA0"]}, "draft": {"path": str(smollm2)}}}
    )
    planned = host_budget(spec, gpu_facts(24), info, info)
    budget, _, per_token = planned.budget, planned.problems, planned.per_token
    assert per_token == 0 and budget is not None
    assert [line.label for line in budget.lines if "draft" in line.label] == [
        "draft weights on the CPU (Q4_1, 0 layers + input)",
        "draft CPU compute buffer (estimated)",  # only the input embeddings: every layer is on the GPU
    ]


@pytest.mark.parametrize(
    ("extra", "line", "sized"),
    [
        ([], "prompt cache (--cache-ram 8192 MiB: what the budget leaves, at most 8192)", 8192),
        (["--cache-ram", "2048"], "prompt cache (--cache-ram 2048 MiB from extra_args, filled over time)", None),
        (["--cache-ram=0"], None, None),
        (["-cram", "-1"], None, None),
    ],
)
def test_the_prompt_cache_is_sized_unless_extra_args_size_it(
    extra: list[str], line: str | None, sized: int | None, smollm2: Path
) -> None:
    info = read_model(smollm2)
    planned = host_budget(cpu_spec(smollm2, extra_args=extra), gpu_facts(), info, info)
    assert planned.budget is not None and planned.cache_ram_mib == sized
    assert [x.label for x in planned.budget.lines if x.label.startswith("prompt cache")] == ([line] if line else [])
    assert [p.field for p in planned.problems] == (["server.extra_args"] if extra[-1:] == ["-1"] else [])


def test_a_small_machine_gets_the_prompt_cache_that_fits(smollm2: Path) -> None:
    """What the budget leaves, not llama-server's 8 GiB: the demo stays valid on an 8 GiB box."""
    info = read_model(smollm2)
    spec = cpu_spec(smollm2, extra_args=[])
    spec = spec.model_copy(update={"memory": spec.memory.model_copy(update={"host_total_mib": 4096})})
    planned = host_budget(spec, gpu_facts(), info, info)
    assert planned.problems == [] and planned.budget is not None
    assert 0 < planned.cache_ram_mib < DEFAULT_CACHE_RAM_MIB  # type: ignore[operator]
    assert -MIB < planned.budget.over_bytes <= 0  # filled to the MiB
    assert cache_ram_setting(spec) is None


def test_unknown_host_memory_is_a_warning_and_no_budget(smollm2: Path) -> None:
    info = read_model(smollm2)
    facts = dataclasses.replace(gpu_facts(), host_memory=None, host_memory_error="cannot read /proc/meminfo: gone")
    planned = host_budget(cpu_spec(smollm2), facts, info, info)
    budget, [problem], _ = planned.budget, planned.problems, planned.per_token
    assert budget is None
    assert problem.severity is Severity.WARNING and problem.field == "memory.host_total_mib"
    assert "cannot read /proc/meminfo: gone" in problem.message
    stated = cpu_spec(smollm2).model_copy(
        update={"memory": cpu_spec(smollm2).memory.model_copy(update={"host_total_mib": 16384})}
    )
    planned = host_budget(stated, facts, info, info)
    budget, problems, _ = planned.budget, planned.problems, planned.per_token
    assert problems == [] and budget is not None and budget.total_bytes == 16384 * MIB


# --- validate: refused over, valid under ---

# The fixed part of the demo's host budget, MiB: 2 x SmolLM2 weights (~92), headroom 1024; the prompt cache gets
# what is left, none when nothing is.
HOST_MIB = 800


def demo_with(example: Callable[..., Path], ctx: int) -> Path:
    return example(
        "demo-draft.toml",
        {"ctx_size = 4096": f"ctx_size = {ctx}", "[network]": f"[memory]\nhost_total_mib = {HOST_MIB}\n\n[network]"},
    )


def test_a_kv_cache_beyond_the_hosts_ram_is_refused_with_the_context_that_fits(
    example: Callable[..., Path], smollm2: Path
) -> None:
    spec = demo_with(example, 8192)
    with pytest.raises(SpecInvalid) as caught:
        validate(spec, facts=gpu_facts(host_gib=512))  # memory.host_total_mib wins over the facts
    [problem] = caught.value.errors
    assert problem.field == "server.ctx_size" and problem.file == spec and problem.line is not None
    assert problem.message.startswith("host RAM is over budget by ")
    assert f"({HOST_MIB / 1024:.2f} GiB x 0.9, memory.host_memory_utilization)" in problem.message
    assert "draft KV cache (f16/f16, 30 layers x 8192 cells) on the CPU 0.18 GiB" in problem.message
    assert "prompt cache (--cache-ram 0 MiB: what the budget leaves, at most 8192) 0.00 GiB" in problem.message
    assert 'cache_type_v = "q8_0"' in problem.fix
    fitting = int(re.search(r"server.ctx_size = (\d+) or less", problem.fix).group(1))  # type: ignore[union-attr]
    # searched with the whole budget (plan/fit.py), compute buffers included: below what the KV cache alone allows
    info = read_model(smollm2)
    fixed = 2 * info.weight_bytes + 256 * MIB
    assert 0 < fitting < (int(HOST_MIB * MIB * 0.9) - fixed) // (2 * SMOLLM2_KV_PER_TOKEN) // 256 * 256

    # the fitting context validates, right under the limit; one step more does not
    plan = validate(demo_with(example, fitting), facts=gpu_facts()).plan
    assert plan.host is not None and 0 <= -plan.host.over_bytes < 2 * SMOLLM2_KV_PER_TOKEN * 256
    with pytest.raises(SpecInvalid):
        validate(demo_with(example, fitting + 256), facts=gpu_facts())


def test_the_planned_host_bytes_are_resolved_and_bound_the_server_unit(example: Callable[..., Path]) -> None:
    spec = demo_with(example, 4096)
    appliance = resolved(spec, gpu_facts())
    plan = validate(spec, facts=gpu_facts()).plan
    assert plan.host is not None
    assert appliance.planned_host_bytes == plan.host.used_bytes == sum(line.bytes for line in plan.host.lines)
    assert appliance.host_usable_bytes == int(HOST_MIB * MIB * 0.9)
    assert Appliance.from_document(appliance.document()) == appliance
    unit = render(appliance)["etc/systemd/system/llm-appliance-server.service"]
    assert f"\nMemoryHigh={-(-int(HOST_MIB * MIB * 0.9) // MIB)}M\n" in unit
    assert "MemoryHigh=720M" in unit  # 800 MiB x 0.9
    # a snapshot without the fields is refused (tests/test_snapshot.py), and an unknown host renders no MemoryHigh=
    unknown = dataclasses.replace(appliance, planned_host_bytes=0, host_usable_bytes=0, memory_high_mib=None)
    assert "MemoryHigh" not in render(unknown)["etc/systemd/system/llm-appliance-server.service"]


def test_a_spec_load_keeps_the_new_fields(example: Callable[..., Path]) -> None:
    memory = load_spec(demo_with(example, 4096)).spec.memory
    assert (memory.host_total_mib, memory.host_memory_utilization) == (HOST_MIB, 0.9)
