"""The plan as data for scripts (`explain --json`): per device each budget line in bytes, the totals, and the
largest context and parallel that fit. Pure."""

from __future__ import annotations

from typing import Any

from appliance.plan.budget import DeviceBudget
from appliance.plan.fit import DeviceFit
from appliance.plan.plan import Plan
from appliance.spec.problems import Problem


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
        "warnings": [{"severity": p.severity, "field": p.field, "message": p.message, "fix": p.fix} for p in warnings],
    }
