"""From spec, model headers and machine facts to the plan: the exact argv, the memory budget, warnings.

Pure: no file is read and no command run here; `validate.py` gathers the inputs. The argv is built in
argv.py, the GPU budgets in budget.py, the host's in host.py, the device rules in devices.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from appliance.facts.gguf import ModelInfo
from appliance.facts.machine import MachineFacts
from appliance.plan.argv import build_argv
from appliance.plan.budget import DeviceBudget, budgets, over_budget
from appliance.plan.devices import draft_devices, draft_in_use, gpu_devices, offloaded_layers
from appliance.plan.fit import largest_fits
from appliance.plan.host import HOST, host_budget
from appliance.plan.sandbox import Sandbox
from appliance.spec.base import line_breaks
from appliance.spec.model import Spec
from appliance.spec.problems import Problem, warning


@dataclass(frozen=True)
class Plan:
    spec: Spec
    argv: tuple[str, ...]
    budgets: tuple[DeviceBudget, ...]
    problems: tuple[Problem, ...]
    target: ModelInfo
    draft: ModelInfo | None
    sandbox: Sandbox = field(default_factory=Sandbox)  # what validate found the units must bind
    host: DeviceBudget | None = None  # host RAM; None when the machine's RAM is unknown

    @property
    def alias(self) -> str:
        """The model's name in the API: what /v1/models lists, every response names and clients send."""
        return served_name(self.spec, self.target)

    @property
    def draft_in_use(self) -> bool:
        """A draft model is in use: its file was read and a draft-* type drafts with it."""
        return self.draft is not None and draft_in_use(self.spec)

    @property
    def speculation(self) -> bool:
        """llama-server will speculate: a draft-* type with its draft model in use, or any n-gram type (which
        drafts from the text itself)."""
        return self.draft_in_use or bool(self.spec.speculative.ngram_types)


def served_name(spec: Spec, target: ModelInfo) -> str:
    """`server.alias`, else the target's GGUF general.name, else its file stem. Without --alias llama-server
    names the model by its path (/var/lib/llm-appliance/models/....gguf), which no IDE client shows well."""
    if spec.server.alias:
        return spec.server.alias
    name = str(target.metadata.get("general.name", "")).strip()
    # llama-server splits --alias at commas; a general.name with one (or a line break) names nothing clean.
    if name and "," not in name and not line_breaks(name):
        return name
    return target.path.stem.replace(",", "_")


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
        and offloaded_layers(spec.models.draft, draft, draft_devices(spec)) <= draft.block_count
        and spec.models.draft.gpu_layers != "auto"
    ):
        found.append(
            warning(
                "models.draft.gpu_layers",
                f"the draft is not fully offloaded ({offloaded_layers(spec.models.draft, draft, draft_devices(spec))} of {draft.block_count} layers): a draft on the CPU makes speculation slower than none (llama.cpp issue 10664: 45 -> 104 tok/s once offloaded)",
                'set gpu_layers = "all" for the draft',
            )
        )
    return found


def plan(spec: Spec, facts: MachineFacts, target: ModelInfo, draft: ModelInfo | None) -> Plan:
    binary = str(facts.binary) if facts.binary else spec.server.binary
    argv, found = build_argv(
        spec,
        facts.dialect,
        binary,
        draft is not None and draft_in_use(spec),
        served_name(spec, target),
        facts.engine.extra_args if facts.engine else (),
    )
    device_budgets, budget_problems, _ = budgets(spec, facts, target, draft)
    found += budget_problems
    found += model_problems(spec, target, draft)

    def fitting_ctx(device: str) -> int:
        # Searched only for an error's fix: each step budgets the whole plan again.
        return next((f.ctx_size for f in largest_fits(spec, facts, target, draft) if f.device == device), 0)

    found += [over_budget(spec, b, fitting_ctx(b.device)) for b in device_budgets if b.over_bytes > 0]
    host = host_budget(
        spec,
        facts,
        target,
        draft,
        prompt_cache="--cache-ram" in facts.dialect.flags,
        fitting_ctx=lambda: fitting_ctx(HOST),
    )
    found += host.problems
    if host.cache_ram_mib is not None:
        argv = (*argv, "--cache-ram", str(host.cache_ram_mib))
    return Plan(spec, argv, device_budgets, tuple(found), target, draft, host=host.budget)
