"""Which flag spellings a llama-server binary accepts, read from its own `--help`.

llama.cpp renames flags between versions (`--draft-max` became `--spec-draft-n-max` and the old name now
aborts the start), so the argv is written in the dialect of the binary that will run it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from appliance.system.run import run
from appliance.system.users import Account

_OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][A-Za-z0-9-]*)")
# "--spec-type none,draft-simple,...,ngram-cache": the accepted values stand in the options column.
_SPEC_TYPES = re.compile(r"--spec-type\s+([a-z0-9-]+(?:,[a-z0-9-]+)+)(?:\s|$)")

# One logical option -> its spellings, newest first. The first one the binary accepts is used.
SPELLINGS: dict[str, tuple[str, ...]] = {
    "model": ("--model", "-m"),
    "host": ("--host",),
    "port": ("--port",),
    "alias": ("--alias", "-a"),
    "log_verbosity": ("--log-verbosity", "--verbosity", "-lv"),
    "no_log_timestamps": ("--no-log-timestamps",),
    "api_key_file": ("--api-key-file",),
    "metrics": ("--metrics",),
    "slots": ("--slots",),
    "cors_origins": ("--cors-origins",),
    "no_cors_credentials": ("--no-cors-credentials",),
    "ctx_size": ("--ctx-size", "-c"),
    "parallel": ("--parallel", "-np"),
    "threads": ("--threads", "-t"),
    "batch_size": ("--batch-size", "-b"),
    "ubatch_size": ("--ubatch-size", "-ub"),
    "flash_attn": ("--flash-attn", "-fa"),
    "cache_type_k": ("--cache-type-k", "-ctk"),
    "cache_type_v": ("--cache-type-v", "-ctv"),
    "gpu_layers": ("--n-gpu-layers", "--gpu-layers", "-ngl"),
    "device": ("--device", "-dev"),
    "load_mode": ("--load-mode", "-lm"),
    "fit": ("--fit", "-fit"),
    "offline": ("--offline",),
    "temperature": ("--temp",),
    "top_p": ("--top-p",),
    "top_k": ("--top-k",),
    "min_p": ("--min-p",),
    "repeat_penalty": ("--repeat-penalty",),
    "seed": ("--seed", "-s"),
    "spec_type": ("--spec-type",),
    "draft_model": ("--spec-draft-model", "--model-draft", "-md"),
    "draft_n_max": ("--spec-draft-n-max", "--draft-max", "--draft-n", "--draft"),
    "draft_n_min": ("--spec-draft-n-min", "--draft-min", "--draft-n-min"),
    "draft_p_min": ("--spec-draft-p-min", "--draft-p-min"),
    "draft_gpu_layers": ("--spec-draft-ngl", "--n-gpu-layers-draft", "--gpu-layers-draft", "-ngld"),
    "draft_device": ("--spec-draft-device", "--device-draft", "-devd"),
    "draft_cache_type_k": ("--spec-draft-type-k", "--cache-type-k-draft", "-ctkd"),
    "draft_cache_type_v": ("--spec-draft-type-v", "--cache-type-v-draft", "-ctvd"),
    # Older binaries spell load modes as separate switches.
    "mlock": ("--mlock",),
    "no_mmap": ("--no-mmap",),
}

# Each n-gram type's own parameters, by the [speculative] sub-table that sets them: its flags are
# --spec-TYPE-PARAMETER (--spec-ngram-mod-n-match), the option "spec_TABLE_PARAMETER".
NGRAM_PARAMETERS: dict[str, tuple[str, ...]] = {
    "ngram_mod": ("n_match", "n_min", "n_max"),
    "ngram_simple": ("size_n", "size_m", "min_hits"),
    "ngram_map_k": ("size_n", "size_m", "min_hits"),
    "ngram_map_k4v": ("size_n", "size_m", "min_hits"),
}
SPELLINGS.update(
    {
        f"spec_{table}_{parameter}": ("--spec-" + f"{table}-{parameter}".replace("_", "-"),)
        for table, parameters in NGRAM_PARAMETERS.items()
        for parameter in parameters
    }
)

# Benchmark-only flags: they make the server accept drafts at a chosen rate, so every speed and acceptance
# measured with them is fiction.
SYNTHETIC_PREFIX = "--spec-synth-"

# Spellings current llama.cpp rejects with "the argument has been removed", and what replaced them.
REMOVED: dict[str, str] = {
    "--draft": "speculative.n_max",
    "--draft-n": "speculative.n_max",
    "--draft-max": "speculative.n_max",
    "--draft-min": "speculative.n_min",
    "--draft-n-min": "speculative.n_min",
    "--mlock": "server.load_mode",
    "--no-mmap": "server.load_mode",
    "--mmap": "server.load_mode",
}

BUILTIN_HELP = "llama-server-0c1e570.help.txt"


@dataclass(frozen=True)
class Dialect:
    flags: frozenset[str]
    source: str  # where the flags were read from, for messages
    # The values of --spec-type its --help lists; empty when it lists none (older binaries, or no such flag).
    spec_types: frozenset[str] = frozenset()

    def spelling(self, option: str) -> str | None:
        return next((flag for flag in SPELLINGS[option] if flag in self.flags), None)

    def accepts(self, flag: str) -> bool:
        return flag in self.flags


def parse_help(text: str, source: str) -> Dialect:
    """Collect every option named in the options column of `llama-server --help`."""
    flags: set[str] = set()
    spec_types: frozenset[str] = frozenset()
    for line in text.splitlines():
        if not line.startswith("-"):
            continue
        if m := _SPEC_TYPES.match(line):
            spec_types = frozenset(m.group(1).split(","))
        # "-lm,   --load-mode MODE      description": names are padded after their comma.
        names = re.sub(r",\s+", ", ", line.strip())
        column, description = ([*re.split(r"\s{2,}", names, maxsplit=1), ""])[:2]
        # Removed flags are still listed, to explain themselves; passing one aborts the start.
        if description.startswith("the argument has been removed"):
            continue
        flags.update(_OPTION.findall(column))
    return Dialect(frozenset(flags), source, spec_types)


def read_binary_dialect(binary: Path, who: Account | None, timeout: float = 20.0) -> Dialect:
    """Run `BINARY --help` as `who` (None: as this process; users.runs_as says whom); raises CommandFailed (it
    did not run) or OSError (it printed no options)."""
    # Quiet: a probe, run by every validate and render; its exit code is judged by what it printed.
    result = run([binary, "--help"], timeout=timeout, check=False, quiet=True, who=who)
    text = result.stdout + result.stderr
    dialect = parse_help(text, str(binary))
    if not dialect.flags:
        raise OSError(f"{binary} --help printed no options (exit {result.returncode})")
    return dialect


def builtin_help_text() -> str:
    """`llama-server --help` of the llama.cpp this release builds (commit 0c1e570)."""
    return resources.files("appliance.facts").joinpath("dialects", BUILTIN_HELP).read_text()


def builtin_dialect() -> Dialect:
    """The dialect of the llama.cpp this release builds, for planning before install."""
    return parse_help(builtin_help_text(), f"built-in {BUILTIN_HELP}")
