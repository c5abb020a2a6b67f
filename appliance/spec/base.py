"""The field types every section of the spec uses: KV cache types and their sizes (the one table of them), GPU
layers, one-line strings and paths, addresses, the model name in the API, and the strict base model (unknown keys
rejected, no coercion)."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
)

from appliance.spec.address import ip_address
from appliance.system import paths

CacheType = Literal["f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "iq4_nl", "q4_1", "q4_0"]
# ggml type traits of the KV cache types (ggml/src/ggml.c): elements per block, bytes per block; a row is whole
# blocks (ggml_row_size = type_size * n / block_size: a q8_0 row of 64 = 2 blocks of 34 bytes). The memory
# budget sizes caches by it (plan/memory.py), tune walks the draft's cache types in its order (measure/search.py).
CACHE_BLOCKS: dict[CacheType, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q5_1": (32, 24),
    "q5_0": (32, 22),
    "iq4_nl": (32, 18),
    "q4_1": (32, 20),
    "q4_0": (32, 18),
}
assert tuple(CACHE_BLOCKS) == get_args(CacheType)
QUANTIZED_CACHE = frozenset(name for name, (per_block, _) in CACHE_BLOCKS.items() if per_block > 1)
GpuLayers = Annotated[int, Field(ge=0, le=1000)] | Literal["auto", "all"]
DEVICE_NAME = re.compile(r"^(none|[A-Za-z]+[0-9]+)$")
DEFAULT_BINARY = str(paths.engine_binary(paths.ENGINE_DIR))


def line_breaks(text: str) -> list[str]:
    """The characters of `text` that could end a line or hide in one: control characters and Unicode line and
    paragraph separators (a JavaScript comment in the polkit rules ends at U+2028, a unit line at \\n)."""
    return sorted({repr(c)[1:-1] for c in text if unicodedata.category(c) in ("Cc", "Zl", "Zp")})


def _one_line(value: str) -> str:
    found = line_breaks(value)
    if found:
        raise ValueError(
            f"holds {', '.join(found)}: a value that reaches a rendered unit, ruleset or YAML file must be one line "
            "of printable text"
        )
    return value


def _one_line_path(value: Path) -> Path:
    _one_line(str(value))
    return value


def _address(value: str) -> str:
    if value != "localhost" and ip_address(value) is None:
        raise ValueError(
            f"{value!r} is not an IP address; use 127.0.0.1, ::1, 0.0.0.0 or one of this machine's addresses"
        )
    return value


def _alias(value: str) -> str:
    # llama-server splits --alias at commas and strips each part; its API then names the model by the first
    # alias in sorted order, so a comma would quietly name the model something else.
    if not value.strip() or value != value.strip() or "," in value:
        raise ValueError(
            f"{value!r} cannot name the model: write one name without commas or surrounding spaces, "
            'e.g. "qwen3-27b-coder"; clients send it as their `model`'
        )
    return value


LogLevel = Literal["error", "warning", "info", "trace", "debug"]


# Free-form text that reaches a rendered file (a unit, the ruleset, YAML): one printable line, checked where it
# enters the model. TOML strings become paths; every other value must already have its TOML type (strict below).
Line = Annotated[str, AfterValidator(_one_line)]
FilePath = Annotated[Path, Field(strict=False), AfterValidator(_one_line_path)]
Address = Annotated[str, AfterValidator(_address)]
Alias = Annotated[str, AfterValidator(_one_line), AfterValidator(_alias)]


class Strict(BaseModel):
    # strict: no coercion, so `port = "8080"` or `parallel = true` is a type error, not silently 8080 or 1.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
