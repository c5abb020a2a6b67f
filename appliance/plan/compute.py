"""The compute buffer llama.cpp reserves per backend for one ubatch, estimated from the model's shapes. Pure.

llama_context::sched_reserve (src/llama-context.cpp) builds the worst-case graph, n_tokens = min(n_ctx,
n_ubatch) tokens in n_seq_max sequences with n_outputs = min(n_tokens, n_outputs_max) logits rows, and
ggml-alloc (ggml/src/ggml-alloc.c) sizes each backend's buffer to the peak of tensors alive at once, reusing
the memory of tensors no longer needed. Two peaks matter for a transformer:

- the body: the KQ masks (inputs, alive through every layer: n_kv x n_tokens, f16 with flash attention,
  f32 without; a second one for sliding-window layers), the attention scores n_kv x n_tokens x n_head in
  f32 without flash attention (flash attention tiles them away), and the activations of a layer per token;
- the output: logits n_outputs x n_vocab in f32 (llama-server asks for parallel x (1 + n_max) rows when it
  drafts, server_output_limits), the last hidden states, and the ubatch's residual.

The activations per token, in f32: 4 x n_ff + n_embd + n_embd_kv (the FFN's gate, up, their product and
the activation, beside the residual and a K/V row). Calibrated on llama-server's own `CPU compute buffer
size` log (tests/test_compute.py) for SmolLM2-135M (llama) and Gemma 3 270M (gemma3, SWA) across ctx,
ubatch, batch, parallel, flash attention on/off and drafting: the estimate is never below the log, and
within +25% or +10 MiB of it (the attention scores and the activations are counted as alive together,
which ggml-alloc does not quite need). Flash attention "auto" counts as on: llama.cpp enables it on CPU
and CUDA for these models (`resolve_fused_ops: Flash Attention enabled`).

GPU (CUDA), unverified here (no GPU on these machines): the same graph, on the device holding the layers.
ggml_backend_sched (ggml/src/ggml-backend.cpp) gives every backend its own gallocr, so with a layer split
each device reserves the body peak of its own layers (a layer's peak does not shrink with fewer layers),
and the device holding the output layer the output peak; with pipeline parallelism (more than one GPU,
all layers offloaded, llama-context.cpp) the scheduler keeps GGML_SCHED_MAX_COPIES = 4 copies of each
split's inputs (n_tokens x n_embd f32 each). That is why a split costs each card a whole compute buffer,
not a share of one. The CPU then holds only the input embeddings (token_embd stays on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from appliance.facts.gguf import ModelInfo
from appliance.spec.model import Spec

MIB = 1 << 20
KV_CELL_PAD = 256
F32 = 4
# ggml-backend.cpp GGML_SCHED_MAX_COPIES: input copies per split with pipeline parallelism.
SCHED_COPIES = 4
# Graph inputs besides the masks (token ids, positions, output ids) and buffer alignment: the measured
# buffers sit within this of the shapes' sum.
SLACK_BYTES = 1 * MIB


def _pad(n: int) -> int:
    return -(-n // KV_CELL_PAD) * KV_CELL_PAD


def _largest(value: Any, default: int = 0) -> int:
    """A per-layer array's largest entry (per-layer head counts, n_ff), or the scalar."""
    if isinstance(value, list):
        return int(max(value)) if value else default
    return int(value) if value is not None else default


@dataclass(frozen=True)
class Shape:
    """What the reserved graph's size depends on, for one llama context (the target's or the draft's)."""

    n_tokens: int
    n_seqs: int
    n_outputs: int
    n_kv: int  # cells one sequence's attention sees (a stream's, without a unified cache)
    flash_attn: bool


def shape(spec: Spec, outputs_per_seq: int) -> Shape:
    """llama-context.cpp: n_batch = min(n_ctx, batch), n_ubatch = min(n_batch, ubatch), n_ctx_seq =
    pad(n_ctx / n_seq, 256) (llama-server passes --parallel, so the cache is not unified)."""
    server = spec.server
    n_seqs = server.parallel
    n_ctx_seq = _pad(server.ctx_size // n_seqs)
    n_batch = min(n_ctx_seq * n_seqs, server.batch_size)
    n_tokens = min(n_batch, server.ubatch_size)
    n_tokens = -(-n_tokens // n_seqs) * n_seqs  # graph_reserve rounds to a multiple of n_seqs
    n_outputs = min(n_tokens, n_batch, n_seqs * outputs_per_seq)
    return Shape(n_tokens, n_seqs, n_outputs, n_ctx_seq, server.flash_attn != "off")


def target_outputs_per_seq(spec: Spec, drafting: bool) -> int:
    """common_speculative_get_output_limits: a drafting server verifies 1 + n_max tokens per sequence."""
    return 1 + spec.speculative.n_max if drafting else 1


@dataclass(frozen=True)
class Peaks:
    body: int  # the peak inside the layers, on every backend that holds layers
    output: int  # the peak at the output layer, on the backend that holds it
    inputs: int  # one copy of a split's input activations (n_tokens x n_embd f32)

    @property
    def whole(self) -> int:
        """One backend holding the whole graph."""
        return max(self.body, self.output) + SLACK_BYTES


def peaks(info: ModelInfo, s: Shape) -> Peaks:
    n_embd = int(info.arch_value("embedding_length", 0))
    n_ff = _largest(info.arch_value("feed_forward_length"), 4 * n_embd)
    n_head = _largest(info.arch_value("attention.head_count"), 1)
    key_length, _ = info.head_dims()
    n_embd_kv = max(info.kv_heads_per_layer(), default=0) * key_length
    mask_bytes = 2 if s.flash_attn else F32
    masks = s.n_kv * s.n_tokens * mask_bytes
    window = info.arch_value("attention.sliding_window")
    if window:
        # llama-graph.cpp builds a second mask for the sliding-window layers over their own (smaller) cache.
        masks += min(s.n_kv, _pad(int(window) + s.n_tokens)) * s.n_tokens * mask_bytes
    scores = 0 if s.flash_attn else s.n_kv * s.n_tokens * n_head * F32
    body = masks + scores + s.n_tokens * (4 * n_ff + n_embd + n_embd_kv) * F32
    output = s.n_outputs * (info.n_vocab + n_embd) * F32 + s.n_tokens * n_embd * F32
    return Peaks(body, output, s.n_tokens * n_embd * F32)


def gpu_compute_bytes(p: Peaks, device_index: int, n_devices: int) -> int:
    """The compute buffer on the device_index-th of the n_devices a model's layers are split over; the last
    holds the output layer (llama-model.cpp puts the output on the device of the last layers)."""
    body = p.body + (SCHED_COPIES * p.inputs if n_devices > 1 else 0)
    output = p.output if device_index == n_devices - 1 else 0
    return max(body, output) + SLACK_BYTES


def cpu_compute_bytes(p: Peaks, layers_on_cpu: int, output_on_cpu: bool) -> int:
    """The CPU backend's buffer: the whole graph's peaks for what runs there; only the input embeddings
    (get_rows from token_embd, which stays on the CPU) when every layer is offloaded."""
    if layers_on_cpu == 0 and not output_on_cpu:
        return p.inputs + SLACK_BYTES
    return max(p.body if layers_on_cpu else p.inputs, p.output if output_on_cpu else 0) + SLACK_BYTES
