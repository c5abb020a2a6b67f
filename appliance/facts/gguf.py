"""Read what planning needs from a GGUF file's header: architecture, shapes, tensor sizes.

gguf-py's GGUFReader parses every tensor and takes seconds (14 s for SmolLM2 here); this reads only the
metadata and tensor table, skipping array contents it does not need, and checks the data section is whole.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# ggml_type -> (elements per block, bytes per block), from ggml/src/ggml.c's type traits.
GGML_BLOCKS: dict[int, tuple[int, int]] = {
    0: (1, 4),
    1: (1, 2),
    2: (32, 18),
    3: (32, 20),
    6: (32, 22),
    7: (32, 24),
    8: (32, 34),
    9: (32, 36),
    10: (256, 84),
    11: (256, 110),
    12: (256, 144),
    13: (256, 176),
    14: (256, 210),
    15: (256, 292),
    16: (256, 66),
    17: (256, 74),
    18: (256, 98),
    19: (256, 50),
    20: (32, 18),
    21: (256, 110),
    22: (256, 82),
    23: (256, 136),
    24: (1, 1),
    25: (1, 2),
    26: (1, 4),
    27: (1, 8),
    28: (1, 8),
    29: (256, 56),
    30: (1, 2),
    34: (256, 54),
    35: (256, 66),
    39: (32, 17),
}

# llama_ftype (general.file_type) -> the name llama.cpp's quantize uses.
FILE_TYPES: dict[int, str] = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
}

_SCALARS: dict[int, str] = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Arrays we keep whole; every other array is skipped and only its length kept.
_KEEP_ARRAYS = ("attention.head_count", "attention.head_count_kv", "attention.sliding_window_pattern")


class GGUFError(Exception):
    """The file is not a readable, whole GGUF file; the message says which."""


@dataclass(frozen=True)
class Tensor:
    name: str
    ggml_type: int
    n_elements: int
    n_bytes: int
    offset: int

    @property
    def layer(self) -> int | None:
        """The block index of a `blk.N.*` tensor, None for input/output tensors."""
        parts = self.name.split(".")
        return int(parts[1]) if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() else None


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    file_size: int
    metadata: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: tuple[Tensor, ...]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def arch_value(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    @property
    def file_type(self) -> str:
        code = self.metadata.get("general.file_type")
        return FILE_TYPES.get(code, f"type {code}") if code is not None else "unknown"

    @property
    def block_count(self) -> int:
        return int(self.arch_value("block_count", 0))

    @property
    def context_length(self) -> int:
        return int(self.arch_value("context_length", 0))

    @property
    def n_vocab(self) -> int:
        return self.array_lengths.get("tokenizer.ggml.tokens", 0)

    @property
    def weight_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    def kv_heads_per_layer(self) -> list[int]:
        heads = self.arch_value("attention.head_count", 0)
        kv = self.arch_value("attention.head_count_kv", heads)
        layers = self.block_count
        return [int(n) for n in kv] if isinstance(kv, list) else [int(kv)] * layers

    def head_dims(self) -> tuple[int, int]:
        """(key_length, value_length); llama.cpp defaults both to embedding_length / n_head(0), the first layer's
        head count (llama-model.cpp llama_model_base::load_hparams)."""
        heads = self.arch_value("attention.head_count", 1)
        first_heads = int(heads[0]) if isinstance(heads, list) and heads else int(heads or 0)
        default = int(self.arch_value("embedding_length", 0)) // max(first_heads, 1)
        return int(self.arch_value("attention.key_length", default)), int(
            self.arch_value("attention.value_length", default)
        )


def read_model(path: Path) -> ModelInfo:
    """Read a GGUF header and tensor table; raise GGUFError naming what is wrong with the file."""
    try:
        with path.open("rb") as handle:
            size = path.stat().st_size
            if size < 24:
                raise GGUFError(f"not a GGUF file: only {size} bytes")
            # The view is released before the map closes, even when _parse raises (its traceback holds it).
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data, memoryview(data) as view:
                return _parse(path, view, size)
    except FileNotFoundError:
        raise GGUFError("no such file") from None
    except IsADirectoryError:
        raise GGUFError("is a directory, not a GGUF file") from None
    except PermissionError:
        raise GGUFError("cannot be read: permission denied") from None
    except OSError as exc:  # a file in its directory path, a name too long, an I/O error
        raise GGUFError(f"cannot be read: {exc.strerror or exc}") from None
    except ValueError as exc:  # mmap of an empty file
        raise GGUFError(f"not a GGUF file: {exc}") from None


def _parse(path: Path, data: memoryview, size: int) -> ModelInfo:
    try:
        if bytes(data[:4]) != GGUF_MAGIC:
            raise GGUFError(f"not a GGUF file: starts with {bytes(data[:4])!r}, expected b'GGUF'")
        reader = _Reader(data)
        reader.pos = 4
        version = reader.scalar("I")
        if version not in (2, 3):
            raise GGUFError(f"unsupported GGUF version {version} (llama.cpp reads 2 and 3)")
        n_tensors, n_kv = reader.scalar("Q"), reader.scalar("Q")
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise GGUFError("corrupt GGUF header: implausible tensor or key count")
        metadata: dict[str, Any] = {}
        array_lengths: dict[str, int] = {}
        for _ in range(n_kv):
            key = reader.string()
            kind = reader.scalar("I")
            if kind == _ARRAY:
                item_kind, count = reader.scalar("I"), reader.scalar("Q")
                array_lengths[key] = count
                keep = key.endswith(_KEEP_ARRAYS)
                items = reader.array(item_kind, count, keep)
                if keep:
                    metadata[key] = items
            else:
                metadata[key] = reader.value(kind)
        infos = []
        for _ in range(n_tensors):
            name = reader.string()
            dims = [reader.scalar("Q") for _ in range(reader.scalar("I"))]
            ggml_type, offset = reader.scalar("I"), reader.scalar("Q")
            infos.append((name, dims, ggml_type, offset))
    except (struct.error, IndexError, UnicodeDecodeError, OverflowError):
        raise GGUFError("corrupt or truncated GGUF header") from None
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT)) or DEFAULT_ALIGNMENT
    data_start = -(-reader.pos // alignment) * alignment
    tensors = tuple(_tensor(name, dims, ggml_type, offset) for name, dims, ggml_type, offset in infos)
    data_end = data_start + max((t.offset + t.n_bytes for t in tensors), default=0)
    if data_end > size:
        raise GGUFError(
            f"truncated: its tensors need {data_end} bytes, the file has {size} (an interrupted download or copy?)"
        )
    return ModelInfo(path, size, metadata, array_lengths, tensors)


def _tensor(name: str, dims: list[int], ggml_type: int, offset: int) -> Tensor:
    n_elements = 1
    for dim in dims:
        n_elements *= dim
    if ggml_type not in GGML_BLOCKS:
        raise GGUFError(f"tensor {name} has ggml type {ggml_type}, unknown to this reader (newer llama.cpp?)")
    per_block, block_bytes = GGML_BLOCKS[ggml_type]
    return Tensor(name, ggml_type, n_elements, n_elements // per_block * block_bytes, offset)


class _Reader:
    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        if self.pos + length > len(self.data):
            raise IndexError("string past end of file")
        text = bytes(self.data[self.pos : self.pos + length]).decode("utf-8")
        self.pos += length
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        raise struct.error(f"unknown value type {kind}")

    def array(self, kind: int, count: int, keep: bool) -> list[Any]:
        if kind in _SCALARS and not keep:
            self.pos += struct.calcsize("<" + _SCALARS[kind]) * count
            if self.pos > len(self.data):
                raise IndexError("array past end of file")
            return []
        if kind == _STRING and not keep:
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", self.data, self.pos)
                self.pos += 8 + length
            if self.pos > len(self.data):
                raise IndexError("array past end of file")
            return []
        return [self.value(kind) for _ in range(count)]
