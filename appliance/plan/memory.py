"""The memory llama.cpp allocates for one model's context: its KV caches and recurrent state, layer by layer,
exactly as the pinned llama.cpp (llama-cpp-python 0.3.36's vendor/llama.cpp) sizes them. Pure.

Source, by file and function (src/ unless said):
- llama-context.cpp llama_context::llama_context: n_ctx = GGML_PAD(n_ctx, 256); unless the cache is unified,
  each of the n_seq_max sequences gets its own stream of n_ctx_seq = GGML_PAD(n_ctx / n_seq_max, 256) cells.
- llama-model.cpp llama_model::create_memory: recurrent archs get llama_memory_recurrent, hybrid ones
  llama_memory_hybrid(_iswa), SWA archs llama_kv_cache_iswa, the rest llama_kv_cache; every KV cache gets
  kv_size = n_ctx_seq and n_pad = 1 (n_ctx_seq is padded already).
- llama-kv-cache.cpp llama_kv_cache::llama_kv_cache: per layer with a KV cache, K = ggml_new_tensor_3d(type_k,
  n_embd_k_gqa(il), kv_size, n_stream), V the same with n_embd_v_gqa(il), or n_embd_v_gqa_max() when V is stored
  transposed (no flash attention); no V at all for MLA (hparams.is_mla()).
- llama-kv-cache-iswa.cpp llama_kv_cache_iswa::llama_kv_cache_iswa: the sliding-window layers keep
  GGML_PAD(min(kv_size, n_swa * (unified ? n_seq_max : 1) + n_ubatch), 256) cells per stream (kv_size with
  --swa-full); the others kv_size.
- llama-memory-recurrent.cpp llama_memory_recurrent::llama_memory_recurrent: per recurrent layer, R =
  (type_r, n_embd_r(), mem_size * (1 + n_rs_seq)) and S = (type_s, n_embd_s(), same rows), f32 both, with
  mem_size = max(1, n_seq_max); n_rs_seq is 0 for llama-server's draft-simple speculation (common.h
  need_n_rs_seq: only MTP/EAGLE3/DFlash/DSpark ask for rollback snapshots).
- llama-hparams.cpp: n_embd_k_gqa, n_embd_r, n_embd_s, set_swa_pattern; llama-model.cpp
  llama_model_base::load_hparams and load_swa_pattern, models/*.cpp load_arch_hparams for the per-arch defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from appliance.facts.gguf import ModelInfo
from appliance.spec.base import CACHE_BLOCKS, CacheType
from appliance.spec.model import Model, Spec

CELL_PAD = 256
RECURRENT_TYPE: CacheType = "f32"  # create_memory passes GGML_TYPE_F32 for R and S; no flag changes it

# llm_arch_is_recurrent / llm_arch_is_hybrid (llama-arch.cpp), the archs whose layout this module knows.
RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
# Hybrids whose recurrent layers are those without KV heads (models/{lfm2,lfm2moe,granite-hybrid,jamba,plamo2}.cpp).
HYBRID_BY_KV_HEADS = frozenset({"lfm2", "lfm2moe", "granitehybrid", "jamba", "plamo2"})
# Hybrids with a full-attention layer every N (models/qwen3next.cpp, qwen35*.cpp: is_recr = (il + 1) % N != 0).
HYBRID_BY_INTERVAL = frozenset({"qwen3next", "qwen35", "qwen35moe"})
# SWA archs that call load_swa_pattern(ml, N[, dense_first]) when the GGUF sets a sliding window; gemma2 has a
# default window of its own (models/gemma2.cpp, gemma3.cpp, cohere2.cpp, olmo2.cpp, openai-moe.cpp).
# Others with SWA (exaone4, llama4's chunks, phi3...) are counted at full context: more than they take, never less.
SWA_PATTERNS: dict[str, tuple[int, bool]] = {
    "gemma2": (2, False),
    "gemma3": (6, False),
    "cohere2": (4, False),
    "olmo2": (4, False),
    "openai-moe": (2, False),
}
DEFAULT_SWA = {"gemma2": 4096}


@dataclass(frozen=True)
class ContextParams:
    """What sizes a llama_context's memory, from llama-server's flags."""

    ctx_size: int
    parallel: int = 1
    unified: bool = False  # -kvu; llama-server sets it only when -np is left to auto
    ubatch: int = 512
    swa_full: bool = False
    flash_attn: bool = True  # off: V is stored transposed, padded to the widest layer
    cache_k: CacheType = "f16"
    cache_v: CacheType = "f16"

    @property
    def n_ctx(self) -> int:
        """The context's n_ctx: padded to 256, then to a whole number of padded sequences unless unified."""
        n_ctx = pad(max(self.ctx_size, 1), CELL_PAD)
        return n_ctx if self.unified else self.n_ctx_seq * self.parallel

    @property
    def n_ctx_seq(self) -> int:
        n_ctx = pad(max(self.ctx_size, 1), CELL_PAD)
        return n_ctx if self.unified else pad(n_ctx // self.parallel, CELL_PAD)

    @property
    def streams(self) -> int:
        return 1 if self.unified else self.parallel


UNIFIED_FLAGS = {"-kvu": True, "--kv-unified": True, "-no-kvu": False, "--no-kv-unified": False}


def context_params(spec: Spec, model: Model) -> ContextParams:
    """The context llama-server makes for `model`. The draft's has the target's n_ctx (common/speculative.cpp:
    cparams.n_ctx = llama_n_ctx(ctx_tgt)) and inherits -np, -kvu and -fa (common_base_params_to_speculative),
    with its own cache types. The plan passes --parallel, so the cache is unified only if extra_args say so
    (tools/server/server.cpp: kv_unified is turned on only for an auto -np). Flash attention "auto" is counted
    as off: V transposed is never smaller."""
    server = spec.server
    unified = False
    for arg in server.extra_args:
        unified = UNIFIED_FLAGS.get(arg.partition("=")[0], unified)
    return ContextParams(
        ctx_size=server.ctx_size,
        parallel=server.parallel,
        unified=unified,
        # llama_context::llama_context: n_batch = min(n_ctx, n_batch) (causal), n_ubatch = min(n_batch, n_ubatch)
        ubatch=min(server.ubatch_size, server.batch_size, server.ctx_size),
        swa_full="--swa-full" in server.extra_args,
        flash_attn=server.flash_attn == "on",
        cache_k=model.cache_type_k,
        cache_v=model.cache_type_v,
    )


def pad(value: int, to: int) -> int:
    return -(-value // to) * to


def row_bytes(cache_type: CacheType, elements: int) -> int:
    per_block, block_bytes = CACHE_BLOCKS[cache_type]
    return -(-elements // per_block) * block_bytes


@dataclass(frozen=True)
class Cache:
    """One buffer family llama.cpp allocates: a KV cache (K and V) or the recurrent state (R and S), with the
    bytes of each of its layers; `rows` cells (or state rows) per stream, `streams` of them."""

    kind: str  # "KV cache", "sliding-window KV cache", "recurrent state"
    rows: int
    streams: int
    types: tuple[CacheType, CacheType]
    layers: tuple[tuple[int, int, int], ...]  # (layer, bytes of the first tensor, bytes of the second)

    def select(self, keep: Callable[[int], bool]) -> Cache:
        return Cache(self.kind, self.rows, self.streams, self.types, tuple(x for x in self.layers if keep(x[0])))

    @property
    def first_bytes(self) -> int:
        return sum(first for _, first, _ in self.layers)

    @property
    def second_bytes(self) -> int:
        return sum(second for _, _, second in self.layers)

    @property
    def bytes(self) -> int:
        return self.first_bytes + self.second_bytes

    @property
    def bytes_per_row(self) -> float:
        return self.bytes / (self.rows * self.streams) if self.rows else 0.0

    def label(self) -> str:
        count = len(self.layers)
        if self.kind == "recurrent state":
            rows = f"{self.rows} sequence{'s' if self.rows != 1 else ''}"
        elif self.streams > 1:
            rows = f"{self.streams} slots x {self.rows} cells"
        else:
            rows = f"{self.rows} cells"
        return f"{self.kind} ({self.types[0]}/{self.types[1]}, {count} layer{'s' if count != 1 else ''} x {rows})"


def _int(info: ModelInfo, key: str, default: int = 0) -> int:
    value = info.arch_value(key, default)
    return int(value[0]) if isinstance(value, list) else int(value)


def _layer_count(info: ModelInfo) -> int:
    return info.block_count - _int(info, "nextn_predict_layers")  # hparams.n_layer()


def recurrent_layers(info: ModelInfo) -> list[bool]:
    n_all, n_layer = info.block_count, _layer_count(info)
    arch = info.architecture
    if arch in RECURRENT_ARCHS:
        return [True] * n_all
    if arch in HYBRID_BY_KV_HEADS:
        return [n == 0 for n in info.kv_heads_per_layer()]
    if arch in HYBRID_BY_INTERVAL:
        interval = _int(info, "full_attention_interval", 4)
        return [il < n_layer and (il + 1) % interval != 0 for il in range(n_all)]
    if arch == "falcon-h1":  # every layer holds both (models/falcon-h1.cpp; create_memory's filters)
        return [True] * n_all
    return [False] * n_all


def sliding_window(info: ModelInfo) -> int:
    return _int(info, "attention.sliding_window", DEFAULT_SWA.get(info.architecture, 0))


def swa_layers(info: ModelInfo) -> list[bool]:
    """hparams.is_swa per layer: the GGUF's per-layer pattern array, else the arch's default pattern N (every
    Nth layer global; dense_first: the first of each N), llama-hparams.cpp set_swa_pattern."""
    n_all, n_layer = info.block_count, _layer_count(info)
    arch, n_swa = info.architecture, sliding_window(info)
    if n_swa <= 0:
        return [False] * n_all
    if arch == "lfm2":  # models/lfm2.cpp: with a window, every attention layer slides
        return [not r for r in recurrent_layers(info)]
    if arch not in SWA_PATTERNS:
        return [False] * n_all
    pattern = info.arch_value("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return [bool(p) for p in pattern] + [False] * (n_all - len(pattern))
    n_pattern, dense_first = SWA_PATTERNS[arch]
    if pattern is not None:
        n_pattern = int(pattern)
    if dense_first:
        return [il < n_layer and (n_pattern == 0 or il % n_pattern != 0) for il in range(n_all)]
    return [il < n_layer and (n_pattern == 0 or il % n_pattern < n_pattern - 1) for il in range(n_all)]


def head_dims(info: ModelInfo, swa: bool) -> tuple[int, int]:
    """(n_embd_head_k, n_embd_head_v) of a layer: key/value_length, default n_embd / n_head(0); SWA layers
    may have their own (key_length_swa), llama_model_base::load_hparams."""
    key_length, value_length = info.head_dims()
    if swa:
        return _int(info, "attention.key_length_swa", key_length), _int(
            info, "attention.value_length_swa", value_length
        )
    return key_length, value_length


def is_mla(info: ModelInfo) -> bool:
    """hparams.is_mla(): the GGUF carries the uncompressed head sizes; the cache then holds only the compressed
    K (key_length = kv_lora_rank + rope dims, one KV head) and no V (llama_kv_cache: has_v = !is_mla)."""
    return _int(info, "attention.key_length_mla") != 0 and _int(info, "attention.value_length_mla") != 0


def _kv_cache(
    info: ModelInfo, params: ContextParams, kind: str, cells: int, layers: list[int], swa: list[bool]
) -> Cache:
    heads = info.kv_heads_per_layer()
    mla = is_mla(info)
    widths = [(head_dims(info, swa[il])[0] * heads[il], head_dims(info, swa[il])[1] * heads[il]) for il in layers]
    all_v = [head_dims(info, swa[il])[1] * heads[il] for il in range(info.block_count)]
    v_max = max(all_v, default=0)  # n_embd_v_gqa_max(): over every layer, whatever the filter
    rows = cells * params.streams
    found = []
    for il, (k_width, v_width) in zip(layers, widths, strict=True):
        k = row_bytes(params.cache_k, k_width) * rows
        v = 0 if mla else row_bytes(params.cache_v, v_width if params.flash_attn else v_max) * rows
        found.append((il, k, v))
    return Cache(kind, cells, params.streams, (params.cache_k, params.cache_v), tuple(found))


def _state_widths(info: ModelInfo) -> tuple[int, int]:
    """(n_embd_r(), n_embd_s()), llama-hparams.cpp."""
    n_embd = _int(info, "embedding_length")
    wkv = _int(info, "wkv.head_size")
    if wkv:
        return _int(info, "token_shift_count", 2) * n_embd, n_embd * wkv
    l_cache = _int(info, "shortconv.l_cache")
    d_conv, d_inner = _int(info, "ssm.conv_kernel"), _int(info, "ssm.inner_size")
    d_state, n_group = _int(info, "ssm.state_size"), _int(info, "ssm.group_count")
    r = n_embd * (l_cache - 1) if l_cache else max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state)
    return r, d_state * d_inner


def context_memory(info: ModelInfo, params: ContextParams) -> tuple[Cache, ...]:
    """Every cache llama.cpp allocates for a context on this model, empty ones left out."""
    n_all, n_layer = info.block_count, _layer_count(info)
    recurrent, swa = recurrent_layers(info), swa_layers(info)
    heads = info.kv_heads_per_layer()
    caches = []
    is_recurrent_arch = info.architecture in RECURRENT_ARCHS
    if not is_recurrent_arch:
        # The trunk's KV: MTP/NextN layers are never attended by it (create_memory's filter il < n_layer()).
        attention = [
            il
            for il in range(n_all)
            if il < n_layer and (not recurrent[il] or info.architecture == "falcon-h1") and heads[il] > 0
        ]
        if any(swa):
            kv_size = params.n_ctx_seq
            n_swa = sliding_window(info)
            swa_cells = (
                kv_size
                if params.swa_full
                else pad(min(kv_size, n_swa * (params.parallel if params.unified else 1) + params.ubatch), CELL_PAD)
            )
            base = [il for il in attention if not swa[il]]
            sliding = [il for il in attention if swa[il]]
            caches += [
                _kv_cache(info, params, "KV cache", kv_size, base, swa),
                _kv_cache(info, params, "sliding-window KV cache", swa_cells, sliding, swa),
            ]
        else:
            caches.append(_kv_cache(info, params, "KV cache", params.n_ctx_seq, attention, swa))
    if any(recurrent):
        r_width, s_width = _state_widths(info)
        sequences = max(1, params.parallel)
        state_layers = [il for il in range(n_layer) if recurrent[il]]
        r = row_bytes(RECURRENT_TYPE, r_width) * sequences
        s = row_bytes(RECURRENT_TYPE, s_width) * sequences
        layers = tuple((il, r, s) for il in state_layers)
        caches.append(Cache("recurrent state", sequences, 1, (RECURRENT_TYPE, RECURRENT_TYPE), layers))
    return tuple(cache for cache in caches if cache.layers)
