"""API key files, read as their readers read them. Nothing here ever prints or logs a key.

llama-server (`--api-key-file`): one key per line, split at "\\n" only; empty lines and lines starting with #
skipped; every other line taken byte for byte (no trimming). Prometheus (`credentials_file`): the whole file,
leading and trailing white space trimmed, sent as one bearer token.
"""

from __future__ import annotations

from pathlib import Path


def parse_keys(text: str) -> list[str]:
    return [line for line in text.split("\n") if line and not line.startswith("#")]


def read_keys(path: Path) -> list[str]:
    return parse_keys(path.read_text())


def bearer_token(text: str) -> str:
    """What Prometheus sends for a credentials file."""
    return text.strip()


def read_fleet_key(path: Path) -> bytes:
    """[fleet] key_file: one line, trimmed as a bearer token is (the HMAC key of the peers' /ready)."""
    return bearer_token(path.read_text()).encode()
