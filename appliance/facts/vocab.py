"""Draft/target vocabulary compatibility, by llama.cpp's own rule, read through llama.cpp's own loader.

On an incompatible pair llama-server logs one line, frees the draft and serves on without speculation:
nothing fails, it is just slow. So the appliance refuses such a pair before the server ever starts.
The rule is `common_speculative_are_compatible` (common/speculative.cpp): same vocab type, same add_bos /
add_eos and BOS / EOS ids, sizes within 128, and the same token texts from id 5 on.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from appliance.system.run import CommandFailed, run
from appliance.system.users import NoServiceUser, runs_as

SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128
SPEC_VOCAB_CHECK_START_TOKEN_ID = 5
READ_TIMEOUT = 120.0  # a vocabulary of 262k tokens reads in about a second
VOCAB_TYPES = {0: "none", 1: "SPM", 2: "BPE", 3: "WPM", 4: "UGM", 5: "RWKV", 6: "PLaMo-2"}


class VocabUnavailable(Exception):
    """The vocabulary could not be read (library missing, or the loader refused the file)."""


@dataclass(frozen=True)
class Vocab:
    kind: int
    add_bos: bool
    bos: int
    add_eos: bool
    eos: int
    texts: tuple[bytes, ...]

    @property
    def n_tokens(self) -> int:
        return len(self.texts)


def incompatibilities(target: Vocab, draft: Vocab) -> list[str]:
    """Why llama.cpp would refuse this draft for this target; empty when it would accept it."""
    found = []
    if target.kind != draft.kind:
        found.append(
            f"vocab types differ: target {VOCAB_TYPES.get(target.kind, target.kind)}, draft {VOCAB_TYPES.get(draft.kind, draft.kind)}"
        )
    if target.add_bos != draft.add_bos or (target.add_bos and target.bos != draft.bos):
        found.append(
            f"BOS differs: target add_bos={target.add_bos} id {target.bos}, draft add_bos={draft.add_bos} id {draft.bos}"
        )
    if target.add_eos != draft.add_eos or (target.add_eos and target.eos != draft.eos):
        found.append(
            f"EOS differs: target add_eos={target.add_eos} id {target.eos}, draft add_eos={draft.add_eos} id {draft.eos}"
        )
    difference = abs(target.n_tokens - draft.n_tokens)
    if difference > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        found.append(
            f"vocab sizes differ by {difference} (target {target.n_tokens}, draft {draft.n_tokens}; at most {SPEC_VOCAB_MAX_SIZE_DIFFERENCE})"
        )
    for token in range(SPEC_VOCAB_CHECK_START_TOKEN_ID, min(target.n_tokens, draft.n_tokens)):
        if target.texts[token] != draft.texts[token]:
            found.append(f"token {token} differs: target {target.texts[token]!r}, draft {draft.texts[token]!r}")
            break
    return found


def library_dirs(binary: Path | None) -> list[Path]:
    """Where a libllama.so of the same build as the server may be: beside the binary, or its lib/."""
    if binary is None:
        return []
    real = binary.resolve().parent
    return [d for d in (real, real.parent / "lib") if (d / "libllama.so").exists()]


def read_vocab(path: Path, binary: Path | None = None) -> Vocab:
    """The vocabulary of a GGUF model, read by llama.cpp's loader in a child process: as the service user when
    root asks (users.runs_as), since the loader parses a file anyone may have written and the library it loads
    is the engine's; root loads neither."""
    try:
        who = runs_as()
    except NoServiceUser as exc:
        raise VocabUnavailable(str(exc)) from None
    env = {}
    # One llama.cpp for the server and the bindings: point llama-cpp-python at the engine's libllama,
    # unless the user chose one (LLAMA_CPP_LIB_PATH) or the bindings carry their own.
    directories = library_dirs(binary)
    if "LLAMA_CPP_LIB_PATH" not in os.environ and directories:
        env["LLAMA_CPP_LIB_PATH"] = str(directories[0])
    # Root opens the file and the child reads it through the descriptor: the server unit reaches a model in a
    # home through a bind (BindReadOnlyPaths=), which the service user cannot by its path. Reopened through
    # /proc, the file's own mode still decides whether the service user may read it.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise VocabUnavailable(f"cannot open {path}: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise VocabUnavailable(f"{path} is not a regular file")
        argv = [sys.executable, "-m", "appliance.facts.vocab", f"/proc/self/fd/{fd}"]
        said = run(argv, env=env, who=who, quiet=True, timeout=READ_TIMEOUT, pass_fds=(fd,)).stdout
        read = json.loads(said)
        return Vocab(
            kind=int(read["kind"]),
            add_bos=bool(read["add_bos"]),
            bos=int(read["bos"]),
            add_eos=bool(read["add_eos"]),
            eos=int(read["eos"]),
            texts=tuple(bytes.fromhex(text) for text in read["texts"]),
        )
    except CommandFailed as exc:
        raise VocabUnavailable(exc.output_tail or str(exc)) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise VocabUnavailable(f"the vocabulary reader answered what it should not ({exc})") from None
    finally:
        os.close(fd)


def _llama_cpp() -> ModuleType:
    try:
        import llama_cpp
        from llama_cpp import _logger
    except (ImportError, OSError, RuntimeError) as exc:
        raise VocabUnavailable(f"llama-cpp-python cannot load llama.cpp's library ({exc})") from None
    _logger.logger.setLevel(logging.CRITICAL + 1)  # the loader's INFO lines are noise in a validation report
    return llama_cpp


def _load(path: Path) -> dict[str, object]:
    """In the child: load only the vocabulary (no weights) and read what the compatibility rule needs."""
    llama_cpp = _llama_cpp()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise VocabUnavailable("llama.cpp could not load its vocabulary")
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        count = llama_cpp.llama_vocab_n_tokens(vocab)
        get_text = llama_cpp.llama_vocab_get_text
        return {
            "kind": int(llama_cpp.llama_vocab_type(vocab)),
            "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
            "bos": int(llama_cpp.llama_vocab_bos(vocab)),
            "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
            "eos": int(llama_cpp.llama_vocab_eos(vocab)),
            "texts": [(get_text(vocab, token) or b"").hex() for token in range(count)],
        }
    finally:
        llama_cpp.llama_model_free(model)


def main(argv: list[str]) -> int:
    try:
        print(json.dumps(_load(Path(argv[0]))))
    except VocabUnavailable as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
