"""The memory budget of the machine itself: what llama.cpp and llama-server keep in host RAM, against
MemTotal x memory.host_memory_utilization; and the error, with fixes, when the plan does not fit. Pure.

Measured with bench/host_memory.py on the demo (SmolLM2-135M as target and draft, CPU, f16 cache): VmRSS
417 MiB at ctx 4096 and 1679 MiB at ctx 32768, against 364 and 1624 MiB of planned weights and KV cache:
the rest (compute buffers of 18 and 46 MiB per model, which compute.py now estimates, libraries) sits well
inside the 256 MiB margin.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from appliance.facts.gguf import ModelInfo
from appliance.facts.machine import MachineFacts
from appliance.plan.budget import KV_CELL_PAD, MIB, BudgetLine, DeviceBudget, over_error
from appliance.plan.compute import cpu_compute_bytes, peaks, shape, target_outputs_per_seq
from appliance.plan.devices import draft_devices, draft_in_use, first_gpu_layer, gpu_devices, offloaded_layers
from appliance.plan.memory import context_memory, context_params
from appliance.spec.model import Model, Spec
from appliance.spec.problems import Problem, warning

HOST = "host RAM"
CACHE_RAM_FLAGS = ("--cache-ram", "-cram")
# llama-server's --cache-ram default (common/common.h, `--help`): its prompt cache keeps the KV state of
# past prompts in host RAM, up to this many MiB, whether the KV cache itself is on a GPU or not.
DEFAULT_CACHE_RAM_MIB = 8192


def cpu_weight_bytes(info: ModelInfo, layers_on_gpu: int) -> int:
    """The weights llama.cpp leaves on the CPU: the blocks below the offloaded ones, the input embedding
    always (llama-model.cpp load_tensors; see budget.gpu_weight_bytes), and the output layer unless offloaded."""
    if layers_on_gpu <= 0:
        return info.weight_bytes
    first_gpu_layer = max(0, info.block_count + 1 - layers_on_gpu)
    blocks = sum(t.n_bytes for t in info.tensors if t.layer is not None and t.layer < first_gpu_layer)
    return blocks + sum(t.n_bytes for t in info.tensors if t.name == "token_embd.weight")


def cache_ram_setting(spec: Spec) -> int | None:
    """--cache-ram as server.extra_args sets it, in MiB (-1: no limit); None when they do not set it."""
    args = spec.server.extra_args
    value = None
    for index, arg in enumerate(args):
        name, equals, inline = arg.partition("=")
        if name in CACHE_RAM_FLAGS:
            value = inline if equals else args[index + 1] if index + 1 < len(args) else ""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:  # llama-server refuses it at start (the dialect check names extra_args)
        return DEFAULT_CACHE_RAM_MIB


def _model_lines(
    role: str, model: Model, devices: list[str], info: ModelInfo, spec: Spec
) -> tuple[list[BudgetLine], float]:
    layers = offloaded_layers(model, info, devices)
    cpu_layers = info.block_count - max(layers - 1, 0)  # as budget.py: the output layer is the first offloaded
    first_gpu = first_gpu_layer(info, layers)
    found = []
    # Counted whatever the load mode: mmapped weights are page cache, which the kernel may evict, but a CPU
    # layer reads all of its weights for every token, so evicted weights come back from disk at every step.
    weights = cpu_weight_bytes(info, layers)
    if weights:
        found.append(BudgetLine(f"{role} weights on the CPU ({info.file_type}, {cpu_layers} layers + input)", weights))
    # The caches of a block stay with the block: of those left on the CPU, here. Only the full-context KV
    # cache grows with ctx_size (per_token).
    per_token = 0.0
    for cache in context_memory(info, context_params(spec, model)):
        on_cpu = cache.select(lambda il: il < first_gpu)
        if on_cpu.layers:
            found.append(BudgetLine(f"{role} {on_cpu.label()} on the CPU", on_cpu.bytes))
            per_token += on_cpu.bytes_per_row if on_cpu.kind == "KV cache" else 0.0
    # The CPU backend's compute buffer (compute.py): the graph's peaks for the layers left here, else only
    # the input embeddings.
    drafting = role == "target" and spec.speculative.type != "none"
    model_peaks = peaks(info, shape(spec, target_outputs_per_seq(spec, drafting)))
    found.append(
        BudgetLine(
            f"{role} CPU compute buffer (estimated)",
            cpu_compute_bytes(model_peaks, cpu_layers, layers <= info.block_count),
        )
    )
    return found, per_token


def host_lines(spec: Spec, target: ModelInfo, draft: ModelInfo | None) -> tuple[list[BudgetLine], float]:
    """What the server keeps in host RAM, a line each, and the bytes per token of context among them."""
    lines, per_token = _model_lines("target", spec.models.target, gpu_devices(spec.models.target), target, spec)
    if spec.models.draft is not None and draft is not None and draft_in_use(spec):
        draft_lines, draft_per_token = _model_lines("draft", spec.models.draft, draft_devices(spec), draft, spec)
        lines += draft_lines
        per_token += draft_per_token
    # One margin for the machine, not one per model: the launcher, the server's own heap and libraries.
    lines.append(BudgetLine("margin: processes (memory.compute_headroom_mib)", spec.memory.compute_headroom_mib * MIB))
    return lines, per_token


@dataclass(frozen=True)
class HostPlan:
    budget: DeviceBudget | None  # None when the machine's RAM is unknown
    problems: list[Problem]
    per_token: float
    cache_ram_mib: int | None  # what the plan passes as --cache-ram; None: nothing (extra_args, or no budget)


def host_budget(
    spec: Spec,
    facts: MachineFacts,
    target: ModelInfo,
    draft: ModelInfo | None,
    prompt_cache: bool = True,
    fitting_ctx: Callable[[], int] = lambda: 0,
) -> HostPlan:
    """The host budget and its problems. llama-server's prompt cache keeps the KV state of past prompts in host
    RAM up to --cache-ram (default 8192 MiB), filling over time: a server that fits at start would be killed
    hours later. So, unless extra_args size it, the plan gives it what the budget leaves, at most the default
    (`prompt_cache`: the binary has one). `fitting_ctx` gives the largest ctx_size that fits, for the error."""
    lines, per_token = host_lines(spec, target, draft)
    found = []
    setting = cache_ram_setting(spec)
    if setting is not None and setting < 0:
        found.append(
            warning(
                "server.extra_args",
                "--cache-ram -1 lets llama-server's prompt cache grow without limit: it is not in the host budget",
                f"give --cache-ram a size in MiB, or leave it out: the plan then sizes it (at most {DEFAULT_CACHE_RAM_MIB})",
            )
        )
    elif setting:
        lines.append(
            BudgetLine(f"prompt cache (--cache-ram {setting} MiB from extra_args, filled over time)", setting * MIB)
        )
    if spec.memory.host_total_mib is not None:
        total = spec.memory.host_total_mib * MIB
    elif facts.host_memory is not None:
        total = facts.host_memory.total_bytes
    else:
        found.append(
            warning(
                "memory.host_total_mib",
                f"cannot tell how much RAM this machine has ({facts.host_memory_error or 'no /proc/meminfo'}): "
                "the host memory is not budgeted",
                "set memory.host_total_mib = 65536 (MiB)",
            )
        )
        return HostPlan(None, found, per_token, None)
    budget = DeviceBudget(HOST, total, spec.memory.host_memory_utilization, tuple(lines))
    sized = None
    if setting is None and prompt_cache:
        sized = max(0, min(DEFAULT_CACHE_RAM_MIB, -budget.over_bytes // MIB))
        label = f"prompt cache (--cache-ram {sized} MiB: what the budget leaves, at most {DEFAULT_CACHE_RAM_MIB})"
        budget = DeviceBudget(HOST, total, budget.utilization, (*lines, BudgetLine(label, sized * MIB)))
    if budget.over_bytes > 0:
        found.append(over_host_budget(spec, budget, per_token, fitting_ctx()))
    return HostPlan(budget, found, per_token, sized)


def over_host_budget(spec: Spec, budget: DeviceBudget, per_token: float, fitting_ctx: int) -> Problem:
    """`fitting_ctx`: the largest ctx_size host RAM holds (fit.py searches it with the whole budget)."""
    fixes = []
    if fitting_ctx >= KV_CELL_PAD:
        fixes.append(f"server.ctx_size = {fitting_ctx} or less")
    models = [m for m in (spec.models.target, spec.models.draft) if m is not None]
    if per_token and any(m.cache_type_k in ("f32", "f16", "bf16") for m in models):
        fixes.append('cache_type_k/cache_type_v = "q8_0" (half the KV memory)')
    setting = cache_ram_setting(spec)
    if setting:
        fixes.append(f"a smaller prompt cache: --cache-ram in server.extra_args (now {setting} MiB), or none there")
    if any(gpu_devices(m) for m in models):
        fixes.append('more layers on the GPU (gpu_layers = "all")')
    fixes.append("a smaller quantization of the target")
    return over_error(
        budget,
        "memory.host_memory_utilization",
        "llama-server would swap or be killed by the kernel's OOM killer",
        fixes,
    )
