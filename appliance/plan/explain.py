"""The plan as data for scripts (`explain --json`): per device each budget line in bytes, the totals, the
largest context and parallel that fit, and the speculation types with their parameters. Pure."""

from __future__ import annotations

from typing import Any

from appliance.plan.budget import DeviceBudget
from appliance.plan.fit import DeviceFit
from appliance.plan.plan import Plan
from appliance.spec.problems import Problem
from appliance.spec.speculative import NgramMod, NgramSizes, Speculative

Parameters = dict[str, int | float | None]


def _device(budget: DeviceBudget, fit: DeviceFit | None) -> dict[str, Any]:
    return {
        "device": budget.device,
        "items": [{"label": line.label, "bytes": line.bytes} for line in budget.lines],
        "used_bytes": budget.used_bytes,
        "usable_bytes": budget.usable_bytes,
        "total_bytes": budget.total_bytes,
        "utilization": budget.utilization,
        "largest_ctx_size": fit.ctx_size if fit else None,
        "largest_parallel": fit.parallel if fit else None,
    }


def plan_json(plan: Plan, fits: list[DeviceFit], warnings: list[Problem]) -> dict[str, Any]:
    """The shape README documents under `explain --json`; "host RAM" is the host's device name."""
    by_device = {fit.device: fit for fit in fits}
    devices = [*plan.budgets, *([plan.host] if plan.host else [])]
    return {
        "argv": list(plan.argv),
        "alias": plan.alias,
        "ctx_size": plan.spec.server.ctx_size,
        "parallel": plan.spec.server.parallel,
        "ctx_cap": fits[0].ctx_cap if fits else None,
        "devices": [_device(budget, by_device.get(budget.device)) for budget in devices],
        "speculation": speculation_json(plan),
        "warnings": [{"severity": p.severity, "field": p.field, "message": p.message, "fix": p.fix} for p in warnings],
    }


def speculation_json(plan: Plan) -> dict[str, Any]:
    """The types as written, whether llama-server will speculate, and each type's own parameters."""
    return {
        "types": list(plan.spec.speculative.types),
        "speculates": plan.speculation,
        "draft_in_use": plan.draft_in_use,
        "parameters": type_parameters(plan.spec.speculative),
    }


def type_parameters(speculative: Speculative) -> dict[str, Parameters]:
    """Each type's own parameters, by type; None: the engine's default. A type without any has {}."""
    found: dict[str, Parameters] = {}
    for name in speculative.types:
        table = name.replace("-", "_")
        if name.startswith("draft-"):
            found[name] = {"n_max": speculative.n_max, "n_min": speculative.n_min, "p_min": speculative.p_min}
        elif table in Speculative.model_fields and table.startswith("ngram_"):
            written = getattr(speculative, table)
            empty = NgramMod() if name == "ngram-mod" else NgramSizes()
            found[name] = (written or empty).model_dump()
        else:
            found[name] = {}
    return found


def speculation_lines(plan: Plan) -> list[str]:
    """The speculation as `explain` prints it: one line for the types, one per type with parameters."""
    types = plan.spec.speculative.types
    if not types:
        return ["speculation: none"]
    state = "llama-server speculates" if plan.speculation else "llama-server does not speculate (no draft model)"
    found = [f"speculation: {', '.join(types)} ({state})"]
    for name, parameters in type_parameters(plan.spec.speculative).items():
        if name.startswith("draft-") and not plan.draft_in_use:
            continue  # its parameters reach no argv
        if parameters:
            shown = ", ".join(
                f"{key} {'engine default' if value is None else f'{value:g}'}" for key, value in parameters.items()
            )
            found.append(f"  {name}: {shown}")
    return found
