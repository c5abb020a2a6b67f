"""The largest context (and number of slots) that fits each device: a search with the whole budget. Pure.

Memory is not linear in ctx_size (sliding-window layers hold only their window, recurrent state is per
sequence, compute buffers grow with the cells a ubatch attends to), so no per-token formula is inverted
here: each candidate spec is budgeted in full, by the same functions the plan uses, and a binary search
finds the largest that fits, assuming only that memory never shrinks as ctx_size or parallel grow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from appliance.facts.gguf import ModelInfo
from appliance.facts.machine import MachineFacts
from appliance.plan.budget import KV_CELL_PAD, budgets
from appliance.plan.host import host_budget
from appliance.spec.model import Spec

# Without a trained context in the GGUF header, search no further than this (1 Mi tokens).
MAX_CTX = 1 << 20
MAX_PARALLEL = 256  # as the spec allows


@dataclass(frozen=True)
class DeviceFit:
    device: str
    ctx_size: int  # the largest ctx_size (a multiple of 256, at the spec's parallel) that fits; 0: none
    parallel: int  # the largest parallel at the spec's ctx_size that fits; 0: none
    ctx_cap: int  # where the ctx search stopped: the target's trained context, or MAX_CTX


def device_fits(spec: Spec, facts: MachineFacts, target: ModelInfo, draft: ModelInfo | None) -> dict[str, bool]:
    """Whether each budgeted device (each GPU, and host RAM when known) holds the plan for `spec`.
    The host is budgeted without the prompt cache: the plan sizes it to what is left."""
    gpus, _, _ = budgets(spec, facts, target, draft)
    found = {b.device: b.over_bytes <= 0 for b in gpus}
    host = host_budget(spec, facts, target, draft, prompt_cache=False).budget
    if host is not None:
        found[host.device] = host.over_bytes <= 0
    return found


def _with(spec: Spec, **server: int) -> Spec:
    return spec.model_copy(update={"server": spec.server.model_copy(update=server)})


def _largest(fits: Callable[[int], bool], low: int, high: int) -> int:
    """The largest n in [low, high] with fits(n), for a fits that turns false once and stays false; low - 1
    when none does."""
    if not fits(low):
        return low - 1
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def ctx_cap(target: ModelInfo) -> int:
    return target.context_length // KV_CELL_PAD * KV_CELL_PAD if target.context_length >= KV_CELL_PAD else MAX_CTX


def largest_fits(spec: Spec, facts: MachineFacts, target: ModelInfo, draft: ModelInfo | None) -> list[DeviceFit]:
    """Per budgeted device, the largest ctx_size and parallel that it holds, the other devices aside."""
    cap = ctx_cap(target)
    found = []
    for device in device_fits(spec, facts, target, draft):

        def ctx_fits(steps: int, device: str = device) -> bool:
            return device_fits(_with(spec, ctx_size=steps * KV_CELL_PAD), facts, target, draft).get(device, False)

        def parallel_fits(parallel: int, device: str = device) -> bool:
            return device_fits(_with(spec, parallel=parallel), facts, target, draft).get(device, False)

        ctx = _largest(ctx_fits, 1, cap // KV_CELL_PAD) * KV_CELL_PAD
        # Each slot needs a cell block of its own: n_ctx_seq = pad(ctx / parallel, 256).
        top = max(1, min(MAX_PARALLEL, spec.server.ctx_size // KV_CELL_PAD))
        found.append(DeviceFit(device, ctx, _largest(parallel_fits, 1, top), cap))
    return found


def fit_lines(fits: list[DeviceFit], spec: Spec) -> list[str]:
    """The fits as `explain` prints them."""
    found = []
    for fit in fits:
        ctx = f"ctx_size {fit.ctx_size}" if fit.ctx_size else "no ctx_size"
        capped = " (the target's trained context)" if fit.ctx_size == fit.ctx_cap and fit.ctx_cap != MAX_CTX else ""
        slots = f"parallel {fit.parallel}" if fit.parallel else "no parallel"
        found.append(
            f"  {fit.device}: {ctx}{capped} at parallel {spec.server.parallel}; {slots} at ctx_size {spec.server.ctx_size}"
        )
    return found
