"""The templates of templates/, set up once: every rendered file's jinja2 environment."""

from __future__ import annotations

from functools import cache
from importlib import resources
from pathlib import Path

import jinja2


@cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def templates_dir() -> Path:
    """Installed: appliance/templates inside the wheel. From a checkout: the top-level templates/."""
    packaged = Path(str(resources.files("appliance").joinpath("templates")))
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "templates"


def template(name: str) -> jinja2.Template:
    """A template of templates/, set up as every rendered file's (StrictUndefined, trimmed blocks)."""
    return _environment().get_template(name)
