"""Bad specs, each a small edit of a shipped example: the error names the field, the file and its line.

Placeholders in a case's edits: $MODELS (the fixture models directory the example points at), $BROKEN (the
broken model files of `bad_files`, outside /tmp, which validate refuses), $TMP (a directory in /tmp), $OUTSIDE (a directory outside /tmp and
the homes, where the units bind nothing) with $CLOSED in it (a directory only root may enter), $HOME_DIR (a
directory in /home, which the units hide), $KEYS (a directory the service user may
enter, holding the key files of `bad_files`), $SMOLLM2 and $GEMMA3 (the real models).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import EXAMPLE_FACTS, KeyFile, gpu_facts

from appliance.facts.dialect import Dialect, builtin_help_text, parse_help
from appliance.facts.machine import MachineFacts
from appliance.plan.validate import validate
from appliance.spec.problems import Problem, Severity, SpecInvalid, format_problems
from appliance.system.users import account

SERVICE = account()
TARGET_PATH = 'path = "$MODELS/target-27b-Q4_K_M.gguf"'
DRAFT_PATH = 'path = "$MODELS/draft-0.6b-Q4_K_M.gguf"'
DEMO_DRAFT_PATH = '[models.draft]\npath = "$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf"'
TARGET_CACHE = 'cache_type_k = "q8_0"\ncache_type_v = "q8_0"\n\n[models.draft]'
DRAFT_CACHE = 'cache_type_k = "q8_0"\ncache_type_v = "q8_0"\n\n[speculative]'
FIRST_LINE = "# llm-appliance: one 24 GB GPU"
NETWORK_ALLOW = '[network]\nallow = ["127.0.0.0/8", "::1/128"]\n'
LOOPBACK = 'host = "127.0.0.1"'
PROMETHEUS = "[prometheus]\n"
SPECULATIVE_END = "p_min = 0.0\n"  # the last line of appliance.toml's [speculative]
FLEET = '\n[fleet]\nhost = "gpu-1"\npeers = { gpu-2 = "http://10.0.0.12:9478/ready" }\nmin_ready = 1\n'


def trimmed_dialect(source: str, flag_prefix: str, spec_type: str | None = None) -> Dialect:
    """The pinned build's --help without the flags named `flag_prefix`... and the --spec-type value `spec_type`."""
    kept = [line for line in builtin_help_text().splitlines() if not line.startswith(flag_prefix)]
    if spec_type is not None:
        kept = [line.replace(f",{spec_type},", ",") if line.startswith("--spec-type ") else line for line in kept]
    return parse_help("\n".join(kept), source)


WITHOUT_NGRAM_MOD = trimmed_dialect("a llama-server without ngram-mod", "--spec-ngram-mod-", "ngram-mod")
WITHOUT_N_MATCH = trimmed_dialect("a llama-server without n_match", "--spec-ngram-mod-n-match")


def api_key(name: str) -> dict[str, str]:
    return {LOOPBACK: f'{LOOPBACK}\napi_key_file = "$KEYS/{name}"'}


def scrape_key(api: str | None, scrape: str) -> dict[str, str]:
    return {**(api_key(api) if api else {}), PROMETHEUS: f'{PROMETHEUS}scrape_key_file = "$KEYS/{scrape}"\n'}


@dataclass(frozen=True)
class Case:
    id: str
    edits: dict[str, str]
    field: str
    message: str
    fix: str = ""
    at: str | None = None  # text on the line the problem must point at; None: no line to point at
    errors: int = 1  # how many errors the spec has in all
    base: str = "appliance.toml"
    facts: MachineFacts | None = None  # None: the base example's facts
    edit: Callable[[str], str] | None = None  # a change replace cannot express
    raw: Callable[[bytes], bytes] | None = None  # a change to the file's bytes
    severity: Severity = field(default=Severity.ERROR)


EXTRA_ARGS = 'load_mode = "mmap"'
# The switches of issue 36 that open llama-server to its clients, the network or the disk: refused each with
# its reason, whatever the spec marks.
REFUSED_SWITCHES = [
    (["--tools", "all"], "opens POST /tools to every API client", "remove it"),
    (["--tools=read_file,exec_shell_command"], "exec_shell_command", "remove it"),
    (["--agent"], "every built-in tool: opens POST /tools", "remove it"),
    (["-ag"], "every built-in tool", "remove it"),
    (["--ui-mcp-proxy"], "an HTTP fetcher for its clients: it dials any URL a client names (SSRF)", "remove it"),
    (["--props"], "lets every API client rewrite the server's settings (POST /props)", "remove it"),
    (["--slot-save-path", "/tmp/kv"], "write the prompts' KV cache to disk", "remove it"),
    (["--hf-token", "hf_secret"], "puts a secret on the command line", "download the model before"),
    (["-hf", "org/model"], "fetches model files from the internet", "remove it"),
    (["--gpt-oss-20b-default"], "fetches model files from the internet", "remove it"),
]


def _extra_args(args: list[str], marked: list[str] | None = None) -> dict[str, str]:
    unchecked = "" if marked is None else f"\nextra_args_unchecked = {json.dumps(marked)}"
    return {EXTRA_ARGS: f"{EXTRA_ARGS}\nextra_args = {json.dumps(args)}{unchecked}"}


def _drop_table(name: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        new, count = re.subn(rf"^\[{re.escape(name)}\]\n(?:[^\[\n].*\n|\n)*", "", text, flags=re.M)
        assert count == 1, name
        return new

    return edit


def _drop_line(start: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        new, count = re.subn(rf"^{re.escape(start)}.*\n", "", text, count=1, flags=re.M)
        assert count == 1, start
        return new

    return edit


BAD = [
    # --- type errors (TOML types are kept: no silent coercion) ---
    Case(
        "port-string", {"port = 8080": 'port = "8080"'}, "server.port", "valid integer", "an integer", 'port = "8080"'
    ),
    Case("parallel-bool", {"parallel = 4 ": "parallel = true "}, "server.parallel", "valid integer", at="parallel ="),
    Case("ctx-float", {"ctx_size = 32768": "ctx_size = 32768.5"}, "server.ctx_size", "valid integer", at="ctx_size"),
    Case(
        "utilization-string",
        {"gpu_memory_utilization = 0.95": 'gpu_memory_utilization = "high"'},
        "memory.gpu_memory_utilization",
        "valid number",
        "a number",
        "gpu_memory_utilization",
    ),
    Case("host-int", {'host = "127.0.0.1"': "host = 127"}, "server.host", "valid string", "a string", "host = 127"),
    Case(
        "extra-args-string",
        {'load_mode = "mmap"': 'load_mode = "mmap"\nextra_args = "--verbose"'},
        "server.extra_args",
        "valid list",
        "an array",
        "extra_args",
    ),
    Case(
        "table-as-string",
        {FIRST_LINE: f'versions = "0.1"\n{FIRST_LINE}', '[versions]\non_mismatch = "warn"\n': ""},
        "versions",
        "valid dictionary",
        "a table",
        'versions = "0.1"',
    ),
    Case(
        "label-value-int",
        {'labels = { appliance = "workstation" }': "labels = { appliance = 1 }"},
        "prometheus.labels.appliance",
        "valid string",
        at="labels =",
    ),
    Case(
        "gpu-layers-word",
        {'gpu_layers = "all"      #': 'gpu_layers = "most"      #'},
        "models.draft.gpu_layers",
        "'auto' or 'all'",
        at='gpu_layers = "most"',
        errors=2,  # neither an integer nor one of the words
    ),
    Case("model-path-int", {TARGET_PATH: "path = 42"}, "models.target.path", "not a valid path", at="path = 42"),
    # --- range errors ---
    Case("port-0", {"port = 8080": "port = 0"}, "server.port", "greater than or equal to 1", "ge 1", "port = 0"),
    Case(
        "port-70000",
        {"port = 8080": "port = 70000"},
        "server.port",
        "less than or equal to 65535",
        "le 65535",
        "port = 70000",
    ),
    Case("n-max-0", {"n_max = 6 ": "n_max = 0 "}, "speculative.n_max", "greater than or equal to 1", at="n_max = 0"),
    Case("n-max-65", {"n_max = 6 ": "n_max = 65 "}, "speculative.n_max", "less than or equal to 64", at="n_max = 65"),
    Case(
        "utilization-1.5",
        {"gpu_memory_utilization = 0.95": "gpu_memory_utilization = 1.5"},
        "memory.gpu_memory_utilization",
        "less than or equal to 1 (got 1.5)",
        at="gpu_memory_utilization = 1.5",
    ),
    Case(
        "ctx-negative",
        {"ctx_size = 32768": "ctx_size = -1"},
        "server.ctx_size",
        "greater than or equal to 256 (got -1)",
        at="ctx_size = -1",
    ),
    Case(
        "temperature-negative",
        {"temperature = 0.6": "temperature = -1"},
        "server.sampling.temperature",
        "greater than or equal to 0",
        at="temperature = -1",
    ),
    Case(
        "device-total-0",
        {"compute_headroom_mib = 1024": "compute_headroom_mib = 1024\ndevice_total_mib = { CUDA0 = 0 }"},
        "memory.device_total_mib.CUDA0",
        "greater than 0",
        at="device_total_mib",
    ),
    Case(
        "decay-ratio-1",
        {"decay_ratio = 0.8": "decay_ratio = 1.0"},
        "health.decay_ratio",
        "less than 1",
        at="decay_ratio",
    ),
    Case(
        "dotted-key-range",
        {
            "[server.sampling]\ntemperature = 0.6       # low for code\ntop_p = 0.95\ntop_k = 20\n": "",
            'load_mode = "mmap"': 'load_mode = "mmap"\nsampling.top_k = 5000',
        },
        "server.sampling.top_k",
        "less than or equal to 1000 (got 5000)",
        at="sampling.top_k",
    ),
    Case(
        "inline-table-type",
        {"[models.draft]\n": '[models.draft]\nextra = { devices = "CUDA0" }\n'},
        "models.draft.extra",
        "unknown key",
        at="extra = {",
    ),
    # --- unknown keys, with did-you-mean ---
    Case(
        "top-level-typo",
        {FIRST_LINE: f"servr = 1\n{FIRST_LINE}"},
        "servr",
        "unknown key",
        "did you mean 'server'?",
        "servr = 1",
    ),
    Case(
        "n-maxx",
        {"n_max = 6 ": "n_maxx = 6 "},
        "speculative.n_maxx",
        "unknown key",
        "did you mean 'n_max'?",
        "n_maxx",
    ),
    Case(
        "nested-cache-typo",
        {DRAFT_CACHE: DRAFT_CACHE.replace("cache_type_k", "cache_type_kk")},
        "models.draft.cache_type_kk",
        "unknown key",
        "did you mean 'cache_type_k'?",
        "cache_type_kk",
    ),
    Case(
        "sampling-typo",
        {"temperature = 0.6": "temprature = 0.6"},
        "server.sampling.temprature",
        "unknown key",
        "did you mean 'temperature'?",
        "temprature",
    ),
    Case(
        "short-key",
        {"labels = { appliance": "scrape_interval = 15\nlabels = { appliance"},
        "prometheus.scrape_interval",
        "unknown key",
        "did you mean 'scrape_interval_seconds'?",
        "scrape_interval = 15",
    ),
    Case(
        "unknown-no-match",
        {"interval_seconds = 30": "interval_seconds = 30\nbogus = { a = 1 }"},
        "health.bogus",
        "unknown key",
        "known keys here: acceptance_min, baseline_file",
        "bogus =",
    ),
    Case(
        # pydantic names union branches "float", "int", ...: a key so named is still the user's key.
        "key-named-int",
        {FIRST_LINE: f"int = 1\n{FIRST_LINE}"},
        "int",
        "unknown key",
        "known keys here: cost, engine, fallback, fleet, health, memory, models",
        "int = 1",
    ),
    Case(
        "table-typo",
        {"[models.target]": "[models.targt]"},
        "models.targt",
        "unknown key",
        "did you mean 'target'?",
        "[models.targt]",
        errors=2,  # and models.target is missing
    ),
    # --- missing required keys ---
    Case(
        "missing-target",
        {},
        "models.target",
        "required but missing",
        "add 'target = ...' to [models]",
        edit=_drop_table("models.target"),
    ),
    Case(
        "missing-target-path",
        {},
        "models.target.path",
        "required but missing",
        "add 'path = ...' to [models.target]",
        "[models.target]",
        edit=_drop_line('path = "'),  # the first path is the target's
    ),
    # --- literals ---
    Case(
        "flash-attn-maybe",
        {'flash_attn = "on"': 'flash_attn = "maybe"'},
        "server.flash_attn",
        "Input should be 'auto', 'on' or 'off' (got 'maybe')",
        "use one of 'auto', 'on' or 'off'",
        "flash_attn",
    ),
    Case(
        "cache-q3_0",
        {TARGET_CACHE: TARGET_CACHE.replace('k = "q8_0"', 'k = "q3_0"')},
        "models.target.cache_type_k",
        "(got 'q3_0')",
        "'q8_0'",
        'cache_type_k = "q3_0"',
    ),
    Case(
        "load-mode-mlockk",
        {'load_mode = "mmap"': 'load_mode = "mlockk"'},
        "server.load_mode",
        "(got 'mlockk')",
        "'mmap+mlock'",
        "load_mode",
    ),
    Case(
        "egress-block",
        {'egress = "deny"': 'egress = "block"'},
        "network.egress",
        "Input should be 'deny' or 'allow'",
        at="egress",
    ),
    Case(
        "speculative-type-word",
        {'type = "draft-simple"': 'type = "draft"'},
        "speculative.type",
        "built-in llama-server-0c1e570.help.txt has no speculation type 'draft'; it lists draft-dflash, draft-dspark, draft-eagle3, ",
        "several as a list",
        'type = "draft"',
    ),
    Case(
        "on-mismatch-abort",
        {'on_mismatch = "warn"': 'on_mismatch = "abort"'},
        "versions.on_mismatch",
        "'refuse' or 'warn'",
        at="on_mismatch",
    ),
    # --- field validators ---
    Case(
        "cidr-host-bits",
        {'allow = ["127.0.0.0/8"': 'allow = ["127.0.0.1/8"'},
        "network.allow",
        "'127.0.0.1/8' is not a network in CIDR form",
        at="allow =",
    ),
    Case(
        "cidr-prefix-33",
        {'allow = ["127.0.0.0/8"': 'allow = ["10.0.0.0/33"'},
        "network.allow",
        "'10.0.0.0/33' is not a network in CIDR form",
        at="allow =",
    ),
    Case(
        "host-name",
        {'host = "127.0.0.1"': 'host = "example.com"'},
        "server.host",
        "'example.com' is not an IP address",
        at='host = "example.com"',
    ),
    Case(
        "cors-wildcard",
        {'host = "127.0.0.1"': 'host = "127.0.0.1"\ncors_origins = ["*"]'},
        "server.cors_origins",
        "'*' is not a web origin; write the one origin of the web UI that calls the API",
        at="cors_origins =",
    ),
    Case(
        "cors-not-canonical",
        {'host = "127.0.0.1"': 'host = "127.0.0.1"\ncors_origins = ["https://UI.example:443/"]'},
        "server.cors_origins",
        "'https://UI.example:443/' is never sent by a browser as an Origin; write it as 'https://ui.example'",
        at="cors_origins =",
    ),
    Case(
        "cors-two-origins",
        {'host = "127.0.0.1"': 'host = "127.0.0.1"\ncors_origins = ["https://a.example", "https://b.example"]'},
        "server.cors_origins",
        "browsers refuse a list there",
        at="cors_origins =",
    ),
    Case(
        "alias-with-a-comma",
        {LOOPBACK: f'{LOOPBACK}\nalias = "qwen, coder"'},
        "server.alias",
        "'qwen, coder' cannot name the model: write one name without commas or surrounding spaces, "
        'e.g. "qwen3-27b-coder"; clients send it as their `model`',
        at='alias = "qwen, coder"',
    ),
    Case(
        "alias-blank",
        {LOOPBACK: f'{LOOPBACK}\nalias = " "'},
        "server.alias",
        "' ' cannot name the model",
        at='alias = " "',
    ),
    Case(
        "log-level",
        {LOOPBACK: f'{LOOPBACK}\nlog_level = "quiet"'},
        "server.log_level",
        "'error', 'warning', 'info', 'trace' or 'debug'",
        at='log_level = "quiet"',
    ),
    Case(
        "device-name",
        {'devices = ["CUDA0"]\ngpu_layers = "all"\n#': 'devices = ["cuda:0"]\ngpu_layers = "all"\n#'},
        "models.target.devices",
        "'cuda:0' is not a llama.cpp device name",
        at='devices = ["cuda:0"]',
    ),
    Case(
        "label-name-dash",
        {'labels = { appliance = "workstation" }': 'labels = { "bad-label" = "x" }'},
        "prometheus.labels",
        "'bad-label' is not a Prometheus label name",
        at="labels =",
    ),
    Case(
        "label-name-reserved",
        {'labels = { appliance = "workstation" }': 'labels = { __name__ = "x" }'},
        "prometheus.labels",
        "'__name__' is not a Prometheus label name",
        at="labels =",
    ),
    Case(
        "schedule-blank",
        {'schedule = "*-*-* 04:00:00"': 'schedule = "  "'},
        "restart.schedule",
        "one systemd OnCalendar expression",
        at="schedule",
    ),
    Case(
        "schedule-systemd-cannot-read",
        {'schedule = "*-*-* 04:00:00"': 'schedule = "whenever it suits"'},
        "restart.schedule",
        "systemd cannot read 'whenever it suits' as a calendar: Failed to parse calendar specification",
        "systemd-analyze calendar",
        at="schedule",
    ),
    Case(
        "schedule-with-a-specifier",
        {'schedule = "*-*-* 04:00:00"': 'schedule = "*-*-* %H:00"'},
        "restart.schedule",
        "one systemd OnCalendar expression",
        at="schedule",
    ),
    Case(
        "schedule-with-a-line-separator",
        {'schedule = "*-*-* 04:00:00"': 'schedule = "daily\u2028[Service]"'},
        "restart.schedule",
        "holds \\u2028",
        at="schedule",
    ),
    Case(
        "version-pin-with-a-newline",
        {"[versions]\n": '[versions]\nllama_cpp = "b1234\\nExecStartPre=/bin/sh"\n'},
        "versions.llama_cpp",
        "holds \\n",
        at="llama_cpp",
    ),
    Case(
        "exporter-host-a-name",
        {PROMETHEUS: f'{PROMETHEUS}host = "metrics.example"\n'},
        "prometheus.host",
        "'metrics.example' is not an IP address",
        at='host = "metrics',
    ),
    Case(
        "model-the-service-user-cannot-read",
        {TARGET_PATH: 'path = "$OUTSIDE/private/target.gguf"'},
        "models.target.path",
        "llm-appliance, the user the units run as, cannot read",
        "chgrp llm-appliance",
        at="private/target.gguf",
    ),
    Case(
        "model-under-a-home-with-a-colon",
        {TARGET_PATH: 'path = "$HOME_DIR/a:b.gguf"'},
        "models.target.path",
        "which systemd cannot bind back into them (BindReadOnlyPaths=)",
        "rename it without :",
        at="a:b.gguf",
    ),
    # --- the units' PrivateTmp= hides /tmp and /var/tmp, and boot empties them: refused, never bound ---
    Case(
        "model-in-tmp",
        {TARGET_PATH: 'path = "$TMP/in-tmp.gguf"'},
        "models.target.path",
        "is in a temporary directory (/tmp): the units do not see it (PrivateTmp= gives each its own",
        "move it to /var/lib/llm-appliance/models/ and set models.target.path to where it is then",
        at="in-tmp.gguf",
    ),
    Case(
        "model-linked-into-tmp",
        {TARGET_PATH: 'path = "$OUTSIDE/into-tmp.gguf"'},
        "models.target.path",
        "into-tmp.gguf leads to /tmp/",
        "move it to /var/lib/llm-appliance/models/",
        at="into-tmp.gguf",
    ),
    Case(
        "baseline-in-var-tmp",
        {"[health]\n": '[health]\nbaseline_file = "/var/tmp/llm-appliance-baseline.json"\n'},
        "health.baseline_file",
        "/var/tmp/llm-appliance-baseline.json is in a temporary directory (/var/tmp)",
        "move it to /var/lib/llm-appliance/state/",
        at="llm-appliance-baseline.json",
    ),
    # --- checks across fields ---
    Case(
        "n-min-above-n-max",
        {"n_min = 3": "n_min = 7"},
        "speculative.n_min",
        "n_min 7 is above n_max 6",
        "at most 6",
        "n_min = 7",
    ),
    Case(
        "port-clash",
        {"port = 9478": "port = 0x1F90"},  # 8080, written so that the exporter's line is told apart
        "prometheus.port",
        "would both listen on port 8080",
        "prometheus.port = ",
        "port = 0x1F90",
    ),
    Case(
        "network-host-without-key",
        {'host = "127.0.0.1"': 'host = "0.0.0.0"'},
        "server.api_key_file",
        "server.host 0.0.0.0 is reachable from the network but no API key is set",
        "api_key_file",
        "[server]",
    ),
    Case(
        "network-host-without-allow",
        {'host = "127.0.0.1"': 'host = "::"\napi_key_file = "$KEYS/api.key"', NETWORK_ALLOW: "[network]\n"},
        "network.allow",
        "server.host :: listens beyond loopback but no client networks are allowed",
        "allow = [",
        "[network]",
    ),
    Case(
        "api-key-file-missing",
        {'host = "127.0.0.1"': 'host = "127.0.0.1"\napi_key_file = "$BROKEN/no-such.key"'},
        "server.api_key_file",
        "no-such.key does not exist",
        "install -m 0640 -o root -g llm-appliance /dev/null",
        "api_key_file",
    ),
    # --- the key files, as their readers read them: the server (as the service user) and Prometheus ---
    Case(
        "api-key-file-of-root-alone",
        api_key("root-only.key"),
        "server.api_key_file",
        "its group is root, not llm-appliance. The server reads it as llm-appliance: it must be root:llm-appliance",
        "chown root:llm-appliance",
        "api_key_file",
    ),
    Case(
        "api-key-file-world-readable",
        api_key("world.key"),
        "server.api_key_file",
        "mode 0644 opens it to every user on this machine",
        "chmod 0640",
        "api_key_file",
    ),
    Case(
        "api-key-file-group-writable",
        api_key("group-writable.key"),
        "server.api_key_file",
        "mode 0660 lets llm-appliance rewrite the keys",
        "chmod 0640",
        "api_key_file",
    ),
    # -- [fleet]: the peers prove their /ready with the fleet's key --
    Case(
        "fleet-peers-without-key",
        {SPECULATIVE_END: SPECULATIVE_END + FLEET},
        "fleet",
        "could block every restart or fake a peer's readiness; create one key for the fleet",
        "",
        "[fleet]",
    ),
    Case(
        "fleet-key-world-readable",
        {SPECULATIVE_END: SPECULATIVE_END + FLEET + 'key_file = "$KEYS/fleet-world.key"\n'},
        "fleet.key_file",
        "mode 0644 opens it to every user on this machine",
        "chmod 0640",
        "key_file",
    ),
    Case(
        "fleet-key-too-short",
        {SPECULATIVE_END: SPECULATIVE_END + FLEET + 'key_file = "$KEYS/api.key"\n'},
        "fleet.key_file",
        "must hold one key of 16 characters or more, on one line",
        "openssl rand -hex 32",
        "key_file",
    ),
    Case(
        "api-key-file-in-a-closed-directory",
        {LOOPBACK: f'{LOOPBACK}\napi_key_file = "$CLOSED/closed.key"'},
        "server.api_key_file",
        "llm-appliance cannot read",
        "keep the key file in a directory llm-appliance may enter",
        "api_key_file",
    ),
    # -- [fallback] and private code --
    Case(
        "fallback-for-private-code",
        {'egress = "deny"': 'egress = "deny"\nprivate = true'},
        "fallback",
        "network.private = true forbids a fallback: a request the local server cannot serve would be sent to",
        "remove [fallback], or set network.private = false",
        "[fallback]",
        base="demo-fallback.toml",
    ),
    Case(
        "private-with-egress-allowed",
        {'egress = "deny"': 'egress = "allow"\nprivate = true'},
        "network.egress",
        'is "allow" with network.private = true',
        'set egress = "deny"',
        "egress =",
        base="demo.toml",
    ),
    Case(
        "fallback-url-not-http",
        {'base_url = "http://192.0.2.10:8000/v1"': 'base_url = "ftp://192.0.2.10/v1"'},
        "fallback.base_url",
        "'ftp://192.0.2.10/v1' is not an http(s) URL of an OpenAI-compatible API; write e.g. https://",
        "",
        "base_url",
        base="demo-fallback.toml",
    ),
    Case(
        "fallback-by-name-with-egress-denied",
        {'base_url = "http://192.0.2.10:8000/v1"': 'base_url = "https://api.example.com/v1"'},
        "fallback.base_url",
        "names the host 'api.example.com': with network.egress = \"deny\" the router may dial exactly",
        "write the upstream's IP address in the URL",
        "base_url",
        base="demo-fallback.toml",
    ),
    Case(
        "fallback-without-the-router-installed",
        {},
        "fallback",
        "the router's unit would not start: this machine lacks its virtualenv /opt/llm-appliance/router",
        "run `llm-appliance router-install`",
        "[fallback]",
        base="demo-fallback.toml",
        facts=dataclasses.replace(
            EXAMPLE_FACTS["demo-fallback.toml"],
            router_missing="its virtualenv /opt/llm-appliance/router (LiteLLM's proxy) and its user llm-appliance-router",
        ),
    ),
    Case(
        "fallback-on-the-exporters-port",
        {"port = 8000 ": "port = 9478 "},
        "fallback.port",
        "the router would listen on prometheus.port 9478",
        "fallback.port = 9479",
        "port = 9478 ",
        base="demo-fallback.toml",
    ),
    Case(
        "fallback-key-the-router-cannot-read",
        {'# api_key_file = "/etc/llm-appliance/fallback-key"': 'api_key_file = "$KEYS/root-only.key"'},
        "fallback.api_key_file",
        "as llm-appliance-router, and cannot:",
        "chown root:llm-appliance-router",
        "api_key_file",
        base="demo-fallback.toml",
    ),
    Case(
        "fallback-key-llama-server-can-read",
        {'# api_key_file = "/etc/llm-appliance/fallback-key"': 'api_key_file = "$KEYS/api.key"'},
        "fallback.api_key_file",
        "llm-appliance (llama-server's user) can read",
        "chown root:llm-appliance-router",
        "api_key_file",
        base="demo-fallback.toml",
    ),
    Case(
        "api-key-file-without-a-key",
        api_key("empty.key"),
        "server.api_key_file",
        "holds no key (only empty lines and # comments): llama-server would ask no key of anyone",
        "one key per line",
        "api_key_file",
    ),
    Case(
        "api-key-with-white-space",
        api_key("spaced.key"),
        "server.api_key_file",
        "a key has leading or trailing white space",
        "remove the white space",
        "api_key_file",
    ),
    Case(
        "several-keys-without-a-scrape-key",
        api_key("two.keys"),
        "prometheus.scrape_key_file",
        "two.keys holds 2 keys, and the scrape job would send the whole file as one bearer token",
        "set prometheus.scrape_key_file",
        "[prometheus]",
    ),
    Case(
        "scrape-key-not-one-of-the-keys",
        scrape_key("two.keys", "stranger.key"),
        "prometheus.scrape_key_file",
        "is not one of the keys of server.api_key_file: llama-server would answer Prometheus 401",
        "one line of server.api_key_file",
        "scrape_key_file",
    ),
    Case(
        "scrape-key-of-two-lines",
        scrape_key("two.keys", "commented.key"),
        "prometheus.scrape_key_file",
        "holds more than one line: Prometheus sends the whole file as one bearer token",
        "the one key alone",
        "scrape_key_file",
    ),
    Case(
        "scrape-key-world-readable",
        scrape_key("two.keys", "scrape-world.key"),
        "prometheus.scrape_key_file",
        "mode 0644 gives the key to every user on this machine",
        "chmod 0640",
        "scrape_key_file",
    ),
    Case(
        "scrape-key-without-an-api-key",
        scrape_key(None, "scrape.key"),
        "prometheus.scrape_key_file",
        "is set, but server.api_key_file is not: llama-server asks no key",
        "remove prometheus.scrape_key_file",
        "scrape_key_file",
    ),
    Case(
        "quantized-v-without-flash-attn",
        {'flash_attn = "on"': 'flash_attn = "off"'},
        "models.target.cache_type_v",
        "a quantized V cache (q8_0) needs flash attention",
        'server.flash_attn = "auto"',
        'cache_type_v = "q8_0"',
        errors=2,  # the draft's V cache too
    ),
    # --- model files ---
    Case(
        "relative-path",
        {TARGET_PATH: 'path = "target-27b-Q4_K_M.gguf"'},
        "models.target.path",
        "target-27b-Q4_K_M.gguf is relative",
        "/var/lib/llm-appliance/models/target-27b-Q4_K_M.gguf",
        'path = "target',
    ),
    Case(
        "missing-file",
        {TARGET_PATH: 'path = "$MODELS/no-such-model.gguf"'},
        "models.target.path",
        "no-such-model.gguf: no such file",
        "whole .gguf file",
        "no-such-model",
    ),
    Case(
        "missing-draft-file",
        {DRAFT_PATH: 'path = "$MODELS/no-such-draft.gguf"'},
        "models.draft.path",
        "no-such-draft.gguf: no such file",
        at="no-such-draft",
    ),
    Case(
        "random-bytes",
        {TARGET_PATH: 'path = "$BROKEN/random.gguf"'},
        "models.target.path",
        "random.gguf: not a GGUF file: starts with",
        at="random.gguf",
    ),
    Case(
        "truncated-gguf",
        {TARGET_PATH: 'path = "$BROKEN/truncated.gguf"'},
        "models.target.path",
        "truncated: its tensors need",
        "re-copy",
        "truncated.gguf",
    ),
    Case(
        "header-cut-short",
        {DRAFT_PATH: 'path = "$BROKEN/header.gguf"'},
        "models.draft.path",
        "corrupt or truncated GGUF header",
        at="header.gguf",
    ),
    Case(
        "empty-file",
        {TARGET_PATH: 'path = "$BROKEN/empty.gguf"'},
        "models.target.path",
        "not a GGUF file: only 0 bytes",
        at="empty.gguf",
    ),
    Case(
        "directory",
        {TARGET_PATH: 'path = "$BROKEN/model-dir"'},
        "models.target.path",
        "is a directory",
        at="model-dir",
    ),
    Case(
        "file-as-directory",
        {TARGET_PATH: 'path = "$BROKEN/random.gguf/model.gguf"'},
        "models.target.path",
        "cannot be read: Not a directory",
        at="random.gguf/model.gguf",
    ),
    Case(
        "incompatible-vocabulary",
        {DEMO_DRAFT_PATH: '[models.draft]\npath = "$GEMMA3"'},
        "models.draft.path",
        "the draft's vocabulary is incompatible with the target's (vocab types differ: target BPE, draft SPM",
        "same tokenizer",
        "gemma-3-270m",
        base="demo-draft.toml",
    ),
    # --- the memory budget ---
    Case(
        "over-budget",
        {TARGET_CACHE: TARGET_CACHE.replace("q8_0", "f16"), DRAFT_CACHE: DRAFT_CACHE.replace("q8_0", "f16")},
        "server.ctx_size",
        "CUDA0 is over budget by ",
        "or less",
        "ctx_size = 32768",
    ),
    Case(
        "unknown-device-memory",
        {},
        "memory.device_total_mib.CUDA0",
        "cannot tell how much memory CUDA0 has: NVML: NVML Shared Library Not Found",
        "memory.device_total_mib = { CUDA0 = 24576 }",
        "[memory]",
        facts=gpu_facts(),
    ),
    Case(
        "second-gpu-missing",
        {},
        "memory.device_total_mib.CUDA1",
        "NVML lists no such GPU",
        "{ CUDA1 = 24576 }",
        "[memory]",
        base="dual-gpu.toml",
        facts=gpu_facts(24),
    ),
    # --- extra_args against the flag dialect ---
    Case(
        "extra-removed-flag",
        {'load_mode = "mmap"': 'load_mode = "mmap"\nextra_args = ["--draft-max", "8"]'},
        "server.extra_args[0]",
        "--draft-max was removed from llama-server",
        "set speculative.n_max in the spec instead",
        "extra_args",
    ),
    Case(
        "extra-unknown-flag",
        {'load_mode = "mmap"': 'load_mode = "mmap"\nextra_args = ["--frobnicate"]'},
        "server.extra_args[0]",
        "--frobnicate is not a flag of",
        "llama-server --help",
        "extra_args",
    ),
    Case(
        "extra-api-key",
        {'load_mode = "mmap"': 'load_mode = "mmap"\nextra_args = ["--api-key=hunter2"]'},
        "server.extra_args[0]",
        "--api-key puts the API key on the command line: in /proc/PID/cmdline, the journal and the snapshot",
        "set server.api_key_file instead",
        "extra_args",
    ),
    Case(
        "extra-api-key-file",
        {'load_mode = "mmap"': 'load_mode = "mmap"\nextra_args = ["--api-key-file", "/etc/keys"]'},
        "server.extra_args[0]",
        "--api-key-file in extra_args hides the key file from the health daemon and the scrape job",
        "set server.api_key_file instead",
        "extra_args",
    ),
    Case(
        "extra-planned-flag",
        {'load_mode = "mmap"': 'load_mode = "mmap"\nextra_args = ["--ctx-size", "4096"]'},
        "server.extra_args[0]",
        "--ctx-size is already set from the spec",
        "ctx_size",
        "extra_args",
    ),
    Case(
        "extra-planned-short-flag",
        {'load_mode = "mmap"': 'load_mode = "mmap"\nextra_args = ["--verbose", "-c", "4096"]'},
        "server.extra_args[1]",
        "-c is already set from the spec",
        at="extra_args",
    ),
    # --- extra_args: refused switches, and flags whose meaning is not known ---
    *(
        Case(f"extra-refused{args[0]}", _extra_args(args), "server.extra_args[0]", reason, fix, "extra_args")
        for args, reason, fix in REFUSED_SWITCHES
    ),
    Case(
        "extra-refused-even-marked",
        _extra_args(["--threads-batch", "4", "--tools", "all"], ["--tools"]),
        "server.extra_args[2]",
        "--tools opens POST /tools to every API client",
        "remove it (server.extra_args_unchecked does not accept it)",
        "extra_args =",
    ),
    Case(
        "extra-meaning-unknown",
        _extra_args(["--lora-init-without-apply"]),
        "server.extra_args[0]",
        "llm-appliance does not know what --lora-init-without-apply does",
        'mark it: server.extra_args_unchecked = ["--lora-init-without-apply"]',
        "extra_args",
    ),
    Case(
        "extra-unknown-behind-a-value",
        _extra_args(["--tags", "--webui-mcp-proxy"]),
        "server.extra_args[1]",
        "--webui-mcp-proxy makes the server an HTTP fetcher",
        at="extra_args",
    ),
    Case(
        "extra-unchecked-not-a-flag",
        _extra_args(["--lora-init-without-apply"], ["--lora-init-without-apply=1"]),
        "server.extra_args_unchecked.0",
        "is not a llama-server flag's name",
        at="extra_args_unchecked",
    ),
    # --- [cost] ---
    Case(
        "cost-without-lifetime",
        {"lifetime_years = 4\n": ""},
        "cost",
        "hardware_price needs the hardware's lifetime; set lifetime_years (or lifetime_hours)",
        at="[cost]",
    ),
    Case(
        "cost-two-lifetimes",
        {"lifetime_years = 4": "lifetime_years = 4\nlifetime_hours = 20000"},
        "cost",
        "states the lifetime twice; keep lifetime_years or lifetime_hours",
        at="[cost]",
    ),
    Case(
        "cost-no-price",
        {"price_per_kwh = 0.30\nhardware_price = 3500.0": "utilization = 0.5"},
        "cost",
        "states no price; set price_per_kwh, or hardware_price with its lifetime_years",
        at="[cost]",
        edit=lambda text: text.replace("lifetime_years = 4\n", ""),
    ),
    Case(
        "cost-negative-price",
        {"price_per_kwh = 0.30": "price_per_kwh = -0.30"},
        "cost.price_per_kwh",
        "greater than or equal to 0",
        "ge 0",
        "price_per_kwh",
    ),
    Case(
        "cost-utilization-above-one",
        {"lifetime_years = 4": "lifetime_years = 4\nutilization = 1.5"},
        "cost.utilization",
        "less than or equal to 1",
        at="utilization = 1.5",
    ),
    Case(
        "cost-price-string",
        {"hardware_price = 3500.0": 'hardware_price = "3500 EUR"'},
        "cost.hardware_price",
        "valid number",
        "a number",
        "hardware_price",
    ),
    Case(
        "cost-unknown-key",
        {"lifetime_years = 4": "lifetime_yrs = 4"},
        "cost.lifetime_yrs",
        "unknown key",
        "did you mean 'lifetime_years'?",
        "lifetime_yrs",
    ),
    # --- the file itself ---
    Case(
        "syntax-unterminated-string",
        {'load_mode = "mmap"': 'load_mode = "mmap'},
        "(syntax)",
        "not valid TOML",
        "fix the TOML syntax",
        'load_mode = "mmap',
    ),
    Case(
        "syntax-duplicate-key",
        {"n_min = 3": "n_min = 3\nn_max = 4"},
        "(syntax)",
        "not valid TOML: Cannot overwrite a value",
        at="n_max = 4",
    ),
    Case(
        "not-utf8",
        {},
        "(file)",
        "not UTF-8 text",
        "save the spec as UTF-8",
        raw=lambda data: data.replace(b"workstation", b"work\xffstation"),
    ),
    # --- speculation types and their own parameters ---
    Case(
        "speculative-type-unknown-in-list",
        {'type = "draft-simple"': 'type = ["draft-simple", "ngram-magic"]'},
        "speculative.type",
        "has no speculation type 'ngram-magic'; it lists draft-dflash, draft-dspark, draft-eagle3, ",
        "several as a list",
        'type = ["draft-simple", "ngram-magic"]',
    ),
    Case(
        "speculative-type-twice",
        {'type = "draft-simple"': 'type = ["draft-simple", "draft-simple"]'},
        "speculative.type",
        "names draft-simple more than once",
        at='type = ["draft-simple", "draft-simple"]',
    ),
    Case(
        "speculative-none-combined",
        {'type = "draft-simple"': 'type = "none,ngram-mod"'},
        "speculative.type",
        '"none" turns speculation off and cannot be combined',
        at='type = "none,ngram-mod"',
    ),
    Case(
        "speculative-type-not-in-dialect",
        {'type = "draft-simple"': 'type = ["draft-simple", "ngram-mod"]'},
        "speculative.type",
        "a llama-server without ngram-mod has no speculation type 'ngram-mod'",
        at='type = ["draft-simple", "ngram-mod"]',
        facts=dataclasses.replace(gpu_facts(24), dialect=WITHOUT_NGRAM_MOD),
    ),
    Case(
        "ngram-mod-unknown-key",
        {SPECULATIVE_END: f"{SPECULATIVE_END}\n[speculative.ngram_mod]\nn_matchh = 32\n"},
        "speculative.ngram_mod.n_matchh",
        "unknown key",
        "did you mean 'n_match'?",
        "n_matchh = 32",
    ),
    Case(
        "ngram-mod-n-match-0",
        {SPECULATIVE_END: f"{SPECULATIVE_END}\n[speculative.ngram_mod]\nn_match = 0\n"},
        "speculative.ngram_mod.n_match",
        "greater than or equal to 1",
        at="n_match = 0",
    ),
    Case(
        "ngram-mod-n-min-above-n-max",
        {
            'type = "draft-simple"': 'type = ["draft-simple", "ngram-mod"]',
            SPECULATIVE_END: f"{SPECULATIVE_END}\n[speculative.ngram_mod]\nn_min = 60\nn_max = 50\n",
        },
        "speculative.ngram_mod.n_min",
        "n_min 60 is above n_max 50",
        "set n_min to at most n_max",
        "n_min = 60",
    ),
    Case(
        "ngram-mod-n-min-above-the-default-n-max",
        {
            'type = "draft-simple"': 'type = ["draft-simple", "ngram-mod"]',
            SPECULATIVE_END: f"{SPECULATIVE_END}\n[speculative.ngram_mod]\nn_min = 70\n",
        },
        "speculative.ngram_mod.n_min",
        "n_min 70 is above n_max 64 (the unset one is the engine's default)",
        at="n_min = 70",
    ),
    Case(
        "ngram-flag-not-in-dialect",
        {
            'type = "draft-simple"': 'type = ["draft-simple", "ngram-mod"]',
            SPECULATIVE_END: f"{SPECULATIVE_END}\n[speculative.ngram_mod]\nn_min = 8\nn_match = 16\n",
        },
        "speculative.ngram_mod.n_match",
        "a llama-server without n_match accepts none of --spec-ngram-mod-n-match",
        "engine install",
        "n_match = 16",
        facts=dataclasses.replace(gpu_facts(24), dialect=WITHOUT_N_MATCH),
    ),
    Case(
        "extra-args-spec-synth",
        {'load_mode = "mmap"': 'load_mode = "mmap"\nextra_args = ["--spec-synth-len", "3"]'},
        "server.extra_args[0]",
        "--spec-synth-len is benchmark-only: it fakes acceptance",
        "remove it",
        "extra_args",
    ),
    Case(
        "extra-args-ngram-flag-from-the-spec",
        {
            'type = "draft-simple"': 'type = ["draft-simple", "ngram-mod"]',
            SPECULATIVE_END: f"{SPECULATIVE_END}\n[speculative.ngram_mod]\nn_match = 16\n",
            'load_mode = "mmap"': 'load_mode = "mmap"\nextra_args = ["--spec-ngram-mod-n-match=8"]',
        },
        "server.extra_args[0]",
        "--spec-ngram-mod-n-match is already set from the spec",
        "spec_ngram_mod_n_match",
        "extra_args",
    ),
]

WARNINGS = [
    Case(
        "extra-unchecked-not-passed",
        _extra_args(["--threads-batch", "4"], ["--lora-init-without-apply"]),
        "server.extra_args_unchecked[0]",
        "lists --lora-init-without-apply, which server.extra_args does not pass: it does nothing",
        "remove it",
        "extra_args_unchecked",
    ),
    Case(
        "draft-with-ngram",
        {'type = "draft-simple"': 'type = "ngram-simple"'},
        "speculative.type",
        "a draft model is configured but type is 'ngram-simple'",
        "remove [models.draft]",
        'type = "ngram-simple"',
    ),
    Case(
        "draft-with-type-none",
        {'type = "draft-simple"': 'type = "none"'},
        "speculative.type",
        "type is 'none', which never uses it",
        at='type = "none"',
    ),
    Case(
        "n-max-20",
        {"n_max = 6 ": "n_max = 20 "},
        "speculative.n_max",
        "K = 20 drafts more tokens than a draft usually gets accepted",
        at="n_max = 20",
    ),
    Case(
        "ctx-above-trained",
        {
            "ctx_size = 32768": "ctx_size = 65536",
            TARGET_CACHE: TARGET_CACHE.replace("q8_0", "q4_0"),
            DRAFT_CACHE: DRAFT_CACHE.replace("q8_0", "q4_0"),
        },
        "server.ctx_size",
        "65536 is above the target's trained context of 40960 tokens",
        "at most 40960",
        "ctx_size = 65536",
    ),
    Case(
        "draft-quantization-mismatch",
        {DRAFT_PATH: 'path = "$SMOLLM2"'},
        "models.draft.path",
        "the draft is Q4_1 but the target is Q4_K_M",
        "use a Q4_K_M build of the draft",
        "SmolLM2",
    ),
    Case(
        "draft-partly-offloaded",
        {'gpu_layers = "all"      #': "gpu_layers = 10      #"},
        "models.draft.gpu_layers",
        "the draft is not fully offloaded (10 of 28 layers)",
        'gpu_layers = "all"',
        "gpu_layers = 10",
    ),
    Case(
        "kv-types-differ-on-cuda",
        {TARGET_CACHE: TARGET_CACHE.replace('v = "q8_0"', 'v = "q4_0"')},
        "models.target.cache_type_k",
        "K cache q8_0 and V cache q4_0 differ",
        "use the same type for both",
        'cache_type_k = "q8_0"',  # the first one in the file, the target's
    ),
    Case(
        "draft-type-without-draft",
        {},
        "models.draft",
        "speculative.type is 'draft-simple' but no draft model is configured",
        'speculative.type = "none"',
        base="demo-draft.toml",
        edit=_drop_table("models.draft"),
    ),
    Case(
        "small-slots",
        {"parallel = 1": "parallel = 4"},
        "server.parallel",
        "each of 4 slots gets only 1024 tokens of context",
        at="parallel = 4",
        base="demo-draft.toml",
    ),
    Case(
        "ngram-table-for-a-type-not-used",
        {SPECULATIVE_END: f"{SPECULATIVE_END}\n[speculative.ngram_simple]\nsize_n = 8\n"},
        "speculative.ngram_simple",
        "[speculative.ngram_simple] is set but speculative.type 'draft-simple' does not use ngram-simple: it does nothing",
        "add 'ngram-simple' to speculative.type",
        "[speculative.ngram_simple]",
    ),
    Case(
        "draft-and-ngram-types-without-draft",
        {'type = "draft-simple"': 'type = ["draft-simple", "ngram-mod"]'},
        "models.draft",
        "speculative.type is 'draft-simple,ngram-mod' but no draft model is configured: only ngram-mod speculates",
        'speculative.type = "ngram-mod"',
        base="demo-draft.toml",
        edit=_drop_table("models.draft"),
    ),
]


@pytest.fixture(scope="module")
def bad_files(smollm2: Path, outside_tmp: Path, home_dir: Path, fixture_models: Path, in_tmp: Path) -> Path:
    """Broken model files; in $CLOSED a key file in a directory the service user cannot enter, in $OUTSIDE a
    model only root may read and a link into $TMP, in $HOME_DIR one whose name systemd cannot bind."""
    # Not in pytest's tmp_path: a file in /tmp has an error of its own (the units' PrivateTmp= hides it).
    directory = outside_tmp / "bad-files"
    directory.mkdir(mode=0o755)
    closed = outside_tmp / "closed"
    closed.mkdir(mode=0o700, exist_ok=True)
    private = outside_tmp / "private"
    private.mkdir(mode=0o755, exist_ok=True)
    shutil.copy(smollm2, private / "target.gguf")  # the 27B fixture is sparse: a copy would fill the disk
    (private / "target.gguf").chmod(0o600)
    shutil.copy(smollm2, home_dir / "a:b.gguf")
    (directory / "random.gguf").write_bytes(random.Random(1).randbytes(4096))
    with smollm2.open("rb") as whole:
        head = whole.read(3 << 20)  # SmolLM2's whole header (vocabulary included) and the first tensors
    assert len(head) == 3 << 20
    (directory / "truncated.gguf").write_bytes(head)
    (directory / "header.gguf").write_bytes(head[:30])
    (directory / "empty.gguf").write_bytes(b"")
    (directory / "model-dir").mkdir()
    (closed / "closed.key").write_text("secret\n")
    os.chown(closed / "closed.key", 0, SERVICE.gid if SERVICE else 0)
    (closed / "closed.key").chmod(0o640)
    (outside_tmp / "into-tmp.gguf").symlink_to(in_tmp / "in-tmp.gguf")
    return directory


@pytest.fixture(scope="module")
def in_tmp(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> Path:
    """$TMP: a directory in /tmp, holding a whole model anyone may read (in-tmp.gguf)."""
    directory = tmp_path_factory.mktemp("in-tmp")
    shutil.copy(smollm2, directory / "in-tmp.gguf")
    (directory / "in-tmp.gguf").chmod(0o644)
    return directory


@pytest.fixture(scope="module")
def key_files(key_file: KeyFile) -> Path:
    """Key files, good and bad, in one directory the service user may enter."""
    good = key_file("secret", name="api.key")
    directory = good.parent
    group = SERVICE.gid if SERVICE else 0
    for name, text, mode, owner_group in (
        ("two.keys", "k-one\nk-two\n", 0o640, group),
        ("scrape.key", "k-two\n", 0o640, 0),
        ("stranger.key", "k-three\n", 0o640, 0),
        ("commented.key", "# the key Prometheus sends\nk-two\n", 0o640, 0),
        ("scrape-world.key", "k-two\n", 0o644, 0),
        ("root-only.key", "secret\n", 0o640, 0),
        ("world.key", "secret\n", 0o644, group),
        ("group-writable.key", "secret\n", 0o660, group),
        ("empty.key", "# no key yet\n\n", 0o640, group),
        ("spaced.key", "k-one \n", 0o640, group),
        ("fleet-world.key", "a-fleet-key-long-enough\n", 0o644, group),
    ):
        (directory / name).write_text(text)
        os.chown(directory / name, 0, owner_group)
        (directory / name).chmod(mode)
    return directory


def written(
    case: Case,
    example: Callable[..., Path],
    tmp: Path,
    models: Path,
    smollm2: Path,
    gemma3: Path,
    keys: Path,
    places: dict[str, Path],
) -> tuple[Path, str]:
    def fill(text: str) -> str:
        return (
            text.replace("$MODELS", str(models))
            .replace("$BROKEN", str(tmp))
            .replace("$TMP", str(places["$TMP"]))
            .replace("$CLOSED", str(places["$OUTSIDE"] / "closed"))
            .replace("$OUTSIDE", str(places["$OUTSIDE"]))
            .replace("$HOME_DIR", str(places["$HOME_DIR"]))
            .replace("$KEYS", str(keys))
            .replace("$SMOLLM2", str(smollm2))
            .replace("$GEMMA3", str(gemma3))
        )

    spec = example(case.base, replace={fill(old): fill(new) for old, new in case.edits.items()})
    text = spec.read_text()
    if case.edit:
        text = case.edit(text)
        spec.write_text(text)
    if case.raw:
        data = spec.read_bytes()
        changed = case.raw(data)
        assert changed != data
        spec.write_bytes(changed)
    return spec, text


def line_of(text: str, marker: str) -> int:
    """The first line whose TOML (not its comment) contains marker."""
    return next(number for number, line in enumerate(text.splitlines(), start=1) if marker in line.split("#")[0])


def facts_for(case: Case) -> MachineFacts:
    return case.facts or EXAMPLE_FACTS[case.base]


def the_problem(problems: list[Problem], case: Case) -> Problem:
    found = [p for p in problems if p.severity is case.severity and p.field == case.field]
    assert found, f"no {case.severity} on {case.field}:\n{format_problems(problems)}"
    matching = [p for p in found if case.message in p.message]
    assert matching, f"{case.field}: no message with {case.message!r}:\n{format_problems(found)}"
    return matching[0]


def check_located(problem: Problem, case: Case, spec: Path, text: str) -> None:
    assert problem.file == spec
    assert case.fix in problem.fix
    if case.at is not None:
        assert problem.line is not None, problem.render()
        assert problem.line == line_of(text, case.at), f"{problem.render()}\nexpected the line with {case.at!r}"
    rendered = problem.render()
    assert rendered.startswith(f"{spec}:{problem.line}: " if problem.line else f"{spec}: ")
    assert f": {case.severity.value}: {case.field}: " in rendered


def test_the_tables_are_what_they_claim() -> None:
    ids = [c.id for c in BAD + WARNINGS]
    assert len(set(ids)) == len(ids)
    assert len(BAD) >= 35
    assert all(c.severity is Severity.ERROR for c in BAD)


WriteCase = Callable[[Case], tuple[Path, str]]


@pytest.fixture
def write_case(
    example: Callable[..., Path],
    bad_files: Path,
    key_files: Path,
    fixture_models: Path,
    smollm2: Path,
    gemma3: Path,
    outside_tmp: Path,
    home_dir: Path,
    in_tmp: Path,
) -> WriteCase:
    """A case's spec written out, its placeholders filled: (path, text)."""
    places = {"$OUTSIDE": outside_tmp, "$HOME_DIR": home_dir, "$TMP": in_tmp}
    return lambda case: written(case, example, bad_files, fixture_models, smollm2, gemma3, key_files, places)


@pytest.mark.parametrize("name", sorted(EXAMPLE_FACTS))
def test_every_base_is_valid(example: Callable[..., Path], name: str) -> None:
    validate(example(name), facts=EXAMPLE_FACTS[name])


@pytest.mark.parametrize("case", BAD, ids=[c.id for c in BAD])
def test_bad_spec_is_refused(case: Case, write_case: WriteCase) -> None:
    spec, text = write_case(case)
    with pytest.raises(SpecInvalid) as caught:
        validate(spec, facts=facts_for(case))
    invalid = caught.value
    problem = the_problem(invalid.problems, case)
    check_located(problem, case, spec, text)
    assert len(invalid.errors) == case.errors, format_problems(invalid.problems)
    assert all(p.file == spec for p in invalid.problems)
    assert problem.render() in str(invalid)


@pytest.mark.parametrize("case", WARNINGS, ids=[c.id for c in WARNINGS])
def test_warning_leaves_the_spec_valid(case: Case, write_case: WriteCase) -> None:
    spec, text = write_case(case)
    result = validate(spec, facts=facts_for(case))
    case = dataclasses.replace(case, severity=Severity.WARNING)
    warning = the_problem(result.warnings, case)
    check_located(warning, case, spec, text)
    assert len(result.warnings) == 1, format_problems(result.warnings)


def test_a_flag_marked_unchecked_and_the_known_ones_reach_the_argv(example: Callable[..., Path]) -> None:
    args = ["--lora-init-without-apply", "--threads-batch", "4", "--no-webui", "--cache-ram=1024"]
    spec = example("appliance.toml", replace=_extra_args(args, ["--lora-init-without-apply"]))
    result = validate(spec, facts=EXAMPLE_FACTS["appliance.toml"])
    assert result.plan.argv[-len(args) :] == tuple(args)
    assert [p.field for p in result.warnings if p.field.startswith("server.extra_args")] == []


def test_syntax_error_line_is_the_broken_line(example: Callable[..., Path]) -> None:
    spec = example("appliance.toml")
    lines = spec.read_text().splitlines()
    for number in (1, 5, len(lines)):
        broken = [*lines]
        broken[number - 1] = "= no key here"
        spec.write_text("\n".join(broken) + "\n")
        with pytest.raises(SpecInvalid) as caught:
            validate(spec, facts=EXAMPLE_FACTS["appliance.toml"])
        (problem,) = caught.value.problems
        assert (problem.field, problem.line) == ("(syntax)", number)


def test_missing_spec_file(tmp_path: Path) -> None:
    with pytest.raises(SpecInvalid) as caught:
        validate(tmp_path / "nope.toml", facts=gpu_facts())
    (problem,) = caught.value.problems
    assert (problem.field, problem.message, problem.file) == ("(file)", "no such file", tmp_path / "nope.toml")


def test_every_error_is_reported_at_once(example: Callable[..., Path]) -> None:
    spec = example(
        "appliance.toml",
        replace={"port = 8080": "port = 0", "n_max = 6 ": "n_maxx = 6 ", 'egress = "deny"': 'egress = "block"'},
    )
    with pytest.raises(SpecInvalid) as caught:
        validate(spec, facts=EXAMPLE_FACTS["appliance.toml"])
    assert sorted(p.field for p in caught.value.errors) == ["network.egress", "server.port", "speculative.n_maxx"]


def test_over_budget_suggests_a_context_that_fits(example: Callable[..., Path]) -> None:
    f16 = {TARGET_CACHE: TARGET_CACHE.replace("q8_0", "f16"), DRAFT_CACHE: DRAFT_CACHE.replace("q8_0", "f16")}
    facts = EXAMPLE_FACTS["appliance.toml"]
    with pytest.raises(SpecInvalid) as caught:
        validate(example("appliance.toml", replace=f16), facts=facts)
    (problem,) = caught.value.errors
    match = re.search(r"server\.ctx_size = (\d+) or less", problem.fix)
    assert match, problem.fix
    fitting = int(match.group(1))
    assert 256 <= fitting < 32768 and fitting % 256 == 0
    # The suggestion fits, and one KV cell block more would not.
    validate(example("appliance.toml", replace={**f16, "ctx_size = 32768": f"ctx_size = {fitting}"}), facts=facts)
    with pytest.raises(SpecInvalid, match="over budget by"):
        validate(
            example("appliance.toml", replace={**f16, "ctx_size = 32768": f"ctx_size = {fitting + 256}"}),
            facts=facts,
        )


def test_a_key_file_cannot_be_checked_before_the_service_user_exists(
    example: Callable[..., Path], key_files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import appliance.plan.secrets

    monkeypatch.setattr(appliance.plan.secrets, "account", lambda *_: None)
    spec = example("appliance.toml", replace={LOOPBACK: f'{LOOPBACK}\napi_key_file = "{key_files}/root-only.key"'})
    result = validate(spec, facts=EXAMPLE_FACTS["appliance.toml"])
    [warning] = result.warnings
    assert (warning.field, warning.severity) == ("server.api_key_file", Severity.WARNING)
    assert "cannot check that llm-appliance can read" in warning.message
    assert "the user does not exist on this machine yet" in warning.message
    assert warning.fix.startswith("install.sh creates it; then: chown root:llm-appliance ")


def test_no_message_shows_a_key(example: Callable[..., Path], key_files: Path) -> None:
    edits = scrape_key("two.keys", "stranger.key")
    spec = example("appliance.toml", replace={k: v.replace("$KEYS", str(key_files)) for k, v in edits.items()})
    with pytest.raises(SpecInvalid) as caught:
        validate(spec, facts=EXAMPLE_FACTS["appliance.toml"])
    said = str(caught.value)
    assert "stranger.key" in said
    assert not [key for key in ("k-one", "k-two", "k-three") if key in said]
