"""Flag dialects: read from the real llama-server, from a recorded older one, and the argv written in each."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import gpu_facts

from appliance.facts.dialect import Dialect, builtin_dialect, parse_help, read_binary_dialect
from appliance.plan.argv import build_argv
from appliance.plan.validate import validate
from appliance.spec.load import load_spec
from appliance.spec.problems import Severity
from appliance.spec.speculative import NgramMod, NgramSizes, Speculative
from appliance.system.users import runs_as

OLDER_HELP = Path(__file__).parent / "data" / "llama-server-older.help.txt"
BINARY = "/opt/llm-appliance/engine/bin/llama-server"
ALIAS = "smollm2-demo"  # what the plan resolves (tests/test_clients.py: from the spec or the GGUF)


@pytest.fixture(scope="module")
def real_dialect(engine_binary: Path) -> Dialect:
    return read_binary_dialect(engine_binary, runs_as())


@pytest.fixture(scope="module")
def older_dialect() -> Dialect:
    return parse_help(OLDER_HELP.read_text(), "llama-server (early 2025)")


# --- the real binary ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag",
    [
        "--spec-draft-n-max",
        "--spec-type",
        "--spec-draft-model",
        "-md",
        "--load-mode",
        "--fit",
        "--offline",
        "--metrics",
    ],
)
def test_real_binary_accepts(real_dialect: Dialect, flag: str) -> None:
    assert real_dialect.accepts(flag)


# Listed in --help with "the argument has been removed", or gone from it: passing them aborts the start.
@pytest.mark.parametrize("flag", ["--draft-max", "--draft-min", "--draft", "--draft-n", "--mlock", "--no-mmap"])
def test_real_binary_refuses_removed_flags(real_dialect: Dialect, flag: str) -> None:
    assert not real_dialect.accepts(flag)


def test_removed_flags_are_listed_by_the_real_binary(engine_binary: Path) -> None:
    """The exclusion above is the parser's doing: the binary still prints --draft-max, to explain it is gone."""
    result = subprocess.run([str(engine_binary), "--help"], capture_output=True, text=True, timeout=20, check=False)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("--draft, ")]
    assert len(lines) == 1 and "--draft-max" in lines[0]
    assert "the argument has been removed" in lines[0]


def test_real_binary_matches_the_builtin_dialect(real_dialect: Dialect) -> None:
    builtin = builtin_dialect()
    assert real_dialect.flags == builtin.flags, (
        f"only in the binary: {sorted(real_dialect.flags - builtin.flags)}; "
        f"only in appliance/dialects/: {sorted(builtin.flags - real_dialect.flags)}"
    )
    assert len(builtin.flags) > 300
    assert real_dialect.spec_types == builtin.spec_types


def test_help_parser_columns() -> None:
    text = "\n".join(
        [
            "----- common params -----",
            "-lm,   --load-mode MODE                 model loading mode (default: auto)",
            "                                        - mmap: memory-map model (--not-a-flag here)",
            "--spec-draft-model, -md, --model-draft FNAME",
            "                                        draft model",
            "--draft, --draft-n, --draft-max N       the argument has been removed. use --spec-draft-n-max",
            "-fa,   --flash-attn [on|off|auto]       set Flash Attention use",
        ]
    )
    dialect = parse_help(text, "test")
    assert dialect.flags == {"-lm", "--load-mode", "--spec-draft-model", "-md", "--model-draft", "-fa", "--flash-attn"}


PINNED_TYPES = frozenset(
    {
        "none",
        "draft-simple",
        "draft-eagle3",
        "draft-mtp",
        "draft-dflash",
        "draft-dspark",
        "ngram-simple",
        "ngram-map-k",
        "ngram-map-k4v",
        "ngram-mod",
        "ngram-cache",
    }
)


def test_builtin_dialect_lists_the_speculation_types() -> None:
    assert builtin_dialect().spec_types == PINNED_TYPES


def test_help_parser_reads_the_spec_type_values() -> None:
    text = "--spec-type none,draft-simple,ngram-mod\n                    comma-separated list of types\n"
    assert parse_help(text, "test").spec_types == {"none", "draft-simple", "ngram-mod"}
    # A value placeholder is no list of values: the types are then judged by the flag alone.
    assert parse_help("--spec-type TYPE      the type\n", "test").spec_types == frozenset()


def test_every_ngram_parameter_has_its_flag_in_the_pinned_build() -> None:
    tables = {"ngram_mod": NgramMod, "ngram_simple": NgramSizes, "ngram_map_k": NgramSizes, "ngram_map_k4v": NgramSizes}
    assert set(tables) == {name for name in Speculative.model_fields if name.startswith("ngram_")}
    for table, model in tables.items():
        for parameter in model.model_fields:
            assert builtin_dialect().spelling(f"spec_{table}_{parameter}") is not None, (table, parameter)


# --- speculation types and their parameters, rendered --------------------------------------------------------

NGRAM_MOD = "[speculative.ngram_mod]\nn_match = 16\nn_min = 8\nn_max = 32\n"


def test_a_list_of_types_is_one_spec_type_value(example: Callable[..., Path]) -> None:
    result = validate(
        example("demo-draft.toml", {'type = "draft-simple"': 'type = ["draft-simple", "ngram-mod"]'}), facts=gpu_facts()
    )
    assert result.plan.spec.speculative.types == ("draft-simple", "ngram-mod")
    argv = list(result.plan.argv)
    assert _value(argv, "--spec-type") == "draft-simple,ngram-mod"
    assert _value(argv, "--spec-draft-n-max") == "8"  # the draft's own, still
    assert (result.plan.draft_in_use, result.plan.speculation) == (True, True)
    written = example("demo-draft.toml", {'type = "draft-simple"': 'type = "draft-simple,ngram-mod"'})
    assert load_spec(written).spec.speculative == result.plan.spec.speculative


def test_ngram_mod_parameters_are_rendered(example: Callable[..., Path]) -> None:
    replace = {'type = "draft-simple"': 'type = ["draft-simple", "ngram-mod"]', "[network]": f"{NGRAM_MOD}\n[network]"}
    argv = list(validate(example("demo-draft.toml", replace), facts=gpu_facts()).plan.argv)
    assert _value(argv, "--spec-ngram-mod-n-match") == "16"
    assert _value(argv, "--spec-ngram-mod-n-min") == "8"
    assert _value(argv, "--spec-ngram-mod-n-max") == "32"
    assert not any(arg.startswith("--spec-ngram-simple") for arg in argv)


def test_unset_ngram_parameters_are_the_engines(example: Callable[..., Path]) -> None:
    replace = {
        'type = "draft-simple"': 'type = ["draft-simple", "ngram-map-k"]',
        "[network]": "[speculative.ngram_map_k]\nmin_hits = 2\n\n[network]",
    }
    argv = list(validate(example("demo-draft.toml", replace), facts=gpu_facts()).plan.argv)
    assert _value(argv, "--spec-ngram-map-k-min-hits") == "2"
    assert "--spec-ngram-map-k-size-n" not in argv and "--spec-ngram-map-k-size-m" not in argv


def _without_draft(text: str) -> str:
    start = text.index("[models.draft]")
    return text[:start] + text[text.index("[speculative]") :]


def test_ngram_types_need_no_draft_model(example: Callable[..., Path]) -> None:
    spec = example(
        "demo-draft.toml", {'type = "draft-simple"': 'type = "ngram-mod"', "[network]": f"{NGRAM_MOD}\n[network]"}
    )
    spec.write_text(_without_draft(spec.read_text()))
    result = validate(spec, facts=gpu_facts())
    assert result.warnings == []
    argv = list(result.plan.argv)
    assert _value(argv, "--spec-type") == "ngram-mod"
    assert _value(argv, "--spec-ngram-mod-n-match") == "16"
    assert not any(arg.startswith("--spec-draft-") for arg in argv)
    assert (result.plan.draft_in_use, result.plan.speculation) == (False, True)


def test_a_draft_type_without_its_draft_model_is_left_out(example: Callable[..., Path]) -> None:
    spec = example("demo-draft.toml", {'type = "draft-simple"': 'type = ["draft-simple", "ngram-mod"]'})
    spec.write_text(_without_draft(spec.read_text()))
    result = validate(spec, facts=gpu_facts())
    assert [p.field for p in result.warnings] == ["models.draft"]  # only ngram-mod speculates
    assert _value(list(result.plan.argv), "--spec-type") == "ngram-mod"


def test_no_type_no_speculation(example: Callable[..., Path]) -> None:
    spec = example("demo-draft.toml", {'type = "draft-simple"': 'type = "none"'})
    spec.write_text(_without_draft(spec.read_text()))
    result = validate(spec, facts=gpu_facts())
    assert "--spec-type" not in result.plan.argv
    assert (result.plan.draft_in_use, result.plan.speculation) == (False, False)


def test_older_dialect_lists_no_types_and_takes_a_draft_alone(
    example: Callable[..., Path], older_dialect: Dialect
) -> None:
    assert older_dialect.spec_types == frozenset()
    spec = load_spec(example("demo-draft.toml", {'type = "draft-simple"': 'type = ["draft-simple", "ngram-mod"]'})).spec
    _, problems = build_argv(spec, older_dialect, BINARY, draft_in_use=True, alias=ALIAS)
    errors = [p for p in problems if p.severity is Severity.ERROR]
    assert [p.field for p in errors] == ["speculative.type"]  # it cannot be told to use ngram-mod
    assert "--spec-type" in errors[0].message


# --- an older binary ---------------------------------------------------------------------------------------


def test_older_help_file_is_the_older_dialect(older_dialect: Dialect) -> None:
    assert not OLDER_HELP.read_text().startswith("-")  # its first line says what it is
    for flag in ["--draft-max", "--draft-min", "--draft-p-min", "-md", "--model-draft", "-ngld", "-devd"]:
        assert older_dialect.accepts(flag), flag
    for flag in ["--mlock", "--no-mmap", "-fa", "--metrics", "--slots", "--api-key-file", "-ngl", "-dev"]:
        assert older_dialect.accepts(flag), flag
    for flag in ["--spec-type", "--spec-draft-n-max", "--load-mode", "--fit", "--offline", "-ctkd", "-ctvd"]:
        assert not older_dialect.accepts(flag), flag


CORS_WARNING = "warning server.cors_origins: "


def _demo_argv(example: Callable[..., Path], dialect: Dialect, **replace: str) -> tuple[list[str], list[str]]:
    """The demo's argv and its problems; the one warning of a binary without --cors-origins is checked and left
    out (test_older_dialect_cannot_deny_cross_origin_reads says what it is)."""
    spec = load_spec(example("demo-draft.toml", replace or None)).spec
    argv, problems = build_argv(spec, dialect, BINARY, draft_in_use=True, alias=ALIAS)
    found = [f"{p.severity.value} {p.field}: {p.message}" for p in problems]
    if not dialect.accepts("--cors-origins"):
        assert sum(p.startswith(CORS_WARNING) for p in found) == 1, found
        found = [p for p in found if not p.startswith(CORS_WARNING)]
    return list(argv), found


def _value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} appears {argv.count(flag)} times in {argv}"
    return argv[argv.index(flag) + 1]


def test_demo_argv_in_the_older_dialect(example: Callable[..., Path], older_dialect: Dialect) -> None:
    argv, problems = _demo_argv(example, older_dialect)
    assert problems == []
    assert _value(argv, "--draft-max") == "8"
    assert _value(argv, "--draft-min") == "0"
    assert _value(argv, "--draft-p-min") == "0"
    assert _value(argv, "--model-draft").endswith("/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert _value(argv, "--n-gpu-layers-draft") == "0"
    assert _value(argv, "--device-draft") == "none"
    for flag in ["--spec-type", "--fit", "--offline", "--load-mode", "--spec-draft-n-max", "--spec-draft-model"]:
        assert flag not in argv, flag
    assert _value(argv, "--alias") == ALIAS
    assert _value(argv, "--log-verbosity") == "2"  # warnings and errors; no per-request lines
    assert "--no-log-timestamps" not in argv  # unknown there: its stamps stay
    # load_mode mmap is the older binaries' default: no switch at all.
    assert "--mlock" not in argv and "--no-mmap" not in argv
    # The draft's cache is f16, which is all binaries of that era could give it: no -ctkd/-ctvd needed.
    assert not any(arg in argv for arg in ("-ctkd", "-ctvd", "--cache-type-k-draft", "--spec-draft-type-k"))
    assert argv[0] == BINARY


def test_demo_argv_in_the_current_dialect(example: Callable[..., Path], real_dialect: Dialect) -> None:
    argv, problems = _demo_argv(example, real_dialect)
    assert problems == []
    assert _value(argv, "--spec-type") == "draft-simple"
    assert _value(argv, "--spec-draft-n-max") == "8"
    assert _value(argv, "--spec-draft-n-min") == "0"
    assert _value(argv, "--fit") == "off"
    assert _value(argv, "--load-mode") == "mmap"
    assert _value(argv, "--spec-draft-model").endswith("/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "--offline" in argv
    assert _value(argv, "--alias") == ALIAS
    assert _value(argv, "--log-verbosity") == "2"
    assert "--no-log-timestamps" in argv  # journald stamps each line
    for flag in ["--draft-max", "--draft-min", "--model-draft", "-md", "--mlock", "--no-mmap"]:
        assert flag not in argv, flag


def test_current_dialect_grants_no_origin(example: Callable[..., Path], real_dialect: Dialect) -> None:
    """An empty --cors-origins is sent as an empty Access-Control-Allow-Origin: no page is granted (test_cors.py)."""
    argv, problems = _demo_argv(example, real_dialect)
    assert problems == []
    assert _value(argv, "--cors-origins") == ""
    assert "--no-cors-credentials" in argv and "--cors-credentials" not in argv
    widened, _ = _demo_argv(
        example, real_dialect, **{"threads = 2": 'threads = 2\ncors_origins = ["https://ui.example"]'}
    )
    assert _value(widened, "--cors-origins") == "https://ui.example"


def test_older_dialect_cannot_deny_cross_origin_reads(example: Callable[..., Path], older_dialect: Dialect) -> None:
    spec = load_spec(example("demo-draft.toml")).spec
    argv, problems = build_argv(spec, older_dialect, BINARY, draft_in_use=True, alias=ALIAS)
    assert not any(arg.startswith("--cors") for arg in argv)
    assert [(p.severity, p.field) for p in problems] == [(Severity.WARNING, "server.cors_origins")]
    assert "default grants every origin" in problems[0].message
    assert "engine install" in problems[0].fix
    # A spec that names its UI's origin cannot have it there: every origin would be granted.
    widened = load_spec(
        example("demo-draft.toml", {"threads = 2": 'threads = 2\ncors_origins = ["https://ui.example"]'})
    )
    _, problems = build_argv(widened.spec, older_dialect, BINARY, draft_in_use=True, alias=ALIAS)
    assert [(p.severity, p.field) for p in problems] == [(Severity.ERROR, "server.cors_origins")]
    assert "--cors-origins" in problems[0].message


@pytest.mark.parametrize(
    ("load_mode", "switch"), [("mlock", "--mlock"), ("mmap+mlock", "--mlock"), ("none", "--no-mmap")]
)
def test_load_mode_in_the_older_dialect(
    example: Callable[..., Path], older_dialect: Dialect, load_mode: str, switch: str
) -> None:
    argv, problems = _demo_argv(example, older_dialect, **{'flash_attn = "auto"': f'load_mode = "{load_mode}"'})
    assert problems == []
    assert switch in argv and "--load-mode" not in argv


def test_quantized_draft_cache_needs_ctkd(example: Callable[..., Path], older_dialect: Dialect) -> None:
    replace = {"gpu_layers = 0\n\n[speculative]": 'gpu_layers = 0\ncache_type_k = "q8_0"\n\n[speculative]'}
    _, problems = _demo_argv(example, older_dialect, **replace)
    assert problems == [
        "error models.draft.cache_type_k: llama-server (early 2025) accepts none of "
        "--spec-draft-type-k, --cache-type-k-draft, -ctkd"
    ]


def test_dialect_without_a_draft_model_flag(example: Callable[..., Path], older_dialect: Dialect) -> None:
    crippled = Dialect(older_dialect.flags - {"-md", "--model-draft"}, "a draftless llama-server")
    spec = load_spec(example("demo-draft.toml")).spec
    _, problems = build_argv(spec, crippled, BINARY, draft_in_use=True, alias=ALIAS)
    errors = [p for p in problems if p.severity is Severity.ERROR]
    assert [p.field for p in errors] == ["models.draft.path"]
    assert errors[0].message == "a draftless llama-server accepts none of --spec-draft-model, --model-draft, -md"
    assert "engine install" in errors[0].fix


def test_eagle3_needs_spec_type(example: Callable[..., Path], older_dialect: Dialect) -> None:
    spec = load_spec(example("demo-draft.toml", {'type = "draft-simple"': 'type = "draft-eagle3"'})).spec
    assert spec.speculative.type == "draft-eagle3"
    _, problems = build_argv(spec, older_dialect, BINARY, draft_in_use=True, alias=ALIAS)
    errors = [p for p in problems if p.severity is Severity.ERROR]
    assert [p.field for p in errors] == ["speculative.type"]
    assert "--spec-type" in errors[0].message


def test_removed_flag_in_extra_args_in_each_dialect(
    example: Callable[..., Path], older_dialect: Dialect, real_dialect: Dialect
) -> None:
    replace = {"threads = 2": 'threads = 2\nextra_args = ["--mlock"]'}
    _, current = _demo_argv(example, real_dialect, **replace)
    assert current == [
        "error server.extra_args[0]: --mlock was removed from llama-server",
    ]
    _, older = _demo_argv(example, older_dialect, **replace)
    assert older == []


# --- the planned argv, run for real ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


@pytest.mark.engine
def test_ngram_mod_without_a_draft_drafts_for_real(example: Callable[..., Path], tmp_path: Path) -> None:
    """The launcher's checks of an n-gram-only spec rest on these: /slots says speculative, drafts are counted."""
    replace = {
        'type = "draft-simple"': 'type = "ngram-mod"',
        "[network]": "[speculative.ngram_mod]\nn_match = 8\nn_min = 2\nn_max = 16\n\n[network]",
    }
    spec = example("demo-draft.toml", replace)
    spec.write_text(_without_draft(spec.read_text()))
    argv = list(validate(spec).plan.argv)
    assert "--spec-draft-model" not in argv
    port = _free_port()
    argv[argv.index("--port") + 1] = str(port)
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "llama-server.log"
    with log.open("w") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while _get(f"{base}/health") != 200:
            assert server.poll() is None, f"llama-server exited {server.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no /health 200 within 60 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.25)
        with urllib.request.urlopen(f"{base}/slots", timeout=10) as response:
            slots = json.load(response)
        assert slots and all(slot["speculative"] for slot in slots), slots
        # Text that repeats: what n-gram speculation drafts from (a tiny greedy model keeps repeating it).
        lines = "".join(f"def add_{i}(a: int, b: int) -> int:\n    return a + b\n\n" for i in range(12))
        body = json.dumps({"prompt": lines, "n_predict": 96, "temperature": 0}).encode()
        request = urllib.request.Request(
            f"{base}/completion", data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            timings = json.load(response)["timings"]
        assert timings.get("draft_n", 0) > 0, f"ngram-mod never drafted: {timings}\n{log.read_text()[-3000:]}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)


@pytest.mark.engine
def test_planned_argv_drafts_for_real(example: Callable[..., Path], engine_binary: Path, tmp_path: Path) -> None:
    result = validate(example("demo-draft.toml"))  # the real machine: the real binary's dialect
    argv = list(result.plan.argv)
    assert argv[0] == str(engine_binary)
    port = _free_port()
    argv[argv.index("--port") + 1] = str(port)
    assert _value(argv, "--host") == "127.0.0.1"
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "llama-server.log"
    with log.open("w") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while _get(f"{base}/health") != 200:
            assert server.poll() is None, f"llama-server exited {server.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no /health 200 within 60 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.25)
        body = json.dumps({"prompt": "def add(a, b):", "n_predict": 32, "temperature": 0}).encode()
        request = urllib.request.Request(
            f"{base}/completion", data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.load(response)
        timings = answer["timings"]
        assert timings["predicted_n"] == 32
        assert timings["draft_n"] > 0, f"the draft never drafted: {timings}\n{log.read_text()[-3000:]}"
        assert 0 < timings["draft_n_accepted"] <= timings["draft_n"]
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
