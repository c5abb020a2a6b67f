"""GGUF files shaped like the example setups' models, for planning tests.

A 27B model cannot be shipped, but planning reads only the header: these files carry a real GGUF header
(architecture, shapes, tensor table) and a sparse, zero-filled data section of the real size. Their
vocabulary is copied byte for byte from SmolLM2, so llama.cpp's own loader reads it and the target and
draft fixtures form a compatible pair.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from appliance.facts.gguf import GGML_BLOCKS, _Reader

Q4_K, Q6_K, F32 = 12, 14, 0
FILE_TYPE_Q4_K_M = 15
ALIGNMENT = 32


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    embedding: int
    feed_forward: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    file_type: int = FILE_TYPE_Q4_K_M
    arch: str = "qwen3"
    sliding_window: int = 0  # gemma3: every 6th layer global, the others keep this many cells


TARGET_27B = Shape(
    "target-27b", layers=64, embedding=5120, feed_forward=22016, heads=40, kv_heads=4, head_dim=128, context=40960
)
# google/gemma-3-27b's shape (config.json), Q4_K_M: the family people run at 27B with sliding-window layers.
GEMMA3_27B = Shape(
    "gemma3-27b",
    layers=62,
    embedding=5376,
    feed_forward=21504,
    heads=32,
    kv_heads=16,
    head_dim=128,
    context=131072,
    arch="gemma3",
    sliding_window=1024,
)
DRAFT_06B = Shape(
    "draft-0.6b", layers=28, embedding=1024, feed_forward=3072, heads=16, kv_heads=8, head_dim=128, context=40960
)


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _kv_u32(key: str, value: int) -> bytes:
    return _string(key) + struct.pack("<II", 4, value)


def _kv_f32(key: str, value: float) -> bytes:
    return _string(key) + struct.pack("<If", 6, value)


def _kv_str(key: str, value: str) -> bytes:
    return _string(key) + struct.pack("<I", 8) + _string(value)


def tokenizer_entries(vocab_source: Path) -> list[bytes]:
    """The raw `tokenizer.*` key/value entries of a real GGUF file."""
    data = memoryview(vocab_source.read_bytes())
    reader = _Reader(data)
    reader.pos = 8
    _, n_kv = reader.scalar("Q"), reader.scalar("Q")
    entries = []
    for _ in range(n_kv):
        start = reader.pos
        key = reader.string()
        kind = reader.scalar("I")
        if kind == 9:
            item_kind, count = reader.scalar("I"), reader.scalar("Q")
            reader.array(item_kind, count, keep=False)
        else:
            reader.value(kind)
        if key.startswith("tokenizer.") and key != "tokenizer.chat_template":
            entries.append(bytes(data[start : reader.pos]))
    return entries


def write_model(path: Path, shape: Shape, vocab_source: Path, n_vocab: int = 49152) -> Path:
    arch = shape.arch
    kvs = [
        _kv_str("general.architecture", arch),
        _kv_str("general.name", shape.name),
        _kv_u32("general.file_type", shape.file_type),
        _kv_u32("general.quantization_version", 2),
        _kv_u32(f"{arch}.block_count", shape.layers),
        _kv_u32(f"{arch}.context_length", shape.context),
        _kv_u32(f"{arch}.embedding_length", shape.embedding),
        _kv_u32(f"{arch}.feed_forward_length", shape.feed_forward),
        _kv_u32(f"{arch}.attention.head_count", shape.heads),
        _kv_u32(f"{arch}.attention.head_count_kv", shape.kv_heads),
        _kv_u32(f"{arch}.attention.key_length", shape.head_dim),
        _kv_u32(f"{arch}.attention.value_length", shape.head_dim),
        _kv_f32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        _kv_f32(f"{arch}.rope.freq_base", 1_000_000.0),
        *([_kv_u32(f"{arch}.attention.sliding_window", shape.sliding_window)] if shape.sliding_window else []),
        *tokenizer_entries(vocab_source),
    ]
    e, q, kv = shape.embedding, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    tensors: list[tuple[str, list[int], int]] = [("token_embd.weight", [e, n_vocab], Q4_K)]
    for layer in range(shape.layers):
        tensors += [
            (f"blk.{layer}.attn_norm.weight", [e], F32),
            (f"blk.{layer}.attn_q.weight", [e, q], Q4_K),
            (f"blk.{layer}.attn_k.weight", [e, kv], Q4_K),
            (f"blk.{layer}.attn_v.weight", [e, kv], Q6_K),
            (f"blk.{layer}.attn_output.weight", [q, e], Q4_K),
            (f"blk.{layer}.ffn_norm.weight", [e], F32),
            (f"blk.{layer}.ffn_gate.weight", [e, shape.feed_forward], Q4_K),
            (f"blk.{layer}.ffn_up.weight", [e, shape.feed_forward], Q4_K),
            (f"blk.{layer}.ffn_down.weight", [shape.feed_forward, e], Q6_K),
        ]
    tensors += [("output_norm.weight", [e], F32), ("output.weight", [e, n_vocab], Q6_K)]
    return _write(path, kvs, tensors)


def _kv_u32_array(key: str, values: list[int]) -> bytes:
    return _string(key) + struct.pack("<IIQ", 9, 4, len(values)) + b"".join(struct.pack("<I", v) for v in values)


def _write(path: Path, kvs: list[bytes], tensors: list[tuple[str, list[int], int]]) -> Path:
    infos, offset = [], 0
    for name, dims, ggml_type in tensors:
        infos.append(
            _string(name)
            + struct.pack("<I", len(dims))
            + b"".join(struct.pack("<Q", d) for d in dims)
            + struct.pack("<IQ", ggml_type, offset)
        )
        per_block, block_bytes = GGML_BLOCKS[ggml_type]
        elements = 1
        for d in dims:
            elements *= d
        offset += -(-(elements // per_block * block_bytes) // ALIGNMENT) * ALIGNMENT
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(infos)
    header += b"\0" * (-len(header) % ALIGNMENT)
    with path.open("wb") as out:
        out.write(header)
        out.truncate(len(header) + offset)  # sparse: the weights take no disk space
    return path


# Tiny random-architecture models llama-server really loads (zero f32 weights; nothing is computed with
# --no-warmup): the tensor names and shapes each arch's load_arch_tensors asks for (src/models/ARCH.cpp).
TINY_EMBD, TINY_VOCAB = 512, 49152


def _common(arch: str, layers: int, vocab_source: Path) -> list[bytes]:
    return [
        _kv_str("general.architecture", arch),
        _kv_str("general.name", f"tiny-{arch}"),
        _kv_u32("general.file_type", 0),
        _kv_u32(f"{arch}.block_count", layers),
        _kv_u32(f"{arch}.context_length", 4096),
        _kv_u32(f"{arch}.embedding_length", TINY_EMBD),
        _kv_f32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        *tokenizer_entries(vocab_source),
    ]


def write_mamba(path: Path, vocab_source: Path, layers: int = 3) -> Path:
    """models/mamba.cpp: d_inner = 2 n_embd (the only expansion it supports), per layer ssm_in, conv1d, x, dt, A, D, out."""
    e, d_inner, d_state, d_conv, dt_rank = TINY_EMBD, 2 * TINY_EMBD, 64, 4, 32
    kvs = [
        *_common("mamba", layers, vocab_source),
        _kv_u32("mamba.feed_forward_length", 0),
        _kv_u32("mamba.attention.head_count", 0),
        _kv_u32("mamba.ssm.conv_kernel", d_conv),
        _kv_u32("mamba.ssm.inner_size", d_inner),
        _kv_u32("mamba.ssm.state_size", d_state),
        _kv_u32("mamba.ssm.time_step_rank", dt_rank),
    ]
    tensors: list[tuple[str, list[int], int]] = [("token_embd.weight", [e, TINY_VOCAB], F32)]
    for i in range(layers):
        tensors += [
            (f"blk.{i}.attn_norm.weight", [e], F32),
            (f"blk.{i}.ssm_in.weight", [e, 2 * d_inner], F32),
            (f"blk.{i}.ssm_conv1d.weight", [d_conv, d_inner], F32),
            (f"blk.{i}.ssm_conv1d.bias", [d_inner], F32),
            (f"blk.{i}.ssm_x.weight", [d_inner, dt_rank + 2 * d_state], F32),
            (f"blk.{i}.ssm_dt.weight", [dt_rank, d_inner], F32),
            (f"blk.{i}.ssm_dt.bias", [d_inner], F32),
            (f"blk.{i}.ssm_a", [d_state, d_inner], F32),
            (f"blk.{i}.ssm_d", [d_inner], F32),
            (f"blk.{i}.ssm_out.weight", [d_inner, e], F32),
        ]
    tensors.append(("output_norm.weight", [e], F32))
    return _write(path, kvs, tensors)


def write_lfm2(path: Path, vocab_source: Path, kv_heads: tuple[int, ...] = (0, 0, 2, 0, 2, 0)) -> Path:
    """models/lfm2.cpp: a layer without KV heads is a short convolution (recurrent), the others attention."""
    e, heads, head_dim, ff, l_cache = TINY_EMBD, 4, TINY_EMBD // 4, 128, 3
    kvs = [
        *_common("lfm2", len(kv_heads), vocab_source),
        _kv_u32("lfm2.feed_forward_length", ff),
        _kv_u32("lfm2.attention.head_count", heads),
        _kv_u32_array("lfm2.attention.head_count_kv", list(kv_heads)),
        _kv_u32("lfm2.shortconv.l_cache", l_cache),
    ]
    tensors: list[tuple[str, list[int], int]] = [("token_embd.weight", [e, TINY_VOCAB], F32)]
    for i, n_kv in enumerate(kv_heads):
        tensors += [
            (f"blk.{i}.ffn_norm.weight", [e], F32),
            (f"blk.{i}.ffn_gate.weight", [e, ff], F32),
            (f"blk.{i}.ffn_down.weight", [ff, e], F32),
            (f"blk.{i}.ffn_up.weight", [e, ff], F32),
            (f"blk.{i}.attn_norm.weight", [e], F32),
        ]
        if n_kv:
            tensors += [
                (f"blk.{i}.attn_q_norm.weight", [head_dim], F32),
                (f"blk.{i}.attn_k_norm.weight", [head_dim], F32),
                (f"blk.{i}.attn_q.weight", [e, e], F32),
                (f"blk.{i}.attn_k.weight", [e, n_kv * head_dim], F32),
                (f"blk.{i}.attn_v.weight", [e, n_kv * head_dim], F32),
                (f"blk.{i}.attn_output.weight", [e, e], F32),
            ]
        else:
            tensors += [
                (f"blk.{i}.shortconv.conv.weight", [l_cache, e], F32),
                (f"blk.{i}.shortconv.in_proj.weight", [e, 3 * e], F32),
                (f"blk.{i}.shortconv.out_proj.weight", [e, e], F32),
            ]
    tensors.append(("token_embd_norm.weight", [e], F32))
    return _write(path, kvs, tensors)
