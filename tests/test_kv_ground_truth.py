"""The planned KV cache and recurrent state against what the real llama-server allocates and logs, cache by
cache, K and V (R and S) apart, to the log's 0.01 MiB: the real SmolLM2 (full attention) and Gemma 3 270M
(3 global + 15 sliding-window layers), and random-weight GGUFs of other architectures (tests/gguf_fixtures.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from llama_log import LoadLog, load_log

from appliance.facts.gguf import read_model
from appliance.plan.memory import Cache, ContextParams, context_memory
from appliance.spec.base import CacheType

MIB = 1 << 20
LOG_ROUNDING_MIB = 0.005 + 1e-9  # %.2f of an exact half (0.125 prints 0.12)

pytestmark = pytest.mark.engine


def planned(model: Path, params: ContextParams) -> tuple[Cache, ...]:
    return context_memory(read_model(model), params)


def assert_matches(log: LoadLog, plan: tuple[Cache, ...], params: ContextParams, n_layer: int) -> None:
    assert len(log.caches) == len(plan), (log.caches, plan)
    for logged, cache in zip(log.caches, plan, strict=True):
        assert logged.kind == ("recurrent" if cache.kind == "recurrent state" else "kv")
        # llama_memory_recurrent logs hparams.n_layer(), the layers it looked at, not those it kept.
        assert logged.layers == (n_layer if logged.kind == "recurrent" else len(cache.layers))
        assert logged.cells == cache.rows * (cache.streams if logged.kind == "recurrent" else 1)
        assert logged.seqs == params.parallel
        assert logged.types == cache.types
        assert abs(logged.first_mib - cache.first_bytes / MIB) <= LOG_ROUNDING_MIB, (logged, cache.first_bytes)
        assert abs(logged.second_mib - cache.second_bytes / MIB) <= LOG_ROUNDING_MIB, (logged, cache.second_bytes)


# (ctx, parallel, cache_k, cache_v, flash attention, extra flags)
Case = tuple[int, int, CacheType, CacheType, str, tuple[str, ...]]
SMOLLM2_CASES: list[Case] = [
    (512, 1, "f16", "f16", "off", ()),
    (4096, 1, "f16", "f16", "on", ()),
    (8192, 1, "q8_0", "q8_0", "on", ()),
    (8192, 2, "q4_0", "q4_0", "on", ()),
    (4096, 4, "f16", "f16", "off", ()),
    (1000, 3, "f16", "f16", "on", ()),  # not a multiple of 256 per slot: llama.cpp rounds n_ctx
    (8192, 4, "f16", "f16", "on", ("-kvu",)),
    (32768, 1, "q8_0", "f16", "off", ()),  # beyond the trained 8192: allowed, with a warning
]
GEMMA3_CASES: list[Case] = [
    (512, 1, "f16", "f16", "off", ()),
    (4096, 1, "f16", "f16", "on", ()),
    (8192, 1, "f16", "f16", "off", ()),
    (8192, 2, "q8_0", "q8_0", "on", ()),
    (8192, 4, "q4_0", "q4_0", "on", ()),
    (32768, 1, "q8_0", "q8_0", "on", ()),
    (32768, 4, "f16", "f16", "off", ("-kvu",)),
    (8192, 1, "f16", "f16", "on", ("--swa-full",)),
    (4096, 2, "f16", "f16", "on", ("-ub", "128", "-b", "128")),
]


def params_of(case: Case) -> ContextParams:
    ctx, parallel, cache_k, cache_v, flash_attn, extra = case
    ubatch = int(extra[extra.index("-ub") + 1]) if "-ub" in extra else 512
    return ContextParams(
        ctx_size=ctx,
        parallel=parallel,
        unified="-kvu" in extra,
        ubatch=min(ubatch, ctx),
        swa_full="--swa-full" in extra,
        flash_attn=flash_attn == "on",
        cache_k=cache_k,
        cache_v=cache_v,
    )


def run_case(engine_binary: Path, model: Path, case: Case) -> None:
    ctx, parallel, cache_k, cache_v, flash_attn, extra = case
    log = load_log(
        engine_binary,
        model,
        ctx=ctx,
        parallel=parallel,
        cache_k=cache_k,
        cache_v=cache_v,
        flash_attn=flash_attn,
        extra=extra,
    )
    params = params_of(case)
    assert_matches(log, planned(model, params), params, read_model(model).block_count)


@pytest.mark.parametrize("case", SMOLLM2_CASES, ids=str)
def test_smollm2_kv_cache_as_logged(engine_binary: Path, smollm2: Path, case: Case) -> None:
    run_case(engine_binary, smollm2, case)


@pytest.mark.parametrize("case", GEMMA3_CASES, ids=str)
def test_gemma3_global_and_sliding_window_caches_as_logged(engine_binary: Path, gemma3: Path, case: Case) -> None:
    run_case(engine_binary, gemma3, case)


def test_gemma3_8192_cells_is_39_mib_not_144(gemma3: Path) -> None:
    """The issue's own numbers: 3 global layers x 8192 cells (24 MiB) + 15 sliding-window layers x 1024 (15 MiB)."""
    caches = planned(gemma3, ContextParams(8192))
    assert [(c.kind, len(c.layers), c.rows, c.bytes // MIB) for c in caches] == [
        ("KV cache", 3, 8192, 24),
        ("sliding-window KV cache", 15, 1024, 15),
    ]


# Random-weight models of other layouts (tests/gguf_fixtures.py): recurrent (mamba: R and S per layer per
# sequence) and hybrid (lfm2: attention layers in a KV cache, short-convolution layers in the recurrent state).
TINY_CASES: list[Case] = [
    (512, 1, "f16", "f16", "off", ()),
    (4096, 4, "q8_0", "q8_0", "on", ()),
    (2048, 8, "f16", "f16", "off", ("-kvu",)),
]


@pytest.fixture(scope="session")
def tiny_models(outside_tmp: Path, smollm2: Path) -> dict[str, Path]:
    from gguf_fixtures import write_lfm2, write_mamba

    return {
        "mamba": write_mamba(outside_tmp / "tiny-mamba.gguf", smollm2),
        "lfm2": write_lfm2(outside_tmp / "tiny-lfm2.gguf", smollm2),
    }


@pytest.mark.parametrize("arch", ["mamba", "lfm2"])
@pytest.mark.parametrize("case", TINY_CASES, ids=str)
def test_recurrent_and_hybrid_memory_as_logged(
    engine_binary: Path, tiny_models: dict[str, Path], arch: str, case: Case
) -> None:
    model = tiny_models[arch]
    run_case(engine_binary, model, case)
    caches = planned(model, params_of(case))
    assert [c.kind for c in caches] == (["recurrent state"] if arch == "mamba" else ["KV cache", "recurrent state"])
    assert caches[-1].bytes > 0
