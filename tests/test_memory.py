"""plan/memory.py from headers alone: the arithmetic of layouts no small real model here has (MLA, a 27B
Gemma 3, per-slot rounding), against numbers worked by hand from the llama.cpp source."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import gpu_facts
from gguf_fixtures import GEMMA3_27B as GEMMA3_27B_SHAPE
from gguf_fixtures import write_model

from appliance.facts.gguf import ModelInfo
from appliance.plan.budget import lines
from appliance.plan.memory import ContextParams, context_memory, row_bytes, swa_layers
from appliance.plan.validate import validate
from appliance.spec.problems import SpecInvalid

MIB = 1 << 20


def header(metadata: dict[str, Any]) -> ModelInfo:
    return ModelInfo(Path("/m.gguf"), 0, metadata, {}, ())


# google/gemma-3-27b (config.json): 62 layers, hidden 5376, 32 heads, 16 KV heads, head_dim 128, window 1024,
# every 6th layer global (models/gemma3.cpp load_swa_pattern(ml, 6)).
GEMMA3_27B = header(
    {
        "general.architecture": "gemma3",
        "gemma3.block_count": 62,
        "gemma3.embedding_length": 5376,
        "gemma3.attention.head_count": 32,
        "gemma3.attention.head_count_kv": 16,
        "gemma3.attention.key_length": 128,
        "gemma3.attention.value_length": 128,
        "gemma3.attention.sliding_window": 1024,
    }
)


def test_row_bytes_are_whole_blocks() -> None:
    assert row_bytes("q8_0", 64) == 2 * 34
    assert row_bytes("q4_0", 192) == 6 * 18
    assert row_bytes("f16", 192) == 384


def test_gemma3_27b_at_32k() -> None:
    """10 global layers x 32768 cells + 52 sliding-window layers x pad(1024 + 512, 256) = 1536 cells."""
    assert sum(not s for s in swa_layers(GEMMA3_27B)) == 10
    f16 = context_memory(GEMMA3_27B, ContextParams(32768))
    assert [(c.kind, len(c.layers), c.rows, c.bytes) for c in f16] == [
        ("KV cache", 10, 32768, 10 * 32768 * 16 * 128 * 2 * 2),
        ("sliding-window KV cache", 52, 1536, 52 * 1536 * 16 * 128 * 2 * 2),
    ]
    assert sum(c.bytes for c in f16) == 3184 * MIB  # 2560 + 624 MiB; 15872 MiB if every layer kept 32768
    q8 = context_memory(GEMMA3_27B, ContextParams(32768, cache_k="q8_0", cache_v="q8_0"))
    assert sum(c.bytes for c in q8) == 3184 * MIB * 34 // 64  # 1691.5 MiB


def test_per_slot_streams_round_up_and_swa_cells_per_slot() -> None:
    params = ContextParams(1000, parallel=3)
    assert (params.n_ctx_seq, params.n_ctx, params.streams) == (512, 1536, 3)
    [base, swa] = context_memory(GEMMA3_27B, ContextParams(8192, parallel=4))
    assert (base.rows, base.streams, swa.rows, swa.streams) == (2048, 4, 1536, 4)
    [base, swa] = context_memory(GEMMA3_27B, ContextParams(8192, parallel=4, unified=True))
    assert (base.rows, base.streams, swa.rows) == (8192, 1, 4608)  # pad(1024 x 4 + 512, 256)


def test_mla_keeps_only_the_compressed_k() -> None:
    """deepseek2-style: head_count_kv 1, key_length = kv_lora_rank + rope dims, no V (llama_kv_cache: has_v = !is_mla)."""
    info = header(
        {
            "general.architecture": "deepseek2",
            "deepseek2.block_count": 4,
            "deepseek2.embedding_length": 2048,
            "deepseek2.attention.head_count": 16,
            "deepseek2.attention.head_count_kv": 1,
            "deepseek2.attention.key_length": 576,
            "deepseek2.attention.value_length": 512,
            "deepseek2.attention.key_length_mla": 192,
            "deepseek2.attention.value_length_mla": 128,
            "deepseek2.attention.kv_lora_rank": 512,
        }
    )
    [cache] = context_memory(info, ContextParams(4096))
    assert (cache.first_bytes, cache.second_bytes) == (4 * 4096 * 576 * 2, 0)


def test_nextn_layers_hold_no_trunk_kv() -> None:
    info = header(
        {
            "general.architecture": "glm4moe",
            "glm4moe.block_count": 5,
            "glm4moe.nextn_predict_layers": 1,
            "glm4moe.embedding_length": 512,
            "glm4moe.attention.head_count": 4,
        }
    )
    [cache] = context_memory(info, ContextParams(256))
    assert [il for il, _, _ in cache.layers] == [0, 1, 2, 3]


def test_a_gemma3_27b_at_32k_fits_one_24_gb_card_and_128k_does_not(
    tmp_path: Path, smollm2: Path, outside_tmp: Path
) -> None:
    """The issue's case, planned whole (weights of a Q4_K_M file of the real shape, KV, compute, margin):
    at 32K the sliding-window layers keep 1536 cells, so it fits; counting all 62 layers at full context,
    as the budget did, refused it. 128K really does not fit, and is still refused before any load."""
    # Not in /tmp, which validate refuses (the units' PrivateTmp= hides it); sparse, like the other fixtures.
    model = write_model(outside_tmp / "gemma3-27b-Q4_K_M.gguf", GEMMA3_27B_SHAPE, smollm2, n_vocab=262144)
    spec = tmp_path / "gemma.toml"

    def written(ctx: int) -> Path:
        spec.write_text(
            f'[server]\nctx_size = {ctx}\n\n[models.target]\npath = "{model}"\ndevices = ["CUDA0"]\n\n'
            '[speculative]\ntype = "none"\n\n[memory]\ndevice_total_mib = { CUDA0 = 24576 }\n'
        )
        return spec

    [budget] = validate(written(32768), facts=gpu_facts(24)).plan.budgets
    by_label = {line.label: line.bytes for line in budget.lines}
    assert by_label["target KV cache (f16/f16, 10 layers x 32768 cells)"] == 2560 * MIB
    assert by_label["target sliding-window KV cache (f16/f16, 52 layers x 1536 cells)"] == 624 * MIB
    assert budget.over_bytes < 0, list(lines((budget,)))
    print("\n".join(lines((budget,))))
    with pytest.raises(SpecInvalid) as caught:
        validate(written(131072), facts=gpu_facts(24))
    [problem] = caught.value.errors
    assert problem.field == "server.ctx_size" and "CUDA0 is over budget by" in problem.message
