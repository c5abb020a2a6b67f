"""Selectors as the rendered rules and the dashboard write them: every one carries the spec's labels, so two
appliances watched by one Prometheus never answer for each other."""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Mapping


def quoted(value: str) -> str:
    """A double-quoted string that YAML, PromQL and Go read back as `value`: JSON's escapes, plus \\u escapes for
    what JSON leaves raw and YAML refuses or reads as a line break (DEL, C1 controls, U+2028, U+2029)."""
    text = json.dumps(value, ensure_ascii=False)
    return "".join(f"\\u{ord(c):04x}" if unicodedata.category(c) in ("Cc", "Zl", "Zp") else c for c in text)


def label_matchers(labels: Mapping[str, str]) -> tuple[str, ...]:
    """The spec's labels as PromQL matchers, sorted by name: `appliance="demo"`."""
    return tuple(f"{name}={quoted(value)}" for name, value in sorted(labels.items()))


def series(metric: str, labels: tuple[str, ...], *matchers: str) -> str:
    """`metric{matchers, labels}`; the metric alone when there is nothing to match."""
    every = [*matchers, *labels]
    return f"{metric}{{{', '.join(every)}}}" if every else metric
