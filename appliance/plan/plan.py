"""From spec, model headers and machine facts to the plan: the exact argv, the memory budget, warnings.

Pure: no file is read and no command run here; `validate.py` gathers the inputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from appliance.facts.dialect import REMOVED, SPELLINGS, Dialect
from appliance.facts.gguf import ModelInfo
from appliance.facts.machine import MachineFacts
from appliance.spec.model import CACHE_BYTES, CacheType, Model, Spec
from appliance.spec.problems import Problem, error, warning

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


@dataclass(frozen=True)
class Plan:
    spec: Spec
    argv: tuple[str, ...]
    budgets: tuple[DeviceBudget, ...]
    problems: tuple[Problem, ...]
    target: ModelInfo
    draft: ModelInfo | None

    @property
    def speculation(self) -> bool:
        """The server will draft: the draft model's file was read and the spec drafts with it."""
        return self.draft is not None and draft_in_use(self.spec)


def draft_in_use(spec: Spec) -> bool:
    """A draft model is configured and the speculative type is one that drafts with it."""
    return spec.models.draft is not None and spec.speculative.type.startswith("draft-")


def gpu_devices(model: Model) -> list[str]:
    return [d for d in model.devices if d != "none"] if model.gpu_layers != 0 else []


def draft_devices(spec: Spec) -> list[str]:
    # llama.cpp: the draft follows --device unless --spec-draft-device is given.
    draft = spec.models.draft
    if draft is None:
        return []
    return gpu_devices(draft) if draft.devices else gpu_devices(spec.models.target)


def offloaded_layers(model: Model, info: ModelInfo) -> int:
    """How many layers llama.cpp puts on the GPU; n_layer + 1 means the output layer too."""
    if not gpu_devices(model):
        return 0
    if model.gpu_layers in ("all", "auto"):
        return info.block_count + 1
    assert isinstance(model.gpu_layers, int)
    return min(model.gpu_layers, info.block_count + 1)


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


def kv_bytes_per_token(info: ModelInfo, cache_k: CacheType, cache_v: CacheType, layers: int | None = None) -> int:
    """Σ over layers with a KV cache of K row + V row, as llama-kv-cache.cpp allocates them."""
    key_length, value_length = info.head_dims()
    heads = info.kv_heads_per_layer()
    chosen = heads if layers is None else heads[len(heads) - layers :] if layers else []
    return int(sum(n * key_length * CACHE_BYTES[cache_k] + n * value_length * CACHE_BYTES[cache_v] for n in chosen))


def kv_cells(ctx_size: int) -> int:
    return -(-ctx_size // KV_CELL_PAD) * KV_CELL_PAD


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
    layers = offloaded_layers(model, info)
    kv_layers = max(layers - 1, 0)  # the KV cache follows its block; the output layer has none
    per_token = kv_bytes_per_token(info, model.cache_type_k, model.cache_type_v, kv_layers)
    cells = kv_cells(spec.server.ctx_size)
    usage.add(
        devices,
        f"{role} weights ({info.file_type}, {kv_layers}/{info.block_count} layers)",
        gpu_weight_bytes(info, layers),
    )
    usage.add(
        devices,
        f"{role} KV cache ({model.cache_type_k}/{model.cache_type_v}, {cells} cells)",
        per_token * cells,
        per_token,
    )
    usage.add(
        devices,
        f"{role} compute buffers (memory.compute_headroom_mib)",
        spec.memory.compute_headroom_mib * MIB * len(devices),
    )


def budgets(
    spec: Spec, facts: MachineFacts, target: ModelInfo, draft: ModelInfo | None
) -> tuple[tuple[DeviceBudget, ...], list[Problem], dict[str, float]]:
    usage = _Usage()
    _model_usage(usage, "target", spec.models.target, gpu_devices(spec.models.target), target, spec)
    if spec.models.draft is not None and draft is not None:
        _model_usage(usage, "draft", spec.models.draft, draft_devices(spec), draft, spec)
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


def over_budget(spec: Spec, budget: DeviceBudget, per_token: float) -> Problem:
    fixed = budget.used_bytes - per_token * kv_cells(spec.server.ctx_size)
    fitting_ctx = int((budget.usable_bytes - fixed) // per_token) // KV_CELL_PAD * KV_CELL_PAD if per_token else 0
    fixes = []
    if fitting_ctx >= KV_CELL_PAD:
        fixes.append(f"server.ctx_size = {fitting_ctx} or less")
    if any(m and m.cache_type_k in ("f32", "f16", "bf16") for m in (spec.models.target, spec.models.draft)):
        fixes.append('cache_type_k/cache_type_v = "q8_0" (half the KV memory)')
    if spec.models.draft is not None and budget.device in draft_devices(spec):
        fixes.append('models.draft.devices = ["CUDA1"] to put the draft on another GPU')
    fixes.append("a smaller quantization of the target")
    table = "; ".join(f"{line.label} {line.bytes / GIB:.2f} GiB" for line in budget.lines)
    return error(
        "server.ctx_size",
        f"{budget.device} is over budget by {budget.over_bytes / GIB:.2f} GiB: needs {budget.used_bytes / GIB:.2f} GiB, "
        f"usable {budget.usable_bytes / GIB:.2f} GiB ({budget.total_bytes / GIB:.2f} GiB x {budget.utilization}) [{table}]; "
        "llama.cpp would spill to system RAM and decode several times slower",
        "; or ".join(fixes),
    )


def model_problems(spec: Spec, target: ModelInfo, draft: ModelInfo | None) -> list[Problem]:
    found = []
    if target.context_length and spec.server.ctx_size > target.context_length:
        found.append(
            warning(
                "server.ctx_size",
                f"{spec.server.ctx_size} is above the target's trained context of {target.context_length} tokens: quality degrades past it",
                f"set ctx_size to at most {target.context_length}",
            )
        )
    slot_ctx = spec.server.slot_ctx
    if slot_ctx < 2048:
        found.append(
            warning(
                "server.parallel",
                f"each of {spec.server.parallel} slots gets only {slot_ctx} tokens of context (ctx_size is shared by the slots)",
                "raise ctx_size or lower parallel",
            )
        )
    if draft is None or spec.models.draft is None:
        return found
    if draft.file_type != target.file_type:
        found.append(
            warning(
                "models.draft.path",
                f"the draft is {draft.file_type} but the target is {target.file_type}: a mismatched quantization lowers acceptance (seen ~30%)",
                f"use a {target.file_type} build of the draft",
            )
        )
    if (
        gpu_devices(spec.models.target)
        and offloaded_layers(spec.models.draft, draft) <= draft.block_count
        and spec.models.draft.gpu_layers != "auto"
    ):
        found.append(
            warning(
                "models.draft.gpu_layers",
                f"the draft is not fully offloaded ({offloaded_layers(spec.models.draft, draft)} of {draft.block_count} layers): a draft on the CPU makes speculation slower than none (llama.cpp issue 10664: 45 -> 104 tok/s once offloaded)",
                'set gpu_layers = "all" for the draft',
            )
        )
    return found


class _Argv:
    def __init__(self, binary: str, dialect: Dialect) -> None:
        self.args = [binary]
        self.problems: list[Problem] = []
        self.dialect = dialect

    def flag(self, option: str, field_path: str, *values: str, required: bool = True) -> None:
        spelling = self.dialect.spelling(option)
        if spelling is not None:
            self.args.extend([spelling, *values])
        elif required:
            self.problems.append(
                error(
                    field_path,
                    f"{self.dialect.source} accepts none of {', '.join(SPELLINGS[option])}",
                    "install the llama.cpp this release builds: llm-appliance engine install",
                )
            )


def build_argv(spec: Spec, dialect: Dialect, binary: str, draft_in_use: bool) -> tuple[tuple[str, ...], list[Problem]]:
    """The llama-server command line in the binary's own dialect, grouped: serving, model, draft."""
    argv = _Argv(binary, dialect)
    _serving_flags(argv, spec)
    _model_flags(argv, spec)
    _speculative_flags(argv, spec, draft_in_use)
    problems = argv.problems + _extra_arg_problems(spec.server.extra_args, argv.args, dialect)
    return (*argv.args, *spec.server.extra_args), problems


def _serving_flags(argv: _Argv, spec: Spec) -> None:
    flag, server = argv.flag, spec.server
    flag("host", "server.host", server.host)
    flag("port", "server.port", str(server.port))
    if server.api_key_file is not None:
        flag("api_key_file", "server.api_key_file", str(server.api_key_file))
    flag("metrics", "server")
    flag("slots", "server", required=False)
    _cors_flags(argv, spec)
    flag("offline", "server", required=False)  # no model fetching at run time
    flag("fit", "memory", "off", required=False)  # the memory plan is ours, not an automatic refit


def _cors_flags(argv: _Argv, spec: Spec) -> None:
    """Which web pages a browser lets read the API: llama-server's default reflects every Origin, with
    credentials. It sends --cors-origins verbatim as Access-Control-Allow-Origin, so an empty value grants no
    one. Credentials stay off: the API key is a header a page sets itself, and no cookie is involved."""
    origins = spec.server.cors_origins
    if argv.dialect.spelling("cors_origins") is None and not origins:
        argv.problems.append(
            warning(
                "server.cors_origins",
                f"{argv.dialect.source} has no --cors-origins, so it cannot be told which web pages may read the "
                "API: llama-server's default grants every origin, so any page open in a browser on a client can",
                "install the llama.cpp this release builds (llm-appliance engine install), or set api_key_file",
            )
        )
        return
    argv.flag("cors_origins", "server.cors_origins", ",".join(origins))
    argv.flag("no_cors_credentials", "server.cors_origins", required=False)


def _model_flags(argv: _Argv, spec: Spec) -> None:
    flag, server, target = argv.flag, spec.server, spec.models.target
    flag("model", "models.target.path", str(target.path))
    flag("ctx_size", "server.ctx_size", str(server.ctx_size))
    flag("parallel", "server.parallel", str(server.parallel))
    if server.threads:
        flag("threads", "server.threads", str(server.threads))
    flag("batch_size", "server.batch_size", str(server.batch_size))
    flag("ubatch_size", "server.ubatch_size", str(server.ubatch_size))
    flag("flash_attn", "server.flash_attn", server.flash_attn)
    if argv.dialect.spelling("load_mode"):
        flag("load_mode", "server.load_mode", server.load_mode)
    elif server.load_mode in ("mlock", "mmap+mlock"):
        flag("mlock", "server.load_mode")
    elif server.load_mode == "none":
        flag("no_mmap", "server.load_mode")
    if target.devices:
        flag("device", "models.target.devices", ",".join(target.devices))
    flag("gpu_layers", "models.target.gpu_layers", str(target.gpu_layers))
    flag("cache_type_k", "models.target.cache_type_k", target.cache_type_k)
    flag("cache_type_v", "models.target.cache_type_v", target.cache_type_v)
    sampling = server.sampling
    flag("temperature", "server.sampling.temperature", f"{sampling.temperature:g}")
    flag("top_p", "server.sampling.top_p", f"{sampling.top_p:g}")
    flag("top_k", "server.sampling.top_k", str(sampling.top_k))
    flag("min_p", "server.sampling.min_p", f"{sampling.min_p:g}")
    flag("repeat_penalty", "server.sampling.repeat_penalty", f"{sampling.repeat_penalty:g}")
    if sampling.seed is not None:
        flag("seed", "server.sampling.seed", str(sampling.seed))


def _speculative_flags(argv: _Argv, spec: Spec, draft_in_use: bool) -> None:
    flag, draft, speculative = argv.flag, spec.models.draft, spec.speculative
    if draft is not None and draft_in_use:
        # Without --spec-type draft-simple current llama-server loads the draft and never drafts.
        # Binaries older than --spec-type drafted with the draft model alone.
        flag("spec_type", "speculative.type", speculative.type, required=speculative.type != "draft-simple")
        flag("draft_model", "models.draft.path", str(draft.path))
        flag("draft_n_max", "speculative.n_max", str(speculative.n_max))
        flag("draft_n_min", "speculative.n_min", str(speculative.n_min))
        flag("draft_p_min", "speculative.p_min", f"{speculative.p_min:g}")
        if draft.devices:
            flag("draft_device", "models.draft.devices", ",".join(draft.devices))
        flag("draft_gpu_layers", "models.draft.gpu_layers", str(draft.gpu_layers))
        # Binaries older than -ctkd/-ctvd (llama.cpp PR 13782, mid 2025) always gave the draft an f16 cache.
        flag(
            "draft_cache_type_k", "models.draft.cache_type_k", draft.cache_type_k, required=draft.cache_type_k != "f16"
        )
        flag(
            "draft_cache_type_v", "models.draft.cache_type_v", draft.cache_type_v, required=draft.cache_type_v != "f16"
        )
    elif draft is None and speculative.type.startswith("ngram"):
        flag("spec_type", "speculative.type", speculative.type)


def _extra_arg_problems(extra: list[str], planned: list[str], dialect: Dialect) -> list[Problem]:
    found = []
    planned_options = {SPELLING_OWNER.get(arg) for arg in planned if arg.startswith("-")} - {None}
    for index, arg in enumerate(extra):
        name = arg.split("=", 1)[0]
        if not name.startswith("-") or _is_number(name):
            continue
        where = f"server.extra_args[{index}]"
        if name in SECRET_FLAGS:
            found.append(error(where, SECRET_FLAGS[name].format(name=name), "set server.api_key_file instead"))
        elif name in REMOVED and not dialect.accepts(name):
            found.append(
                error(where, f"{name} was removed from llama-server", f"set {REMOVED[name]} in the spec instead")
            )
        elif not dialect.accepts(name):
            found.append(
                error(
                    where,
                    f"{name} is not a flag of {dialect.source}",
                    "check `llama-server --help` of the installed binary",
                )
            )
        elif SPELLING_OWNER.get(name) in planned_options:
            found.append(
                error(
                    where,
                    f"{name} is already set from the spec",
                    f"set it through the spec field for {SPELLING_OWNER[name]} instead",
                )
            )
    return found


# Flags that carry a secret, or one the appliance must know of (its scrape job and probes use the key).
SECRET_FLAGS = {
    "--api-key": "{name} puts the API key on the command line: in /proc/PID/cmdline, the journal and the snapshot",
    "--api-key-file": "{name} in extra_args hides the key file from the health daemon and the scrape job",
}


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


SPELLING_OWNER = {spelling: option for option, spellings in SPELLINGS.items() for spelling in spellings}


def plan(spec: Spec, facts: MachineFacts, target: ModelInfo, draft: ModelInfo | None) -> Plan:
    binary = str(facts.binary) if facts.binary else spec.server.binary
    argv, found = build_argv(spec, facts.dialect, binary, draft is not None and draft_in_use(spec))
    device_budgets, budget_problems, per_token = budgets(spec, facts, target, draft)
    found += budget_problems
    found += model_problems(spec, target, draft)
    found += [over_budget(spec, b, per_token[b.device]) for b in device_budgets if b.over_bytes > 0]
    return Plan(spec, argv, device_budgets, tuple(found), target, draft)


def lines(plan: Plan) -> Iterator[str]:
    """The budget as a table, for `explain`."""
    for budget in plan.budgets:
        yield f"{budget.device}: {budget.used_bytes / GIB:.2f} of {budget.usable_bytes / GIB:.2f} GiB usable ({budget.total_bytes / GIB:.2f} GiB x {budget.utilization})"
        for line in budget.lines:
            yield f"  {line.label:<62} {line.bytes / GIB:8.2f} GiB"
        yield f"  {'headroom left' if budget.over_bytes <= 0 else 'OVER BUDGET':<62} {-budget.over_bytes / GIB:8.2f} GiB"
