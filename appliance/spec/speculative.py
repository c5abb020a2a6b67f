"""[speculative] and [tuning] as written: the speculation types (one, a comma-separated list, or a TOML list,
checked against the binary's --help at planning), the draft's values, each n-gram type's own table, and what
`llm-appliance tune --write` records (the workload mix and each workload's best)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    WithJsonSchema,
    field_validator,
)

from appliance.spec.base import CacheType, GpuLayers, Line, Strict

SPEC_TYPE_NAME = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


def _joined_types(value: object) -> object:
    # A list in TOML and llama-server's own comma-separated spelling are one value: the spelling is kept.
    if isinstance(value, list) and all(isinstance(name, str) for name in value):
        return ",".join(value)
    return value


def _type_names(value: str) -> str:
    """Which names the binary lists is the dialect's to say (plan/argv.py); here only the list's shape."""
    names = [name.strip() for name in value.split(",")]
    for name in names:
        if not SPEC_TYPE_NAME.fullmatch(name):
            raise ValueError(
                f'{name!r} is not a speculation type name; write e.g. "draft-simple", "ngram-mod", '
                '["draft-simple", "ngram-mod"] or "none"'
            )
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"names {', '.join(twice)} more than once; list each type once")
    if "none" in names and len(names) > 1:
        raise ValueError('"none" turns speculation off and cannot be combined; write "none" alone')
    return ",".join(names)


# "ngram-mod", "draft-simple,ngram-mod" or ["draft-simple", "ngram-mod"]: kept as llama-server's comma-separated
# --spec-type value (the snapshot and the argv carry it as is).
SpecTypes = Annotated[
    str,
    BeforeValidator(_joined_types),
    AfterValidator(_type_names),
    # The names themselves are the binary's (its --help); the schema states their shape.
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": r"^[a-z0-9]+(-[a-z0-9]+)*(,[a-z0-9]+(-[a-z0-9]+)*)*$"},
                {"type": "array", "items": {"type": "string", "pattern": SPEC_TYPE_NAME.pattern}, "minItems": 1},
            ],
            "examples": ["draft-simple", "ngram-mod", ["draft-simple", "ngram-mod"], "none"],
        }
    ),
]
NgramCount = Annotated[int, Field(ge=1, le=1024)] | None


class NgramMod(Strict):
    """ngram-mod's own parameters (--spec-ngram-mod-*); None: the engine's default."""

    n_match: NgramCount = None  # lookup length
    n_min: NgramCount = None  # fewest tokens it drafts
    n_max: NgramCount = None  # most tokens it drafts


class NgramSizes(Strict):
    """ngram-simple's, ngram-map-k's or ngram-map-k4v's parameters (--spec-ngram-TYPE-*); None: the engine's."""

    size_n: NgramCount = None  # length of the lookup n-gram
    size_m: NgramCount = None  # length of the draft m-gram
    min_hits: NgramCount = None  # how often an n-gram must have been seen before it drafts


class Speculative(Strict):
    type: SpecTypes = "draft-simple"
    # The draft-* types' --spec-draft-n-max/-n-min/-p-min.
    n_max: Annotated[int, Field(ge=1, le=64)] = 6
    n_min: Annotated[int, Field(ge=0, le=64)] = 0
    p_min: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    ngram_mod: NgramMod | None = None
    ngram_simple: NgramSizes | None = None
    ngram_map_k: NgramSizes | None = None
    ngram_map_k4v: NgramSizes | None = None

    @property
    def types(self) -> tuple[str, ...]:
        """The types in the order written; () for "none"."""
        return () if self.type == "none" else tuple(self.type.split(","))

    @property
    def draft_types(self) -> tuple[str, ...]:
        """The types that draft with a draft model."""
        return tuple(name for name in self.types if name.startswith("draft-"))

    @property
    def ngram_types(self) -> tuple[str, ...]:
        """The types that draft from the text itself: no draft model needed."""
        return tuple(name for name in self.types if name.startswith("ngram-"))

    def ngram_tables(self) -> dict[str, NgramMod | NgramSizes]:
        """Each n-gram sub-table written, by its field ("ngram_map_k"; its type is "ngram-map-k")."""
        tables = {
            "ngram_mod": self.ngram_mod,
            "ngram_simple": self.ngram_simple,
            "ngram_map_k": self.ngram_map_k,
            "ngram_map_k4v": self.ngram_map_k4v,
        }
        return {name: table for name, table in tables.items() if table is not None}


WORKLOAD_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


def _workload_names(value: dict[str, object]) -> None:
    for name in value:
        if not WORKLOAD_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a workload name of the prompt suite; use names like code, chat, long-qa")


class TuningProfile(Strict):
    """The speculative values `llm-appliance tune` measured best for one workload, and its decode rate there:
    its type, the draft's values where it drafts, and an n-gram type's own where they differ from the engine's."""

    type: SpecTypes = "draft-simple"
    n_max: Annotated[int, Field(ge=1, le=64)] | None = None
    n_min: Annotated[int, Field(ge=0, le=64)] = 0
    p_min: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    draft_gpu_layers: GpuLayers | None = None
    draft_cache_type: CacheType | None = None
    ngram_mod: NgramMod | None = None
    ngram_simple: NgramSizes | None = None
    ngram_map_k: NgramSizes | None = None
    ngram_map_k4v: NgramSizes | None = None
    decode_tps: Annotated[float, Field(ge=0.0)] | None = None


class Tuning(Strict):
    """Written by `llm-appliance tune --write`: the workload mix [speculative] was chosen for (name -> weight)
    and each workload's own best values. llama-server applies one set of speculative values to every request."""

    workloads: dict[str, Annotated[float, Field(gt=0.0, le=1000.0)]] = {}
    profiles: dict[str, TuningProfile] = {}
    suite: Line = ""
    measured_at: Line = ""

    @field_validator("workloads", "profiles")
    @classmethod
    def _names(cls, value: dict[str, object]) -> dict[str, object]:
        _workload_names(value)
        return value
