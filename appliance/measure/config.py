"""A server configuration: the speculative values one llama-server runs with (its types, the draft's values,
each n-gram type's own), and the one mapping between a configuration and the spec, both ways (`Config.of`
reads it from a spec, `spec_values` says which spec fields it sets, `configured` applies them); the errors
of bench and tune.

Whether a configuration is valid is the spec's to say: its values are checked by the spec model (bounds, n_min
against n_max), and whether the binary runs it by the plan (server.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel, ValidationError

from appliance.spec.checks import draft_length_problems
from appliance.spec.model import Spec
from appliance.spec.problems import Severity
from appliance.spec.speculative import Speculative


class BenchError(Exception):
    """A server would not start or answer as a benchmark needs; the message says what to do."""


class BenchUsage(BenchError):
    """An option that cannot work (exit 2)."""


# Each n-gram type's own parameters, as [speculative.<table>] names them, with llama-server's defaults
# (`--help` of the pinned build): a configuration always knows the value it runs with.
NGRAM_PARAMS: dict[str, dict[str, int]] = {
    "ngram-mod": {"n_match": 24, "n_min": 48, "n_max": 64},
    "ngram-simple": {"size_n": 12, "size_m": 48, "min_hits": 1},
    "ngram-map-k": {"size_n": 12, "size_m": 48, "min_hits": 1},
    "ngram-map-k4v": {"size_n": 12, "size_m": 48, "min_hits": 1},
}


def table_of(kind: str) -> str:
    """The [speculative] sub-table of an n-gram type: ngram-mod -> ngram_mod."""
    return kind.replace("-", "_")


def type_value(types: tuple[str, ...]) -> str | list[str]:
    """speculative.type as a spec writes it: "none", one type, or a list of them."""
    return "none" if not types else types[0] if len(types) == 1 else list(types)


def uses_draft(types: tuple[str, ...]) -> bool:
    return any(kind.startswith("draft-") for kind in types)


@dataclass(frozen=True, eq=False)
class Config:
    """One server-wide speculative setting; no types is the no-speculation baseline.

    Two configurations are the same server when they run the same types with the same values of those types:
    the draft's values are kept without a draft type (a later draft candidate starts from them) but not
    compared, so a server is never measured twice under two names."""

    types: tuple[str, ...] = ("draft-simple",)
    n_max: int = 0
    n_min: int = 0
    p_min: float = 0.0
    draft_gpu_layers: int | str | None = None  # None: as the spec says
    draft_cache_type: str | None = None
    ngram: tuple[tuple[str, int], ...] = ()  # ("ngram-mod.n_match", 16): values that differ from the engine's

    @classmethod
    def of(cls, spec: Spec, draft_gpu_layers: bool = False, draft_cache_type: bool = False) -> Config:
        """The spec's own setting; with the draft's gpu layers or cache type when those are tuned too."""
        s, draft = spec.speculative, spec.models.draft
        ngram: dict[str, int] = {}
        for kind in NGRAM_PARAMS:
            table: BaseModel | None = getattr(s, table_of(kind), None)
            for name, value in (table.model_dump() if table is not None else {}).items():
                if value is not None:
                    ngram[f"{kind}.{name}"] = int(value)
        types = s.types if draft is not None else tuple(t for t in s.types if not t.startswith("draft-"))
        return cls(
            types,
            s.n_max,
            s.n_min,
            s.p_min,
            draft.gpu_layers if draft is not None and draft_gpu_layers else None,
            draft.cache_type_k if draft is not None and draft_cache_type else None,
            tuple(sorted(ngram.items())),
        )

    @property
    def draft(self) -> bool:
        """Whether the configuration loads the draft model."""
        return uses_draft(self.types)

    def _key(self) -> tuple[object, ...]:
        draft = (self.n_max, self.n_min, self.p_min, self.draft_gpu_layers, self.draft_cache_type)
        ngram = tuple((k, v) for k, v in self.ngram if k.split(".", 1)[0] in self.types)
        return (self.types, draft if self.draft else None, ngram)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def speculates(self) -> bool:
        return bool(self.types)

    def with_types(self, types: tuple[str, ...]) -> Config:
        return replace(self, types=types)

    def ngram_value(self, key: str) -> int:
        """An n-gram parameter ("ngram-mod.n_match") as the server runs it: set, or the engine's default."""
        kind, name = key.split(".", 1)
        return dict(self.ngram).get(key, NGRAM_PARAMS[kind][name])

    def with_ngram(self, key: str, value: int) -> Config:
        values = dict(self.ngram)
        values[key] = value
        return replace(self, ngram=tuple(sorted(values.items())))

    def type_label(self) -> str:
        return "+".join(self.types) or "none"

    def label(self) -> str:
        if not self.types:
            return "none"
        parts = []
        for kind in self.types:
            if kind.startswith("draft-"):
                text = f"n_max {self.n_max}, n_min {self.n_min}, p_min {self.p_min:g}"
                if self.draft_gpu_layers is not None:
                    text += f", gpu_layers {self.draft_gpu_layers}"
                if self.draft_cache_type is not None:
                    text += f", cache {self.draft_cache_type}"
                parts.append(f"{kind} ({text})")
            elif kind in NGRAM_PARAMS:
                values = ", ".join(f"{name} {self.ngram_value(f'{kind}.{name}')}" for name in NGRAM_PARAMS[kind])
                parts.append(f"{kind} ({values})")
            else:
                parts.append(kind)
        return " + ".join(parts)

    def to_json(self) -> dict[str, Any]:
        values: dict[str, Any] = {"type": type_value(self.types)}
        if self.draft:
            values.update(n_max=self.n_max, n_min=self.n_min, p_min=self.p_min)
            if self.draft_gpu_layers is not None:
                values["draft_gpu_layers"] = self.draft_gpu_layers
            if self.draft_cache_type is not None:
                values["draft_cache_type"] = self.draft_cache_type
        values.update(_ngram_tables(self))
        return values


NO_SPECULATION = Config(types=())


def _ngram_tables(config: Config) -> dict[str, dict[str, int]]:
    """The [speculative.<table>] values of the n-gram types the configuration runs, as set (not defaults)."""
    tables: dict[str, dict[str, int]] = {}
    for key, value in config.ngram:
        kind, name = key.split(".", 1)
        if kind in config.types:
            tables.setdefault(table_of(kind), {})[name] = value
    return tables


def spec_values(config: Config) -> dict[str, dict[str, Any]]:
    """The spec fields `config` sets, by section ("speculative", "models.draft"): the one mapping from a
    configuration onto the spec, used for the servers bench starts and for `tune --write`."""
    if not config.types:
        return {"speculative": {"type": "none"}}
    speculative: dict[str, Any] = {"type": type_value(config.types)}
    if config.draft:
        speculative.update(n_max=config.n_max, n_min=config.n_min, p_min=float(config.p_min))
    speculative.update(_ngram_tables(config))
    values: dict[str, dict[str, Any]] = {"speculative": speculative}
    draft: dict[str, Any] = {}
    if config.draft_gpu_layers is not None:
        draft["gpu_layers"] = config.draft_gpu_layers
    if config.draft_cache_type is not None:
        draft["cache_type_k"] = draft["cache_type_v"] = config.draft_cache_type
    if draft and config.draft:
        values["models.draft"] = draft
    return values


def configured(spec: Spec, config: Config) -> Spec:
    """`spec` with `config`'s values, each changed section validated again by the spec model."""
    for section, values in spec_values(config).items():
        try:
            spec = _with(spec, section.split("."), values)
        except ValidationError as exc:
            problem = exc.errors()[0]
            # pydantic's loc mixes field names with its own validator tags ("constrained-int").
            where = ".".join(str(part) for part in problem["loc"] if "-" not in str(part))
            raise BenchError(f"{config.label()}: {section}.{where}: {problem['msg']}") from None
    return spec


def _with(model: BaseModel, path: list[str], values: Mapping[str, Any]) -> Any:
    if not path:
        current = model.model_dump()
        for key, value in values.items():  # a sub-table is merged, so the spec's other values stay
            current[key] = {**(current.get(key) or {}), **value} if isinstance(value, dict) else value
        return type(model).model_validate(current)
    part: BaseModel | None = getattr(model, path[0])
    if part is None:
        raise BenchError(f"the spec has no [{path[0]}] for {', '.join(values)}")
    return model.model_copy(update={path[0]: _with(part, path[1:], values)})


def valid(config: Config) -> bool:
    """Whether `config` makes a [speculative] section the spec accepts: within its bounds, n_min ≤ n_max."""
    if not config.types:
        return True
    if "ngram-mod" in config.types and config.ngram_value("ngram-mod.n_min") > config.ngram_value("ngram-mod.n_max"):
        return False
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
