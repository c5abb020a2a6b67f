"""A server configuration: the speculative values one llama-server runs with, and the one mapping between a
configuration and the spec, both ways (`Config.of` reads it from a spec, `spec_values` says which spec
fields it sets, `configured` applies them); the errors of bench and tune.

Whether a configuration is valid is the spec's to say: its values are checked against the bounds of the
spec model's fields, and n_min against n_max by the spec's own check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from appliance.spec.checks import draft_length_problems
from appliance.spec.model import Spec, Speculative
from appliance.spec.problems import Severity


class BenchError(Exception):
    """A server would not start or answer as a benchmark needs; the message says what to do."""


class BenchUsage(BenchError):
    """An option that cannot work (exit 2)."""


@dataclass(frozen=True)
class Config:
    """One server-wide speculative setting; `draft=False` is the no-draft baseline."""

    draft: bool = True
    n_max: int = 0
    n_min: int = 0
    p_min: float = 0.0
    draft_gpu_layers: int | str | None = None  # None: as the spec says
    draft_cache_type: str | None = None

    @classmethod
    def of(cls, spec: Spec, draft_gpu_layers: bool = False, draft_cache_type: bool = False) -> Config:
        """The spec's own setting; with the draft's gpu layers or cache type when those are tuned too."""
        s, draft = spec.speculative, spec.models.draft
        return cls(
            True,
            s.n_max,
            s.n_min,
            s.p_min,
            draft.gpu_layers if draft is not None and draft_gpu_layers else None,
            draft.cache_type_k if draft is not None and draft_cache_type else None,
        )

    def label(self) -> str:
        if not self.draft:
            return "no draft"
        text = f"n_max {self.n_max}, n_min {self.n_min}, p_min {self.p_min:g}"
        if self.draft_gpu_layers is not None:
            text += f", draft gpu_layers {self.draft_gpu_layers}"
        if self.draft_cache_type is not None:
            text += f", draft cache {self.draft_cache_type}"
        return text

    def to_json(self) -> dict[str, Any]:
        if not self.draft:
            return {"draft": False}
        values: dict[str, Any] = {"draft": True, "n_max": self.n_max, "n_min": self.n_min, "p_min": self.p_min}
        if self.draft_gpu_layers is not None:
            values["draft_gpu_layers"] = self.draft_gpu_layers
        if self.draft_cache_type is not None:
            values["draft_cache_type"] = self.draft_cache_type
        return values


NO_DRAFT = Config(draft=False)


def spec_values(config: Config) -> dict[str, dict[str, Any]]:
    """The spec fields `config` sets, by section ("speculative", "models.draft"): the one mapping from a
    configuration onto the spec, used for the servers bench starts and for `tune --write`."""
    if not config.draft:
        return {"speculative": {"type": "none"}}
    values: dict[str, dict[str, Any]] = {
        "speculative": {"n_max": config.n_max, "n_min": config.n_min, "p_min": float(config.p_min)}
    }
    draft: dict[str, Any] = {}
    if config.draft_gpu_layers is not None:
        draft["gpu_layers"] = config.draft_gpu_layers
    if config.draft_cache_type is not None:
        draft["cache_type_k"] = draft["cache_type_v"] = config.draft_cache_type
    if draft:
        values["models.draft"] = draft
    return values


def configured(spec: Spec, config: Config) -> Spec:
    """`spec` with `config`'s values, each changed section validated again by the spec model."""
    for section, values in spec_values(config).items():
        try:
            spec = _with(spec, section.split("."), values)
        except ValidationError as exc:
            problem = exc.errors()[0]
            raise BenchError(f"{config.label()}: {section}.{problem['loc'][0]}: {problem['msg']}") from None
    return spec


def _with(model: BaseModel, path: list[str], values: dict[str, Any]) -> Any:
    if not path:
        return type(model).model_validate({**model.model_dump(), **values})
    part: BaseModel | None = getattr(model, path[0])
    if part is None:
        raise BenchError(f"the spec has no [{path[0]}] for {', '.join(values)}")
    return model.model_copy(update={path[0]: _with(part, path[1:], values)})


def valid(config: Config) -> bool:
    """Whether `config` makes a [speculative] section the spec accepts: within its bounds, n_min ≤ n_max."""
    if not config.draft:
        return True
    try:
        speculative = Speculative.model_validate(spec_values(config)["speculative"])
    except ValidationError:
        return False
    return not any(p.severity is Severity.ERROR for p in draft_length_problems(speculative))


def bounds(name: str) -> tuple[float, float]:
    """The lowest and highest value of a [speculative] field, from the spec model."""
    low = high = None
    for constraint in Speculative.model_fields[name].metadata:
        low = getattr(constraint, "ge", low)
        high = getattr(constraint, "le", high)
    assert low is not None and high is not None, f"speculative.{name} has no bounds"
    return low, high
