"""Read a spec file: TOML syntax, then the typed model; every error located by file, line and field."""

from __future__ import annotations

import difflib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from appliance.spec.model import Spec
from appliance.spec.problems import Problem, Severity, SpecInvalid

_TOML_POSITION = re.compile(r"\(at line (\d+), column (\d+)\)")
_TABLE = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"""^\s*((?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*'))*)\s*=""")


@dataclass
class KeyLines:
    """Where each dotted key of a TOML document is written, so errors can point at a line."""

    lines: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, text: str) -> KeyLines:
        found: dict[str, int] = {}
        table: list[str] = []
        # An array of tables ([[hosts]]) is written once per element: its keys are also recorded with the
        # element's index as pydantic names it (hosts.1.name), so an error points at that element's line.
        arrays: dict[str, int] = {}
        for number, line in enumerate(text.splitlines(), start=1):
            if m := _TABLE.match(line):
                table = _split_key(m.group(1))
                if line.lstrip().startswith("[["):
                    arrays[".".join(table)] = arrays.get(".".join(table), -1) + 1
                found.setdefault(".".join(table), number)
                found.setdefault(".".join(_indexed(table, arrays)), number)
            elif m := _KEY.match(line):
                key = _split_key(m.group(1))
                found.setdefault(".".join([*table, *key]), number)
                found.setdefault(".".join([*_indexed(table, arrays), *key]), number)
        return cls(found)

    def line_of(self, dotted: str) -> int | None:
        # "hosts[1].name" and pydantic's "hosts.1.name" are the second [[hosts]]'s; "server.extra_args[0]" is
        # written on the line of "server.extra_args".
        indexed = re.sub(r"\[(\d+)\]", r".\1", dotted).split(".")
        while len(indexed) > 1 and any(part.isdigit() for part in indexed):
            if (line := self.lines.get(".".join(indexed))) is not None:
                return line
            indexed.pop()
        parts = [part for part in re.sub(r"\[\d+\]", "", dotted).split(".") if not part.isdigit()]
        while parts:
            if (line := self.lines.get(".".join(parts))) is not None:
                return line
            parts.pop()
        return None

    def has(self, dotted: str) -> bool:
        return dotted in self.lines


def _indexed(table: list[str], arrays: dict[str, int]) -> list[str]:
    """`table` with the index of each array of tables it lies in: hosts.overrides -> hosts.1.overrides."""
    parts: list[str] = []
    for depth, part in enumerate(table, start=1):
        parts.append(part)
        if (index := arrays.get(".".join(table[:depth]))) is not None:
            parts.append(str(index))
    return parts


def _split_key(key: str) -> list[str]:
    return [part.strip().strip("\"'") for part in re.findall(r"""[A-Za-z0-9_-]+|"[^"]*"|'[^']*'""", key)]


@dataclass(frozen=True)
class LoadedSpec:
    spec: Spec
    path: Path
    key_lines: KeyLines

    def locate(self, problem: Problem) -> Problem:
        return locate(problem, self.path, self.key_lines)


def locate(problem: Problem, path: Path, key_lines: KeyLines) -> Problem:
    line = problem.line if problem.line is not None else key_lines.line_of(problem.field)
    return Problem(problem.severity, problem.field, problem.message, problem.fix, path, line)


def load_spec(path: Path) -> LoadedSpec:
    """Parse and type-check a spec file, or raise SpecInvalid listing every problem found."""
    return parse_spec(read_text(path, "/etc/llm-appliance/appliance.toml"), path)


def parse_spec(text: str, path: Path) -> LoadedSpec:
    document, key_lines = parse_toml(text, path)
    try:
        spec = Spec.model_validate(document)
    except ValidationError as exc:
        raise SpecInvalid(located_problems(exc, document, path, key_lines)) from None
    return LoadedSpec(spec, path, key_lines)


def read_text(path: Path, example: str, what: str = "spec") -> str:
    """A TOML file's text, or SpecInvalid saying why it cannot be read; `example` is a path to suggest."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise SpecInvalid(
            [Problem(Severity.ERROR, "(file)", "no such file", f"check the path, e.g. {example}", path)]
        ) from None
    except OSError as exc:
        raise SpecInvalid(
            [Problem(Severity.ERROR, "(file)", f"cannot read: {exc.strerror}", "check the file's permissions", path)]
        ) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecInvalid(
            [Problem(Severity.ERROR, "(file)", f"not UTF-8 text (byte {exc.start})", f"save the {what} as UTF-8", path)]
        ) from None


def parse_toml(text: str, path: Path) -> tuple[dict[str, Any], KeyLines]:
    """The TOML document and where each key is written; SpecInvalid (located) on a syntax error."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        position = _TOML_POSITION.search(message)
        line = int(position.group(1)) if position else None
        message = _TOML_POSITION.sub("", message).strip()
        raise SpecInvalid(
            [
                Problem(
                    Severity.ERROR,
                    "(syntax)",
                    f"not valid TOML: {message}",
                    "fix the TOML syntax on that line",
                    path,
                    line,
                )
            ]
        ) from None
    return document, KeyLines.of(text)


def located_problems(
    exc: ValidationError, document: dict[str, Any], path: Path, key_lines: KeyLines, root: type[BaseModel] = Spec
) -> list[Problem]:
    """pydantic's errors for `root` (the spec, or another file modelled the same way) as located problems."""
    return [locate(_problem_from(err, document, root), path, key_lines) for err in exc.errors()]


def _problem_from(err: Any, document: dict[str, Any], root: type[BaseModel]) -> Problem:
    loc = _written_loc(err["loc"], document)
    dotted = ".".join(loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        known = _known_keys(loc[:-1], root)
        close = difflib.get_close_matches(loc[-1], known, n=1)
        fix = f"did you mean '{close[0]}'?" if close else f"remove it; known keys here: {', '.join(sorted(known))}"
        return Problem(Severity.ERROR, dotted, "unknown key", fix)
    if kind == "missing":
        return Problem(
            Severity.ERROR,
            dotted,
            "required but missing",
            f"add '{loc[-1]} = ...' to [{'.'.join(loc[:-1]) or 'top level'}]",
        )
    given = _lookup(document, err["loc"])
    message = err["msg"].removeprefix("Value error, ")
    if given is not _ABSENT and not isinstance(given, dict):  # a whole table is no help: its line is named
        message += f" (got {given!r})"
    return Problem(Severity.ERROR, dotted, message, _fix_for(kind, err))


def _written_loc(loc: tuple[Any, ...], document: dict[str, Any]) -> list[str]:
    """The error's location as the user wrote it: a key the document has (`float = 1`) is never a union branch."""
    kept: list[str] = []
    node: Any = document
    for part in loc:
        in_table = isinstance(node, dict) and part in node
        if in_table or (isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)):
            node = node[part]
        elif _is_union_branch(part):
            continue
        else:
            node = _ABSENT
        kept.append(str(part))
    return kept


def _is_union_branch(part: Any) -> bool:
    # pydantic names the branch of a union it tried ("int", "literal['auto','all']"); the user never wrote it.
    return isinstance(part, str) and (
        part in {"int", "str", "float", "bool"} or part.startswith(("literal[", "constrained-"))
    )


_ABSENT = object()


def _lookup(document: Any, loc: tuple[Any, ...]) -> Any:
    node = document
    for part in loc:
        if (isinstance(node, dict) and part in node) or (
            isinstance(node, list) and isinstance(part, int) and part < len(node)
        ):
            node = node[part]
        else:
            return _ABSENT if node is document else node
    return node


# pydantic's type names, as a TOML writer would say them ("write a int", "write a model" read badly).
_TOML_KINDS = {
    "int": "an integer",
    "float": "a number",
    "string": "a string",
    "bool": "true or false",
    "list": "an array",
    "dict": "a table",
    "model": "a table",
    "path": "a path string",
}


def _fix_for(kind: str, err: Any) -> str:
    ctx = err.get("ctx") or {}
    if kind.startswith(("greater_than", "less_than")):
        bounds = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in ctx.items())
        return f"use a value {bounds}"
    if kind == "literal_error":
        return f"use one of {ctx.get('expected', '')}"
    if kind.endswith("_type") or kind.endswith("_parsing"):
        kind_name = kind.split("_")[0]
        return f"write {_TOML_KINDS.get(kind_name, f'a {kind_name}')}"
    return "see the spec reference in docs/spec.md"


def _known_keys(loc: list[str], root: type[BaseModel]) -> list[str]:
    model: type[BaseModel] | None = root
    for part in loc:
        if model is None:
            return []
        annotation = model.model_fields.get(part)
        model = _model_of(annotation.annotation) if annotation else None
    return list(model.model_fields) if model else []


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None
