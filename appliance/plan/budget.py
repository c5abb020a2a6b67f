"""The memory budget per GPU: weights, KV cache and compute buffers of each model against the device's usable
memory, as llama.cpp allocates them; and the error, with fixes, when a device is over budget. Pure."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from appliance.facts.gguf import ModelInfo
from appliance.facts.machine import MachineFacts
from appliance.plan.compute import gpu_compute_bytes, peaks, shape, target_outputs_per_seq
from appliance.plan.devices import draft_devices, first_gpu_layer, gpu_devices, offloaded_layers
from appliance.plan.memory import context_memory, context_params
from appliance.spec.model import Model, Spec
from appliance.spec.problems import Problem, error

MIB = 1 << 20
GIB = 1 << 30
KV_CELL_PAD = 256


@dataclass(frozen=True)
class BudgetLine:
    label: str
    bytes: int


@dataclass(frozen=True)
class DeviceBudget:
    device: str
    total_bytes: int
    utilization: float
    lines: tuple[BudgetLine, ...]

    @property
    def usable_bytes(self) -> int:
        return int(self.total_bytes * self.utilization)

    @property
    def used_bytes(self) -> int:
        return sum(line.bytes for line in self.lines)

    @property
    def over_bytes(self) -> int:
        return self.used_bytes - self.usable_bytes


def gpu_weight_bytes(info: ModelInfo, layers_on_gpu: int) -> int:
    """llama-model.cpp load_tensors: of N offloaded layers the first is the output layer, then the last N-1 blocks."""
    if layers_on_gpu <= 0:
        return 0
    first_gpu_layer = max(0, info.block_count + 1 - layers_on_gpu)
    total = sum(t.n_bytes for t in info.tensors if t.layer is not None and t.layer >= first_gpu_layer)
    names = {t.name for t in info.tensors}
    # The input embedding stays on the CPU; a tied output (no output.weight) is copied to the GPU.
    total += sum(t.n_bytes for t in info.tensors if t.layer is None and t.name != "token_embd.weight")
    if "output.weight" not in names:
        total += sum(t.n_bytes for t in info.tensors if t.name == "token_embd.weight")
    return total


@dataclass
class _Usage:
    lines: dict[str, list[BudgetLine]] = field(default_factory=dict)
    per_token: dict[str, float] = field(default_factory=dict)

    def add(self, devices: list[str], label: str, total: int, per_token: float = 0.0) -> None:
        for device in devices:
            self.lines.setdefault(device, []).append(BudgetLine(label, total // len(devices)))
            self.per_token[device] = self.per_token.get(device, 0.0) + per_token / len(devices)


def _model_usage(usage: _Usage, role: str, model: Model, devices: list[str], info: ModelInfo, spec: Spec) -> None:
    if not devices:
        return
    layers = offloaded_layers(model, info, devices)
    kv_layers = max(layers - 1, 0)  # the output layer has no KV cache
    first_gpu = first_gpu_layer(info, layers)
    usage.add(
        devices,
        f"{role} weights ({info.file_type}, {kv_layers}/{info.block_count} layers)",
        gpu_weight_bytes(info, layers),
    )
    # Each block's caches sit with it (llama_kv_cache: model.dev_layer(il)). Only the full-context KV cache grows
    # with ctx_size (per_token); the sliding-window cache and the recurrent state stop at their own sizes.
    for cache in context_memory(info, context_params(spec, model)):
        on_gpu = cache.select(lambda il: il >= first_gpu)
        if on_gpu.layers:
            per_token = on_gpu.bytes_per_row if on_gpu.kind == "KV cache" else 0.0
            usage.add(devices, f"{role} {on_gpu.label()}", on_gpu.bytes, per_token)
    # Each device reserves a compute buffer of its own, not a share of one (compute.py).
    drafting = role == "target" and spec.speculative.type != "none"
    model_peaks = peaks(info, shape(spec, target_outputs_per_seq(spec, drafting)))
    for index, device in enumerate(devices):
        usage.lines.setdefault(device, []).append(
            BudgetLine(f"{role} compute buffer (estimated)", gpu_compute_bytes(model_peaks, index, len(devices)))
        )


def budgets(
    spec: Spec, facts: MachineFacts, target: ModelInfo, draft: ModelInfo | None
) -> tuple[tuple[DeviceBudget, ...], list[Problem], dict[str, float]]:
    usage = _Usage()
    _model_usage(usage, "target", spec.models.target, gpu_devices(spec.models.target), target, spec)
    if spec.models.draft is not None and draft is not None:
        _model_usage(usage, "draft", spec.models.draft, draft_devices(spec), draft, spec)
    for device_lines in usage.lines.values():
        device_lines.append(BudgetLine("margin (memory.compute_headroom_mib)", spec.memory.compute_headroom_mib * MIB))
    found: list[Problem] = []
    result = []
    for device, lines in usage.lines.items():
        total = _device_total(spec, facts, device)
        if total is None:
            found.append(
                error(
                    f"memory.device_total_mib.{device}",
                    f"cannot tell how much memory {device} has: {facts.nvml_error or 'NVML lists no such GPU'}",
                    f"set memory.device_total_mib = {{ {device} = 24576 }} (MiB), or fix the NVIDIA driver",
                )
            )
            continue
        result.append(DeviceBudget(device, total, spec.memory.gpu_memory_utilization, tuple(lines)))
    return tuple(result), found, usage.per_token


def _device_total(spec: Spec, facts: MachineFacts, device: str) -> int | None:
    if device in spec.memory.device_total_mib:
        return spec.memory.device_total_mib[device] * MIB
    gpu = facts.gpu(device)
    return gpu.total_bytes if gpu else None


def over_budget(spec: Spec, budget: DeviceBudget, fitting_ctx: int) -> Problem:
    """`fitting_ctx`: the largest ctx_size this device holds (fit.py searches it with the whole budget)."""
    fixes = []
    if fitting_ctx >= KV_CELL_PAD:
        fixes.append(f"server.ctx_size = {fitting_ctx} or less")
    if any(m and m.cache_type_k in ("f32", "f16", "bf16") for m in (spec.models.target, spec.models.draft)):
        fixes.append('cache_type_k/cache_type_v = "q8_0" (half the KV memory)')
    if spec.models.draft is not None and budget.device in draft_devices(spec):
        fixes.append('models.draft.devices = ["CUDA1"] to put the draft on another GPU')
    fixes.append("a smaller quantization of the target")
    return over_error(budget, "", "llama.cpp would spill to system RAM and decode several times slower", fixes)


def over_error(budget: DeviceBudget, utilization_field: str, consequence: str, fixes: list[str]) -> Problem:
    """The over-budget error of a GPU or of host RAM: by how much, the table, what would happen, the fixes."""
    table = "; ".join(f"{line.label} {line.bytes / GIB:.2f} GiB" for line in budget.lines)
    share = f"{budget.total_bytes / GIB:.2f} GiB x {budget.utilization}" + (
        f", {utilization_field}" if utilization_field else ""
    )
    return error(
        "server.ctx_size",
        f"{budget.device} is over budget by {budget.over_bytes / GIB:.2f} GiB: needs {budget.used_bytes / GIB:.2f} GiB, "
        f"usable {budget.usable_bytes / GIB:.2f} GiB ({share}) [{table}]; {consequence}",
        "; or ".join(fixes),
    )


def lines(device_budgets: tuple[DeviceBudget, ...]) -> Iterator[str]:
    """The budget as a table, for `explain`."""
    for budget in device_budgets:
        yield f"{budget.device}: {budget.used_bytes / GIB:.2f} of {budget.usable_bytes / GIB:.2f} GiB usable ({budget.total_bytes / GIB:.2f} GiB x {budget.utilization})"
        for line in budget.lines:
            yield f"  {line.label:<62} {line.bytes / GIB:8.2f} GiB"
        yield f"  {'headroom left' if budget.over_bytes <= 0 else 'OVER BUDGET':<62} {-budget.over_bytes / GIB:8.2f} GiB"
