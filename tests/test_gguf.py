"""The GGUF header reader on the real models, on broken files, and the memory formulas built on it."""

from __future__ import annotations

import itertools
import struct
from pathlib import Path

import pytest

from appliance.facts.gguf import GGUFError, ModelInfo, Tensor, read_model
from appliance.plan.budget import budgets, gpu_weight_bytes
from appliance.plan.memory import ContextParams, context_memory
from appliance.spec.model import Spec

MIB = 1 << 20


# --- the real models ---------------------------------------------------------------------------------------


def test_smollm2_header(smollm2: Path) -> None:
    info = read_model(smollm2)
    assert info.architecture == "llama"
    assert info.file_type == "Q4_1"
    assert info.block_count == 30
    assert info.context_length == 8192
    assert info.n_vocab == 49152
    # No attention.key_length in this file: llama.cpp's default, embedding_length 576 / 9 heads.
    assert info.head_dims() == (64, 64)
    assert info.kv_heads_per_layer() == [3] * 30
    assert info.file_size == smollm2.stat().st_size == 98_362_432
    # The same number llama.cpp's llama_model_size() reports for this file.
    assert info.weight_bytes == 96_576_768
    assert 0.9 * info.file_size < info.weight_bytes <= info.file_size
    assert len(info.tensors) == 272
    # Tied embeddings: no output.weight, the output reuses token_embd.
    names = {t.name for t in info.tensors}
    assert "token_embd.weight" in names and "output.weight" not in names


def test_gemma3_header(gemma3: Path) -> None:
    info = read_model(gemma3)
    assert info.architecture == "gemma3"
    assert info.file_type == "Q4_K_M"
    assert info.block_count == 18
    assert info.context_length == 32768
    assert info.n_vocab == 262144
    # Explicit key/value lengths, not embedding_length 640 / 4 heads = 160.
    assert info.head_dims() == (256, 256)
    assert info.kv_heads_per_layer() == [1] * 18
    assert info.weight_bytes == 246_587_904
    assert 0.9 * info.file_size < info.weight_bytes <= info.file_size
    assert len(info.tensors) == 236


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_tensor_sizes_tile_the_data_section(model: str, request: pytest.FixtureRequest) -> None:
    """Each tensor's computed size, padded to the alignment, ends exactly where the next one starts.

    This checks the block-size table against the file itself: a wrong bytes-per-block for any type in use
    would open a gap or an overlap, and the last tensor must end at the end of the file.
    """
    path: Path = request.getfixturevalue(model)
    info = read_model(path)
    ordered = sorted(info.tensors, key=lambda t: t.offset)
    assert ordered[0].offset == 0
    for current, following in itertools.pairwise(ordered):
        padded = -(-current.n_bytes // 32) * 32
        assert following.offset == current.offset + padded, f"{current.name} -> {following.name}"
    last = ordered[-1]
    data_start = info.file_size - (last.offset + last.n_bytes)
    assert data_start % 32 == 0 and 0 < data_start < 8 * MIB  # the header, padded to the alignment


def test_tensor_layers(smollm2: Path) -> None:
    info = read_model(smollm2)
    layers = {t.layer for t in info.tensors}
    assert layers == {None, *range(30)}
    assert {t.name for t in info.tensors if t.layer is None} == {"token_embd.weight", "output_norm.weight"}


# --- broken files ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_bytes(smollm2: Path) -> bytes:
    return smollm2.read_bytes()


def _write(directory: Path, name: str, data: bytes) -> Path:
    path = directory / name
    path.write_bytes(data)
    return path


def test_truncated_data_section(tmp_path: Path, smollm2_bytes: bytes) -> None:
    cut = smollm2_bytes[: len(smollm2_bytes) * 6 // 10]
    path = _write(tmp_path, "cut.gguf", cut)
    with pytest.raises(GGUFError) as caught:
        read_model(path)
    message = str(caught.value)
    assert message.startswith("truncated")
    assert f"need {len(smollm2_bytes)} bytes" in message
    assert f"the file has {len(cut)}" in message


def test_one_byte_short_is_truncated(tmp_path: Path, smollm2_bytes: bytes) -> None:
    path = _write(tmp_path, "short.gguf", smollm2_bytes[:-1])
    with pytest.raises(GGUFError, match="truncated"):
        read_model(path)


def test_cut_inside_the_header(tmp_path: Path, smollm2_bytes: bytes) -> None:
    path = _write(tmp_path, "header.gguf", smollm2_bytes[:2000])
    with pytest.raises(GGUFError) as caught:
        read_model(path)
    assert str(caught.value) == "corrupt or truncated GGUF header"


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "model.safetensors", b"PK\x03\x04" + bytes(200))
    with pytest.raises(GGUFError) as caught:
        read_model(path)
    assert str(caught.value) == "not a GGUF file: starts with b'PK\\x03\\x04', expected b'GGUF'"


def test_too_short_to_be_gguf(tmp_path: Path) -> None:
    path = _write(tmp_path, "tiny.gguf", b"GGUF\x03\x00\x00\x00")
    with pytest.raises(GGUFError, match=r"^not a GGUF file: only 8 bytes$"):
        read_model(path)


def test_empty_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "empty.gguf", b"")
    with pytest.raises(GGUFError, match=r"^not a GGUF file: only 0 bytes$"):
        read_model(path)


def test_directory(tmp_path: Path) -> None:
    directory = tmp_path / "model.gguf"
    directory.mkdir()
    with pytest.raises(GGUFError, match="is a directory"):
        read_model(directory)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match=r"^no such file$"):
        read_model(tmp_path / "absent.gguf")


@pytest.mark.parametrize("version", [1, 4, 0x03000000])  # 0x03000000: a big-endian v3 file read little-endian
def test_unsupported_version(tmp_path: Path, smollm2_bytes: bytes, version: int) -> None:
    patched = smollm2_bytes[:4] + struct.pack("<I", version) + smollm2_bytes[8:]
    path = _write(tmp_path, "future.gguf", patched)
    with pytest.raises(GGUFError) as caught:
        read_model(path)
    assert str(caught.value) == f"unsupported GGUF version {version} (llama.cpp reads 2 and 3)"


def test_version_2_reads_like_version_3(tmp_path: Path, smollm2_bytes: bytes) -> None:
    patched = smollm2_bytes[:4] + struct.pack("<I", 2) + smollm2_bytes[8:]
    info = read_model(_write(tmp_path, "v2.gguf", patched))
    assert (info.architecture, info.block_count, info.weight_bytes) == ("llama", 30, 96_576_768)


def test_unknown_tensor_type(tmp_path: Path, smollm2_bytes: bytes, smollm2: Path) -> None:
    """A ggml type this reader has no block size for is named, not mis-sized."""
    info = read_model(smollm2)
    name = info.tensors[0].name.encode()
    # The tensor table entry: name, n_dims (u32), dims (u64 each), type (u32), offset (u64).
    entry = smollm2_bytes.index(struct.pack("<Q", len(name)) + name)
    n_dims = struct.unpack_from("<I", smollm2_bytes, entry + 8 + len(name))[0]
    type_at = entry + 8 + len(name) + 4 + 8 * n_dims
    patched = smollm2_bytes[:type_at] + struct.pack("<I", 999) + smollm2_bytes[type_at + 4 :]
    with pytest.raises(GGUFError, match=f"tensor {info.tensors[0].name} has ggml type 999"):
        read_model(_write(tmp_path, "newtype.gguf", patched))


# --- the KV cache formula ----------------------------------------------------------------------------------


def _model(metadata: dict[str, object], tensors: tuple[Tensor, ...] = ()) -> ModelInfo:
    return ModelInfo(Path("/models/hand-made.gguf"), 0, {"general.architecture": "llama", **metadata}, {}, tensors)


def kv_bytes_per_token(info: ModelInfo, cache_k: str, cache_v: str, layers: int | None = None) -> int:
    """Bytes per cell of the planned KV cache, over the last `layers` blocks (all by default)."""
    params = ContextParams(256, cache_k=cache_k, cache_v=cache_v, flash_attn=True)  # type: ignore[arg-type]
    first = 0 if layers is None else info.block_count - layers
    return sum(c.select(lambda il: il >= first).bytes for c in context_memory(info, params)) // 256


# llama.cpp's own worked example: 32 layers, 8 KV heads of 128 dims (Llama 3 8B).
LLAMA3_8B = {
    "llama.block_count": 32,
    "llama.embedding_length": 4096,
    "llama.attention.head_count": 32,
    "llama.attention.head_count_kv": 8,
}


@pytest.mark.parametrize(
    ("cache", "per_token"),
    [("f16", 131072), ("q8_0", 69632), ("q4_0", 36864), ("f32", 262144), ("q5_1", 49152)],
)
def test_kv_bytes_per_token(cache: str, per_token: int) -> None:
    info = _model(LLAMA3_8B)
    assert info.head_dims() == (128, 128)  # 4096 / 32, llama.cpp's default without attention.key_length
    assert kv_bytes_per_token(info, cache, cache) == per_token


def test_kv_bytes_mixed_cache_types_and_layers() -> None:
    info = _model(LLAMA3_8B)
    # K f16 (2048 B per layer) + V q8_0 (1088 B per layer).
    assert kv_bytes_per_token(info, "f16", "q8_0") == 32 * (2048 + 1088)
    assert kv_bytes_per_token(info, "f16", "f16", layers=8) == 131072 // 4
    assert kv_bytes_per_token(info, "f16", "f16", layers=0) == 0


def test_kv_bytes_explicit_head_lengths_and_per_layer_heads() -> None:
    # Key and value lengths differ (as in DeepSeek-style attention); KV heads vary by layer.
    info = _model(
        {
            "llama.block_count": 4,
            "llama.embedding_length": 1024,
            "llama.attention.head_count": 8,
            "llama.attention.head_count_kv": [0, 2, 4, 8],
            "llama.attention.key_length": 192,
            "llama.attention.value_length": 128,
        }
    )
    assert info.head_dims() == (192, 128)
    per_layer = [n * (192 + 128) * 2 for n in (0, 2, 4, 8)]
    assert kv_bytes_per_token(info, "f16", "f16") == sum(per_layer)
    # The last N layers are the offloaded ones.
    assert kv_bytes_per_token(info, "f16", "f16", layers=2) == per_layer[2] + per_layer[3]


# --- weights on the GPU, by offloaded layer count ----------------------------------------------------------

LAYER_BYTES = [110, 220, 330, 440]  # blk.0 .. blk.3
EMBD, OUTPUT_NORM, OUTPUT = 1000, 7, 5000


def _small_model(tied: bool = False) -> ModelInfo:
    tensors = [Tensor("token_embd.weight", 12, 0, EMBD, 0)]
    for layer in range(4):
        tensors += [
            Tensor(f"blk.{layer}.attn_q.weight", 12, 0, 10 * (layer + 1), 0),
            Tensor(f"blk.{layer}.ffn_down.weight", 14, 0, 100 * (layer + 1), 0),
        ]
    tensors.append(Tensor("output_norm.weight", 0, 0, OUTPUT_NORM, 0))
    if not tied:
        tensors.append(Tensor("output.weight", 14, 0, OUTPUT, 0))
    metadata = {
        "llama.block_count": 4,
        "llama.embedding_length": 256,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
    }
    return _model(metadata, tuple(tensors))


def test_tensor_layer_index() -> None:
    assert Tensor("blk.12.attn_k.weight", 0, 0, 0, 0).layer == 12
    assert Tensor("token_embd.weight", 0, 0, 0, 0).layer is None
    assert Tensor("blk.x.attn_k.weight", 0, 0, 0, 0).layer is None


# llama-model.cpp (load_tensors): i_gpu_start = n_layer + 1 - N; block il is on the GPU when il >= i_gpu_start and
# the output layer counts as layer n_layer. So N = 1 offloads only the output layer, N = n_layer leaves block 0 on
# the CPU, and N = n_layer + 1 ("all") offloads everything but the input embedding.
@pytest.mark.parametrize(
    ("layers", "expected"),
    [
        (0, 0),
        (1, OUTPUT_NORM + OUTPUT),
        (2, OUTPUT_NORM + OUTPUT + 440),
        (3, OUTPUT_NORM + OUTPUT + 440 + 330),
        (4, OUTPUT_NORM + OUTPUT + 440 + 330 + 220),
        (5, OUTPUT_NORM + OUTPUT + sum(LAYER_BYTES)),
    ],
)
def test_gpu_weight_bytes_partial_offload(layers: int, expected: int) -> None:
    assert gpu_weight_bytes(_small_model(), layers) == expected


@pytest.mark.parametrize(
    ("layers", "expected"),
    [(0, 0), (1, OUTPUT_NORM + EMBD), (3, OUTPUT_NORM + EMBD + 440 + 330), (5, OUTPUT_NORM + EMBD + sum(LAYER_BYTES))],
)
def test_gpu_weight_bytes_tied_embeddings(layers: int, expected: int) -> None:
    """Without output.weight llama.cpp duplicates token_embd into the output layer, on the GPU."""
    assert gpu_weight_bytes(_small_model(tied=True), layers) == expected


def test_gpu_weight_bytes_never_counts_the_input_embedding() -> None:
    info = _small_model()
    assert gpu_weight_bytes(info, 5) == info.weight_bytes - EMBD


@pytest.mark.parametrize(("gpu_layers", "kv_layers", "weights"), [(2, 1, 5447), (5, 4, 6107), ("all", 4, 6107)])
def test_budget_of_a_partial_offload(gpu_layers: int | str, kv_layers: int, weights: int) -> None:
    """The budget puts the offloaded blocks' weights and only their KV cache on the GPU."""
    from conftest import gpu_facts

    spec = Spec.model_validate(
        {"models": {"target": {"path": "/m/t.gguf", "devices": ["CUDA0"], "gpu_layers": gpu_layers}}}
    )
    info = _small_model()
    device_budgets, problems, per_token = budgets(spec, gpu_facts(24), info, None)
    assert problems == []
    [budget] = device_budgets
    by_label = {line.label: line.bytes for line in budget.lines}
    per_layer = 2 * 64 * 2 * 2  # 2 KV heads x 64 dims x (K + V) x f16
    assert by_label.pop("target compute buffer (estimated)") > 0  # compute.py's own tests check the figure
    assert by_label == {
        f"target weights (unknown, {kv_layers}/4 layers)": weights,
        f"target KV cache (f16/f16, {kv_layers} layer{'s' if kv_layers != 1 else ''} x 8192 cells)": kv_layers
        * per_layer
        * 8192,
        "margin (memory.compute_headroom_mib)": 256 * MIB,
    }
    assert per_token == {"CUDA0": kv_layers * per_layer}
