"""Draft/target vocabulary compatibility: read through llama.cpp's loader, judged by its own rule."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from appliance.facts.vocab import (
    SPEC_VOCAB_CHECK_START_TOKEN_ID,
    SPEC_VOCAB_MAX_SIZE_DIFFERENCE,
    Vocab,
    VocabUnavailable,
    incompatibilities,
    read_vocab,
)

# --- with the real library ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_vocab(smollm2: Path, engine_binary: Path) -> Vocab:
    return read_vocab(smollm2, engine_binary)


@pytest.fixture(scope="module")
def gemma3_vocab(gemma3: Path, engine_binary: Path) -> Vocab:
    return read_vocab(gemma3, engine_binary)


def test_smollm2_vocab_as_llama_cpp_reads_it(smollm2_vocab: Vocab) -> None:
    vocab = smollm2_vocab
    assert (vocab.kind, vocab.add_bos, vocab.bos, vocab.add_eos, vocab.eos) == (2, False, 1, False, 2)  # BPE
    assert vocab.n_tokens == 49152
    assert vocab.texts[:3] == (b"<|endoftext|>", b"<|im_start|>", b"<|im_end|>")


def test_gemma3_vocab_as_llama_cpp_reads_it(gemma3_vocab: Vocab) -> None:
    vocab = gemma3_vocab
    assert (vocab.kind, vocab.add_bos, vocab.bos, vocab.add_eos, vocab.eos) == (1, True, 2, False, 1)  # SPM
    assert vocab.n_tokens == 262144
    assert vocab.texts[:3] == (b"<pad>", b"<eos>", b"<bos>")


def test_a_model_is_compatible_with_itself(smollm2_vocab: Vocab, smollm2: Path, engine_binary: Path) -> None:
    assert incompatibilities(smollm2_vocab, read_vocab(smollm2, engine_binary)) == []


def test_smollm2_and_gemma_are_incompatible(smollm2_vocab: Vocab, gemma3_vocab: Vocab) -> None:
    found = incompatibilities(smollm2_vocab, gemma3_vocab)
    assert found == [
        "vocab types differ: target BPE, draft SPM",
        "BOS differs: target add_bos=False id 1, draft add_bos=True id 2",
        "vocab sizes differ by 212992 (target 49152, draft 262144; at most 128)",
        "token 5 differs: target b'<file_sep>', draft b'[multimodal]'",
    ]
    # The other way round names the roles the other way round.
    reverse = incompatibilities(gemma3_vocab, smollm2_vocab)
    assert reverse[0] == "vocab types differ: target SPM, draft BPE"
    assert any("BOS" in reason for reason in reverse)


def test_27b_and_06b_fixtures_are_a_compatible_pair(fixture_models: Path, engine_binary: Path) -> None:
    target = read_vocab(fixture_models / "target-27b-Q4_K_M.gguf", engine_binary)
    draft = read_vocab(fixture_models / "draft-0.6b-Q4_K_M.gguf", engine_binary)
    assert target.n_tokens == draft.n_tokens == 49152
    assert incompatibilities(target, draft) == []


def test_unreadable_file_is_vocab_unavailable(tmp_path: Path, engine_binary: Path) -> None:
    path = tmp_path / "not-a-model.gguf"
    path.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(VocabUnavailable, match="could not load its vocabulary"):
        read_vocab(path, engine_binary)


# --- the rule, on hand-built vocabularies (common_speculative_are_compatible) ---------------------------------


def _vocab(n_tokens: int = 300, **changes: object) -> Vocab:
    texts = tuple(f"tok{i}".encode() for i in range(n_tokens))
    base = Vocab(kind=2, add_bos=True, bos=1, add_eos=False, eos=2, texts=texts)
    return replace(base, **changes)  # type: ignore[arg-type]


def _with_text(vocab: Vocab, token: int, text: bytes) -> Vocab:
    texts = list(vocab.texts)
    texts[token] = text
    return replace(vocab, texts=tuple(texts))


def test_identical_vocabs_are_compatible() -> None:
    assert incompatibilities(_vocab(), _vocab()) == []


def test_vocab_type_differs() -> None:
    assert incompatibilities(_vocab(kind=2), _vocab(kind=1)) == ["vocab types differ: target BPE, draft SPM"]
    assert incompatibilities(_vocab(kind=4), _vocab(kind=42)) == ["vocab types differ: target UGM, draft 42"]


def test_add_bos_differs() -> None:
    assert incompatibilities(_vocab(add_bos=True), _vocab(add_bos=False)) == [
        "BOS differs: target add_bos=True id 1, draft add_bos=False id 1"
    ]


def test_bos_id_differs_when_bos_is_added() -> None:
    assert incompatibilities(_vocab(add_bos=True, bos=1), _vocab(add_bos=True, bos=3)) == [
        "BOS differs: target add_bos=True id 1, draft add_bos=True id 3"
    ]


def test_bos_id_differs_but_bos_is_not_added() -> None:
    assert incompatibilities(_vocab(add_bos=False, bos=1), _vocab(add_bos=False, bos=3)) == []


def test_add_eos_differs() -> None:
    assert incompatibilities(_vocab(add_eos=False), _vocab(add_eos=True)) == [
        "EOS differs: target add_eos=False id 2, draft add_eos=True id 2"
    ]


def test_eos_id_differs_when_eos_is_added() -> None:
    assert incompatibilities(_vocab(add_eos=True, eos=2), _vocab(add_eos=True, eos=4)) == [
        "EOS differs: target add_eos=True id 2, draft add_eos=True id 4"
    ]


def test_eos_id_differs_but_eos_is_not_added() -> None:
    assert incompatibilities(_vocab(add_eos=False, eos=2), _vocab(add_eos=False, eos=4)) == []


def test_size_difference_of_exactly_128_is_allowed() -> None:
    assert SPEC_VOCAB_MAX_SIZE_DIFFERENCE == 128
    assert incompatibilities(_vocab(300), _vocab(428)) == []
    assert incompatibilities(_vocab(428), _vocab(300)) == []


def test_size_difference_of_129_is_refused() -> None:
    assert incompatibilities(_vocab(300), _vocab(429)) == [
        "vocab sizes differ by 129 (target 300, draft 429; at most 128)"
    ]
    assert incompatibilities(_vocab(429), _vocab(300)) == [
        "vocab sizes differ by 129 (target 429, draft 300; at most 128)"
    ]


def test_token_texts_below_id_5_are_not_compared() -> None:
    assert SPEC_VOCAB_CHECK_START_TOKEN_ID == 5
    draft = _vocab()
    for token in range(5):
        draft = _with_text(draft, token, b"<special>")
    assert incompatibilities(_vocab(), draft) == []


def test_token_text_differing_at_id_5_is_refused() -> None:
    assert incompatibilities(_vocab(), _with_text(_vocab(), 5, b"other")) == [
        "token 5 differs: target b'tok5', draft b'other'"
    ]


def test_only_the_first_differing_token_is_reported() -> None:
    draft = _with_text(_with_text(_vocab(), 250, b"x"), 17, b"y")
    assert incompatibilities(_vocab(), draft) == ["token 17 differs: target b'tok17', draft b'y'"]


def test_texts_are_compared_up_to_the_shorter_vocab() -> None:
    # Extra tokens past the shorter vocabulary are not compared (within the size limit).
    longer = replace(_vocab(), texts=(*_vocab().texts, *(b"extra%d" % i for i in range(100))))
    assert incompatibilities(_vocab(), longer) == []
    assert incompatibilities(_vocab(), _with_text(longer, 299, b"changed")) == [
        "token 299 differs: target b'tok299', draft b'changed'"
    ]


def test_every_reason_is_listed() -> None:
    found = incompatibilities(
        _vocab(kind=2, add_bos=True, add_eos=True),
        _with_text(_vocab(500, kind=1, add_bos=False, add_eos=False), 9, b"z"),
    )
    assert [reason.split(":")[0].split(" differ")[0] for reason in found] == [
        "vocab types",
        "BOS",
        "EOS",
        "vocab sizes",
        "token 9",
    ]
