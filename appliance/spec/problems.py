"""Problems a user can cause, collected into one report that names file, line, field and fix."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path


class Severity(StrEnum):
    ERROR = "error"
    WARNING = "warning"


@dataclass(frozen=True)
class Problem:
    severity: Severity
    field: str
    message: str
    fix: str = ""
    file: Path | None = None
    line: int | None = None

    def render(self) -> str:
        where = str(self.file) if self.file else "<spec>"
        if self.line is not None:
            where += f":{self.line}"
        text = f"{where}: {self.severity.value}: {self.field}: {self.message}"
        if self.fix:
            text += f"\n    fix: {self.fix}"
        return text


def error(field: str, message: str, fix: str = "") -> Problem:
    return Problem(Severity.ERROR, field, message, fix)


def warning(field: str, message: str, fix: str = "") -> Problem:
    return Problem(Severity.WARNING, field, message, fix)


class SpecInvalid(Exception):
    """Raised with every error found, so the user fixes them in one pass."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__(format_problems(problems))

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity is Severity.ERROR]


def format_problems(problems: list[Problem]) -> str:
    return "\n".join(p.render() for p in problems)
