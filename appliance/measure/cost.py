"""What a token costs, from bench's measurement: the energy and the wall time of one side's requests over the
tokens they generated (`Usage`), and with the spec's [cost] the price of a million of them (`PerMillion`):
electricity (joules per token at the price per kWh) plus depreciation (the hardware's price spread over its
working seconds, times the seconds per token).

Both are figures of the box at its measured pace, one request at a time: the energy is what the whole machine
(or the GPUs, for NVML) drew while the request ran, prompt processing included, idle draw included.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from appliance.measure.measure import WorkloadResult
from appliance.spec.fallback import Fallback
from appliance.spec.model import Cost

JOULES_PER_KWH = 3.6e6
MILLION = 1e6


@dataclass(frozen=True)
class Usage:
    """What one side's requests took together."""

    joules: float | None  # None when energy was not read for every request
    seconds: float
    tokens: int

    @classmethod
    def of(cls, results: Iterable[WorkloadResult]) -> Usage:
        samples = [s for result in results for s in result.samples]
        joules = [s.joules for s in samples]
        return cls(
            sum(j for j in joules if j is not None) if samples and None not in joules else None,
            sum(s.seconds or 0.0 for s in samples),
            sum(s.predicted_n for s in samples),
        )

    @property
    def joules_per_token(self) -> float | None:
        return self.joules / self.tokens if self.joules is not None and self.tokens else None

    @property
    def seconds_per_token(self) -> float | None:
        return self.seconds / self.tokens if self.tokens and self.seconds else None

    def to_json(self) -> dict[str, Any]:
        return {
            "joules": _round(self.joules),
            "seconds": round(self.seconds, 3),
            "tokens": self.tokens,
            "joules_per_token": _round(self.joules_per_token),
        }


@dataclass(frozen=True)
class PerMillion:
    """The price of a million generated tokens; a part is None where the spec states no price for it, or (the
    electricity) where no energy was read."""

    electricity: float | None
    depreciation: float | None

    @classmethod
    def of(cls, cost: Cost, usage: Usage) -> PerMillion:
        electricity = depreciation = None
        per_token = usage.joules_per_token
        if cost.price_per_kwh is not None and per_token is not None:
            electricity = per_token * MILLION / JOULES_PER_KWH * cost.price_per_kwh
        lifetime, seconds = cost.lifetime_seconds, usage.seconds_per_token
        if cost.hardware_price is not None and lifetime and seconds is not None:
            # The box earns its price back only over the seconds it generates: an idle box costs more per token.
            depreciation = cost.hardware_price / (lifetime * cost.utilization) * seconds * MILLION
        return cls(electricity, depreciation)

    def total(self, cost: Cost) -> float | None:
        """Both parts the spec prices; None when one of them could not be measured."""
        parts = [(cost.price_per_kwh, self.electricity), (cost.hardware_price, self.depreciation)]
        if any(price is not None and value is None for price, value in parts):
            return None
        return sum(value for _, value in parts if value is not None)

    def to_json(self, cost: Cost) -> dict[str, Any]:
        return {
            "electricity": _round(self.electricity),
            "depreciation": _round(self.depreciation),
            "total": _round(self.total(cost)),
        }


def _round(value: float | None) -> float | None:
    return round(value, 6) if value is not None else None


def energy_lines(sources: tuple[str, ...], unreadable: Mapping[str, str], usages: Mapping[str, Usage]) -> list[str]:
    """What the table says of energy: joules per token for each side, and once why a source was not read."""
    lines = []
    if sources:
        rates = ", ".join(
            f"{_figure(usage.joules_per_token, '.3g')} J/token {'with no speculation' if side == 'no speculation' else side}"
            for side, usage in usages.items()
        )
        lines.append(f"energy ({' + '.join(sources)}, over each whole request): {rates}")
    for source, why in unreadable.items():
        lines.append(f"energy ({source}) not measured: {why}")
    return lines


def fallback_prices(fallback: Fallback) -> dict[str, float | None]:
    """What the upstream of [fallback] charges per million tokens, as the spec states it (not measured)."""
    return {"input": fallback.price_per_million_input_tokens, "output": fallback.price_per_million_output_tokens}


def cost_lines(cost: Cost, usages: Mapping[str, Usage], fallback: Fallback | None = None) -> list[str]:
    """The price of a million generated tokens for each side, with what it assumes; and beside them, what the
    fallback's upstream charges, so a team sees what its answers cost."""
    currency = f" {cost.currency}" if cost.currency else ""
    assumed = []
    if cost.price_per_kwh is not None:
        assumed.append(f"electricity at {cost.price_per_kwh:g}{currency}/kWh")
    if cost.hardware_price is not None:
        lifetime = f"{cost.lifetime_years:g} years" if cost.lifetime_years else f"{cost.lifetime_hours:g} hours"
        assumed.append(f"hardware {cost.hardware_price:g}{currency} over {lifetime} at {cost.utilization:.0%} use")
    unit = f", in{currency}" if currency else ""
    lines = [f"cost per million generated tokens{unit} ({'; '.join(assumed)}):"]
    width = max(len(side) for side in usages)
    for side, usage in usages.items():
        price = PerMillion.of(cost, usage)
        parts = []
        if cost.price_per_kwh is not None:
            parts.append(
                f"{_figure(price.electricity, '.4g')} electricity"
                if price.electricity is not None
                else "electricity not measured"
            )
        if cost.hardware_price is not None:
            parts.append(f"{_figure(price.depreciation, '.4g')} depreciation")
        total = price.total(cost)
        lines.append(
            f"  {side:<{width}}  {' + '.join(parts)}"
            + (f" = {total:.4g}" if total is not None and len(parts) > 1 else "")
        )
    if fallback is not None:
        prices = fallback_prices(fallback)
        stated = ", ".join(f"{_figure(price, 'g')} per million {kind} tokens" for kind, price in prices.items())
        lines.append(f"  fallback ({fallback.model} at {fallback.base_url}, as the spec states): {stated}")
    return lines


def _figure(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-"
