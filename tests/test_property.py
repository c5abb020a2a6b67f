"""Property tests: whatever the spec file holds, validation answers with SpecInvalid or a plan, never a crash.

(a) generated TOML documents, written by the small TOML writer below, from keys of the real spec and junk;
(b) the shipped examples, mutated line by line (deleted, duplicated, swapped, values and keys replaced);
(c) the demo with free-form values where they reach rendered files: what validates, the real checkers accept.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLE_FACTS, EXAMPLES, INSTALLED_MODELS, KeyFile, gpu_facts
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from appliance.facts.vocab import read_vocab
from appliance.plan.resolved import Appliance, resolve
from appliance.plan.validate import Validated, validate
from appliance.render.apply import installed_spec_path
from appliance.render.check import check_tree
from appliance.render.render import render
from appliance.spec.load import LoadedSpec, parse_spec
from appliance.spec.model import Spec
from appliance.spec.problems import Problem, SpecInvalid

PROPERTY = settings(
    max_examples=int(os.environ.get("PROPERTY_EXAMPLES", "200")),  # more for a long bug hunt
    deadline=None,
    database=None,  # no .hypothesis/ in the checkout; failures print their example
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# One vocabulary read per file: the real loader takes ~0.2 s, and the files do not change.
cached_vocab = functools.cache(read_vocab)


def _models(model: type[BaseModel]) -> Iterator[tuple[tuple[str, ...], type[BaseModel]]]:
    yield (), model
    for name, info in model.model_fields.items():
        for arg in (info.annotation, *getattr(info.annotation, "__args__", ())):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                for path, inner in _models(arg):
                    yield (name, *path), inner


TABLES = dict(_models(Spec))
# Every key path of the spec, tables and leaves: ("server",), ("server", "port"), ...
KEY_PATHS = sorted({(*table, name) for table, model in TABLES.items() for name in model.model_fields})
KEYS = sorted({path[-1] for path in KEY_PATHS})
# Keys that look like pydantic's own names for union branches, and other junk.
JUNK_KEYS = [
    "int",
    "float",
    "str",
    "bool",
    "literal['auto','all']",
    "constrained-int",
    "",
    " ",
    "a.b",
    "ü",
    "n_maxx",
    "0",
]

text_strategy = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=12)
key_strategy = st.one_of(st.sampled_from(KEYS + JUNK_KEYS), text_strategy)


def interesting_strings(models: Path) -> list[str]:
    return [
        "auto",
        "all",
        "none",
        "on",
        "off",
        "deny",
        "allow",
        "warn",
        "refuse",
        "f16",
        "q8_0",
        "q4_0",
        "draft-simple",
        "ngram-simple",
        "mmap",
        "CUDA0",
        "CUDA1",
        "127.0.0.1",
        "0.0.0.0",
        "::",
        "localhost",
        "10.0.0.0/8",
        "10.0.0.1/8",
        "daily",
        "/tmp",
        "relative.gguf",
        "/nonexistent/model.gguf",
        "--ctx-size",
        "--draft-max",
        "--verbose",
        "/x\0y",
        __file__,  # a file, not GGUF
        f"{__file__}/model.gguf",  # under a file
        str(models / "target-27b-Q4_K_M.gguf"),
        str(models / "draft-0.6b-Q4_K_M.gguf"),
        str(models / "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ]


def scalars(models: Path) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.integers(min_value=-(2**63), max_value=2**63 - 1),
        st.integers(min_value=-2, max_value=70000),
        st.floats(allow_nan=True, allow_infinity=True),
        st.floats(min_value=0, max_value=2),
        st.booleans(),
        text_strategy,
        st.sampled_from(interesting_strings(models)),
        st.dates(),
        st.datetimes(),
        st.times(),
    )


def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.lists(inner, max_size=4), st.dictionaries(key_strategy, inner, max_size=4))


@functools.cache
def values(models: Path) -> st.SearchStrategy[Any]:
    return st.recursive(scalars(models), _containers, max_leaves=12)


# --- a tiny TOML writer ---


def toml_string(text: str) -> str:
    escaped = "".join(
        "\\\\" if c == "\\" else '\\"' if c == '"' else f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c
        for c in text
    )
    return f'"{escaped}"'


def toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else toml_string(key)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, datetime.date | datetime.time):  # datetime is a date
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(type(value))


def toml_document(document: dict[str, Any]) -> str:
    """Scalars and arrays of a table under its [header]; nested tables as their own [a.b] sections."""
    lines: list[str] = []

    def table(path: list[str], node: dict[str, Any]) -> None:
        leaves = {k: v for k, v in node.items() if not isinstance(v, dict)}
        tables = {k: v for k, v in node.items() if isinstance(v, dict)}
        if path and (leaves or not tables):
            lines.append(f"[{'.'.join(toml_key(p) for p in path)}]")
        lines.extend(f"{toml_key(k)} = {toml_value(v)}" for k, v in leaves.items())
        for k, v in tables.items():
            table([*path, k], v)

    table([], document)
    return "\n".join(lines) + "\n"


def comparable(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, list):
        return [comparable(v) for v in value]
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items()}
    return value


# --- what every answer must look like ---


def check_problems(problems: list[Problem], spec: Path, text: str) -> None:
    assert problems, "SpecInvalid without a problem"
    lines = max(1, len(text.splitlines()) + 1)
    for problem in problems:
        assert problem.file == spec
        rendered = problem.render()
        assert rendered.startswith(str(spec)), rendered
        assert problem.message, rendered  # field may be "": TOML allows an empty key
        assert "Traceback" not in rendered
        assert problem.line is None or 1 <= problem.line <= lines, rendered


def check_answer(spec: Path, text: str, facts_name: str, note: bool = True) -> Validated | None:
    spec.write_text(text)
    try:
        result = validate(spec, facts=FACTS[facts_name], vocab_reader=cached_vocab)
    except SpecInvalid as invalid:
        check_problems(invalid.problems, spec, text)
        assert invalid.errors, "SpecInvalid raised with warnings only"
        if note:  # for --hypothesis-show-statistics: how far the examples get
            event("refused", invalid.errors[0].field.split(".")[0])
        return None
    if note:
        event("valid")
    # Valid: it renders, and the snapshot reads back as the very appliance that was resolved.
    appliance = resolve(result.plan, installed_spec_path(spec))
    files = render(appliance)
    snapshot = Appliance.from_document(json.loads(files["etc/llm-appliance/rendered/appliance.json"]))
    assert snapshot == appliance and snapshot.argv == result.plan.argv
    for warning in result.warnings:
        assert warning.file == spec and warning.render().startswith(str(spec))
    return result


FACTS = {**EXAMPLE_FACTS, "none": gpu_facts()}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("property")


def example_text(name: str, models: Path) -> str:
    return (EXAMPLES / name).read_text().replace(INSTALLED_MODELS, str(models))


# --- (a) generated documents ---


@PROPERTY
@given(data=st.data())
def test_writer_round_trips(data: st.DataObject, fixture_models: Path) -> None:
    document = data.draw(st.dictionaries(key_strategy, values(fixture_models), max_size=6))
    assert comparable(tomllib.loads(toml_document(document))) == comparable(document)


@PROPERTY
@given(data=st.data())
def test_generated_documents_parse_or_are_refused(data: st.DataObject, fixture_models: Path) -> None:
    tables = st.fixed_dictionaries(
        {},
        optional={
            name: st.dictionaries(st.sampled_from([*TABLES[(name,)].model_fields, *JUNK_KEYS]), values(fixture_models))
            for name in Spec.model_fields
        },
    )
    document = data.draw(st.one_of(tables, st.dictionaries(key_strategy, values(fixture_models), max_size=6)))
    text = toml_document(document)
    spec = Path("/etc/llm-appliance/generated.toml")
    try:
        loaded = parse_spec(text, spec)
    except SpecInvalid as invalid:
        check_problems(invalid.problems, spec, text)
    else:
        assert isinstance(loaded, LoadedSpec)


@PROPERTY
@given(text=st.text(max_size=300))
def test_any_text_parses_or_is_refused(text: str) -> None:
    spec = Path("any.toml")
    try:
        parse_spec(text, spec)
    except SpecInvalid as invalid:
        check_problems(invalid.problems, spec, text)


def _set(document: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = document
    for part in path[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[path[-1]] = value


def _delete(document: dict[str, Any], path: tuple[str, ...]) -> None:
    node: Any = document
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(path[-1], None)


@PROPERTY
@given(data=st.data())
def test_examples_with_generated_values_validate_or_are_refused(
    data: st.DataObject, fixture_models: Path, workdir: Path
) -> None:
    name = data.draw(st.sampled_from(sorted(EXAMPLE_FACTS)))
    document = tomllib.loads(example_text(name, fixture_models))
    junk_paths = st.tuples(st.sampled_from(sorted(TABLES)), key_strategy).map(lambda p: (*p[0], p[1]))
    path_strategy = st.one_of(st.sampled_from(KEY_PATHS), junk_paths)
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        path = data.draw(path_strategy)
        if data.draw(st.booleans()):
            _set(document, path, data.draw(values(fixture_models)))
        else:
            _delete(document, path)
    facts = data.draw(st.sampled_from([name, "none"]))
    check_answer(workdir / name, toml_document(document), facts)


# --- (b) mutated example texts ---

MUTATIONS = ("delete", "duplicate", "swap", "value", "rename", "insert", "cut")


@PROPERTY
@given(data=st.data())
def test_mutated_examples_validate_or_are_refused(data: st.DataObject, fixture_models: Path, workdir: Path) -> None:
    name = data.draw(st.sampled_from(sorted(EXAMPLE_FACTS)))
    lines = example_text(name, fixture_models).splitlines()
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        kind = data.draw(st.sampled_from(MUTATIONS))
        i = data.draw(st.integers(min_value=0, max_value=len(lines) - 1)) if lines else 0
        if not lines:
            lines.append(data.draw(text_strategy))
        elif kind == "delete":
            del lines[i]
        elif kind == "duplicate":
            lines.insert(i, lines[i])
        elif kind == "swap":
            j = data.draw(st.integers(min_value=0, max_value=len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif kind == "value" and "=" in lines[i]:
            written = data.draw(
                st.one_of(values(fixture_models).map(toml_value), text_strategy.filter(lambda t: "\n" not in t))
            )
            lines[i] = f"{lines[i].split('=', 1)[0]}= {written}"
        elif kind == "rename" and "=" in lines[i]:
            lines[i] = f"{toml_key(data.draw(key_strategy))} ={lines[i].split('=', 1)[1]}"
        elif kind == "insert":
            lines.insert(i, data.draw(st.one_of(text_strategy, st.sampled_from(["[server]", "[models.draft]", "[["]))))
        elif kind == "cut":
            lines[i] = lines[i][: data.draw(st.integers(min_value=0, max_value=len(lines[i])))]
    facts = data.draw(st.sampled_from([name, "none"]))
    check_answer(workdir / name, "\n".join(lines) + "\n", facts)


def test_unmutated_examples_are_valid(fixture_models: Path, workdir: Path) -> None:
    # The properties above would pass if everything were refused; the starting points are valid.
    for name in sorted(EXAMPLE_FACTS):
        assert check_answer(workdir / name, example_text(name, fixture_models), name, note=False) is not None


# --- (c) every spec that validates renders files their own checkers accept ---
#
# The demo with free-form values in the fields that reach a rendered file. Validation may refuse any of them;
# whatever it lets through must render into files that systemd-analyze, nft and promtool accept, as apply
# checks them. To cover a new field, add it to FIELDS with the values worth trying there.

CHECKED = settings(
    PROPERTY,
    max_examples=int(os.environ.get("PROPERTY_CHECK_EXAMPLES", "25")),  # ~0.3 s each
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],  # explaining a failure takes minutes
)

# What breaks a YAML scalar, a unit line, a PromQL string, an nft token, a jinja2 template, a specifier.
TRICKY = ['"', "'", "\\", "\n", "\r", "\t", " ", "{{", "}}", "{%", "%", "%h", "$", "${x}", "#", ": ", "- ", ";"]
TRICKY += ["`", "*", "?", "[", "]", ",", "{", "}", "ü", "€", "\u2028", "\x7f", "\x00", "|", ">", "&", "!"]


def texts(*seeds: str) -> st.SearchStrategy[str]:
    """Text made of tricky pieces, the field's usual values and anything else."""
    pieces = st.one_of(st.sampled_from([*TRICKY, *seeds]), text_strategy)
    return st.one_of(st.sampled_from(seeds) if seeds else st.nothing(), st.lists(pieces, max_size=4).map("".join))


CALENDARS = [
    *("daily", "weekly", "hourly", "minutely", "*-*-* 04:00:00", "Mon..Fri 03:30", "*:0/15", "Sat *-*-1..7 02:00"),
    *("*-*-* 04:00:00 UTC", "*-*-* 04:00:00 Europe/Berlin", "2024-02-30", "04:00 daily", "@daily", "0 4 * * *"),
    *("whenever it suits", "25:00", "tomorrow", " daily", "daily ", "daily\tweekly", "daily\\"),
]
HOSTS = ["127.0.0.1", "::1", "0.0.0.0", "::", "localhost", "192.168.7.5", "fd00::5", "::ffff:127.0.0.1", "fe80::1%eth0"]
HOSTS += ["127.0.0.2", "1.2.3.4 ", "0x7f000001", "2130706433", "127.1", "[::1]"]
NETWORKS = ["127.0.0.0/8", "::1/128", "192.168.7.0/24", "0.0.0.0/0", "::/0", "fd00::/8", "10.0.0.1/32", "fe80::/10"]
NETWORKS += ["::ffff:10.0.0.0/104", "10.0.0.0/8 ", "10.0.0.0", "fe80::1%eth0/128", "10.0.0.0/33"]
PORTS = st.one_of(st.sampled_from([1, 22, 80, 8080, 9478, 65535, 0, -1, 65536]), st.integers(-2, 70000))
FILE_NAMES = ["demo-draft.toml", "my spec.toml", "it's.toml", 'say "hi".toml', "100%.toml", "%h.toml", "ünï.toml"]
FILE_NAMES += ["$HOME.toml", "back\\slash.toml", "new\nline.toml", "tab\t.toml", "{{x}}.toml", "a: b.toml", "#1.toml"]
FILE_NAMES += ["-dash.toml", "demo.json", "demo", "a;b.toml", "`x`.toml"]


def _file_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and "\0" not in name and len(name.encode()) < 200


file_names = st.one_of(st.sampled_from(FILE_NAMES), texts().filter(_file_name))

FIELDS: dict[tuple[str, ...], st.SearchStrategy[Any]] = {
    ("prometheus", "labels"): st.dictionaries(st.sampled_from(["appliance", "site", "instance", "env"]), texts("demo")),
    ("restart", "schedule"): st.one_of(st.sampled_from(CALENDARS), texts("daily")),
    ("server", "host"): st.one_of(st.sampled_from(HOSTS), texts()),
    ("prometheus", "host"): st.one_of(st.sampled_from(HOSTS), texts()),
    ("network", "allow"): st.lists(st.one_of(st.sampled_from(NETWORKS), texts()), max_size=3),
    ("server", "port"): PORTS,
    ("prometheus", "port"): PORTS,
    ("versions", "driver"): texts("550.54.15"),
    ("versions", "cuda"): texts("12.4"),
    ("versions", "llama_cpp"): texts("b4000"),
    ("health", "baseline_file"): texts("baseline").map(lambda t: f"/var/lib/llm-appliance/{t}.json"),
}


def write_spec(
    models: Path, directory: Path, fields: dict[tuple[str, ...], Any], name: str, key: Path | None
) -> tuple[Path, str]:
    """The demo with `fields` set (and server.api_key_file, when `key`), written as `directory`/`name`."""
    document = tomllib.loads(example_text("demo-draft.toml", models))
    for path, value in fields.items():
        _set(document, path, value)
    if key is not None:
        _set(document, ("server", "api_key_file"), str(key))
    spec = directory / name
    text = toml_document(document)
    spec.write_text(text)
    return spec, text


def refused_or_accepted(spec: Path, text: str, note: bool = True) -> None:
    """validate refuses the spec, or apply's check accepts every file rendered from it."""
    try:
        result = validate(spec, facts=FACTS["demo-draft.toml"], vocab_reader=cached_vocab)
    except SpecInvalid as invalid:
        if note:
            event("refused", invalid.errors[0].field.split(".")[0])
        return
    if note:
        event("valid")
    files = render(resolve(result.plan, installed_spec_path(spec)))
    files[str(installed_spec_path(spec)).lstrip("/")] = text  # as apply installs it
    checked = check_tree(files)
    assert checked.notes == (), f"a checker did not run (.ci/run installs the tools and the user): {checked.notes}"
    assert checked.rejections == (), "\n".join(map(str, checked.rejections))


@pytest.mark.system  # systemd-analyze, nft (as root, with the service user), promtool
@CHECKED
@given(data=st.data())
def test_every_valid_spec_renders_files_their_checkers_accept(
    data: st.DataObject, fixture_models: Path, workdir: Path, key_file: KeyFile
) -> None:
    fields = data.draw(st.fixed_dictionaries({}, optional=FIELDS), label="fields")
    key_name = data.draw(st.none() | file_names, label="api_key_file name")
    key = key_file("a-key", name=key_name) if key_name is not None else None
    directory = workdir / "checked"
    directory.mkdir(exist_ok=True)
    refused_or_accepted(*write_spec(fixture_models, directory, fields, data.draw(file_names, label="spec name"), key))


# Each input class the property above found, one example each, with what the checker said on Debian 12.
FOUND = {
    "schedule-not-a-calendar": ({("restart", "schedule"): "whenever it suits"}, "demo-draft.toml", None),  # systemd
    "schedule-cron-syntax": (
        {("restart", "schedule"): "0 4 * * *"},
        "demo-draft.toml",
        None,
    ),  # Failed to parse calendar
    "schedule-trailing-backslash": (
        {("restart", "schedule"): "daily\\"},
        "demo-draft.toml",
        None,
    ),  # joins the next line
    "schedule-specifier": ({("restart", "schedule"): "daily%h"}, "demo-draft.toml", None),  # systemd expands %h
    "label-go-template": ({("prometheus", "labels"): {"appliance": "a{{b"}}, "demo-draft.toml", None),  # function "b"
    "label-line-separator": ({("prometheus", "labels"): {"appliance": "a\u2028b"}}, "demo-draft.toml", None),  # yaml
    "label-control-character": ({("prometheus", "labels"): {"appliance": "a\x7fb"}}, "demo-draft.toml", None),  # yaml
    "host-ipv6-zone": ({("prometheus", "host"): "fe80::1%eth0"}, "demo-draft.toml", None),  # Address prefix is invalid
    "allow-ipv6-zone": ({("network", "allow"): ["::1/128", "fe80::1%eth0/128"]}, "demo-draft.toml", None),  # nft junk
    "spec-name-quote": ({}, 'say "hi".toml', None),  # yaml: did not find expected key
    "spec-name-backslash": ({}, "back\\slash.toml", None),  # yaml: found unknown escape character
    "spec-name-newline": ({}, "new\nline.toml", None),  # units: Assignment outside of section; nft; yaml
    "spec-name-go-template": ({}, "{{x}}.toml", None),  # promtool: function "x" not defined
    "spec-name-control-character": ({}, "x\x7fy.toml", None),  # yaml: control characters are not allowed
    "key-path-quote": ({}, "demo-draft.toml", 'say "hi"'),  # the ServerDown description names the key file
    "key-path-colon-space": ({}, "demo-draft.toml", "a: b"),  # scrape.yml credentials_file: mapping values
    "key-path-newline": ({}, "demo-draft.toml", "new\nline"),  # scrape.yml: could not find expected ':'
    "key-path-go-template": ({}, "demo-draft.toml", "{{x}}"),  # promtool: function "x" not defined
}


@pytest.mark.system
@pytest.mark.parametrize("case", sorted(FOUND))
def test_found_inputs_are_refused_or_accepted(
    case: str, fixture_models: Path, tmp_path: Path, key_file: KeyFile
) -> None:
    fields, name, key_name = FOUND[case]
    key = key_file("a-key", name=key_name) if key_name is not None else None
    refused_or_accepted(*write_spec(fixture_models, tmp_path, fields, name, key), note=False)
