"""Checks that need several fields of the spec but nothing outside it."""

from __future__ import annotations

import urllib.parse

from appliance.spec.address import ip_address
from appliance.spec.base import QUANTIZED_CACHE
from appliance.spec.load import LoadedSpec
from appliance.spec.model import Model, Spec
from appliance.spec.problems import Problem, error, warning
from appliance.spec.speculative import NgramMod, Speculative

FAST_N_MAX = 16
# ngram-mod's defaults in llama-server --help (pinned build 0c1e570): n_min 48, n_max 64.
NGRAM_MOD_N_MIN, NGRAM_MOD_N_MAX = 48, 64


def spec_problems(loaded: LoadedSpec) -> list[Problem]:
    spec = loaded.spec
    found = draft_length_problems(spec.speculative) + _draft_type_problems(spec) + _ngram_problems(spec.speculative)
    found += _exposure_problems(loaded) + _fallback_problems(spec) + _peer_problems(spec)
    for role, model in (("target", spec.models.target), ("draft", spec.models.draft)):
        if model is not None:
            found += _cache_problems(f"models.{role}", model, spec.server.flash_attn)
    return found


def _draft_type_problems(spec: Spec) -> list[Problem]:
    speculative = spec.speculative
    kind, drafting = speculative.type, speculative.draft_types
    # A name of neither family is the binary's to judge (plan/argv.py), not a type that never drafts.
    if spec.models.draft is not None and not drafting and all(n.startswith("ngram-") for n in speculative.types):
        return [
            # A warning: the server starts without it, and tune may measure that the draft does not pay.
            warning(
                "speculative.type",
                f"a draft model is configured but type is {kind!r}, which never uses it: it is not loaded",
                'set type = "draft-simple" (with n-gram types: ["draft-simple", ...]), or remove [models.draft]',
            )
        ]
    if spec.models.draft is None and drafting:
        others = [name for name in speculative.types if name not in drafting]
        effect = f"only {', '.join(others)} speculates" if others else "speculation is off"
        return [
            warning(
                "models.draft",
                f"speculative.type is {kind!r} but no draft model is configured: {effect}",
                "add [models.draft] with a same-family GGUF, or set speculative.type = "
                + (f"{_toml_types(others)}" if others else '"none"'),
            )
        ]
    return []


def _toml_types(types: list[str]) -> str:
    return f'"{types[0]}"' if len(types) == 1 else "[" + ", ".join(f'"{name}"' for name in types) + "]"


def _ngram_problems(speculative: Speculative) -> list[Problem]:
    """A sub-table for a type not used (it does nothing), and ngram-mod's n_min above its n_max."""
    found = []
    for table in speculative.ngram_tables():
        name = table.replace("_", "-")
        if name not in speculative.types:
            found.append(
                warning(
                    f"speculative.{table}",
                    f"[speculative.{table}] is set but speculative.type {speculative.type!r} does not use {name}: "
                    "it does nothing",
                    f"add {name!r} to speculative.type, or remove [speculative.{table}]",
                )
            )
    return found + _ngram_mod_length_problems(speculative.ngram_mod)


def _ngram_mod_length_problems(mod: NgramMod | None) -> list[Problem]:
    if mod is None or (mod.n_min is None and mod.n_max is None):
        return []
    # An unset one takes the engine's default, which the one set must still agree with.
    n_min = NGRAM_MOD_N_MIN if mod.n_min is None else mod.n_min
    n_max = NGRAM_MOD_N_MAX if mod.n_max is None else mod.n_max
    if n_min <= n_max:
        return []
    default = "" if mod.n_min is not None and mod.n_max is not None else " (the unset one is the engine's default)"
    return [
        error(
            f"speculative.ngram_mod.{'n_min' if mod.n_min is not None else 'n_max'}",
            f"n_min {n_min} is above n_max {n_max}{default}",
            f"set n_min to at most n_max (the engine's defaults: {NGRAM_MOD_N_MIN} and {NGRAM_MOD_N_MAX})",
        )
    ]


def _exposure_problems(loaded: LoadedSpec) -> list[Problem]:
    """Ports, the API key and the client networks: who can reach the server."""
    server, found = loaded.spec.server, []
    if server.port == loaded.spec.prometheus.port:
        found.append(
            error(
                "prometheus.port",
                f"the health exporter and llama-server would both listen on port {server.port}",
                f"choose another port, e.g. prometheus.port = {server.port + 1400}",
            )
        )
    if not server.host_is_loopback and server.api_key_file is None:
        found.append(
            error(
                "server.api_key_file",
                f"server.host {server.host} is reachable from the network but no API key is set",
                'set api_key_file to a file with one key per line (root:llm-appliance, mode 0640), or host = "127.0.0.1"',
            )
        )
    if not server.host_is_loopback and not loaded.key_lines.has("network.allow"):
        found.append(
            error(
                "network.allow",
                f"server.host {server.host} listens beyond loopback but no client networks are allowed",
                'list the client networks, e.g. allow = ["127.0.0.0/8", "192.168.1.0/24"]',
            )
        )
    if loaded.spec.prometheus.scrape_key_file is not None and server.api_key_file is None:
        found.append(
            error(
                "prometheus.scrape_key_file",
                "is set, but server.api_key_file is not: llama-server asks no key",
                "remove prometheus.scrape_key_file, or set server.api_key_file",
            )
        )
    return found


def _fallback_problems(spec: Spec) -> list[Problem]:
    """Private code never leaves the machine; the router's port is its own."""
    fallback, found = spec.fallback, []
    if spec.network.private and spec.network.egress != "deny":
        found.append(
            error(
                "network.egress",
                'is "allow" with network.private = true: private code must not be able to leave this machine',
                'set egress = "deny" (or private = false)',
            )
        )
    if fallback is None:
        return found
    if spec.network.private:
        found.append(
            error(
                "fallback",
                "network.private = true forbids a fallback: a request the local server cannot serve would be sent "
                f"to {fallback.base_url}",
                "remove [fallback], or set network.private = false for a spec whose code may leave the machine",
            )
        )
    host = urllib.parse.urlsplit(fallback.base_url).hostname or ""
    if spec.network.egress == "deny" and ip_address(host) is None:
        found.append(
            error(
                "fallback.base_url",
                f'names the host {host!r}: with network.egress = "deny" the router may dial exactly the upstream\'s '
                "address, which the ruleset must state (it cannot follow a name's DNS answers)",
                "write the upstream's IP address in the URL (keep the name for TLS in your notes), or set "
                'network.egress = "allow"',
            )
        )
    taken = {spec.server.port: "server.port", spec.prometheus.port: "prometheus.port"}
    if fallback.port in taken:
        found.append(
            error(
                "fallback.port",
                f"the router would listen on {taken[fallback.port]} {fallback.port}",
                f"choose another port, e.g. fallback.port = {max(taken) + 1}",
            )
        )
    return found


def _peer_problems(spec: Spec) -> list[Problem]:
    """With egress = "deny" the ruleset lets the health daemon dial each peer's address: one it must state.
    A name is for Kubernetes (turns = "eviction"), where the NetworkPolicy holds egress and no ruleset loads."""
    if spec.fleet is None or spec.network.egress != "deny" or spec.fleet.turns == "eviction":
        return []
    return [
        error(
            f"fleet.peers.{name}",
            f'names the host {host!r}: with network.egress = "deny" the ruleset lets the health daemon dial each '
            "peer's address, which it must state (it cannot follow a name's DNS answers)",
            "write the peer's IP address in the URL (`llm-appliance fleet render` does), or set "
            'network.egress = "allow"',
        )
        for name, url in spec.fleet.peers.items()
        if ip_address(host := urllib.parse.urlsplit(url).hostname or "") is None
    ]


def draft_length_problems(speculative: Speculative) -> list[Problem]:
    """n_min above n_max (an error), a longer draft than usually gets accepted (a warning); `tune` keeps its
    candidates to values without errors here."""
    found = []
    if speculative.n_min > speculative.n_max:
        found.append(
            error(
                "speculative.n_min",
                f"n_min {speculative.n_min} is above n_max {speculative.n_max}",
                f"set n_min to at most {speculative.n_max} (3 is typical)",
            )
        )
    if speculative.n_max > FAST_N_MAX:
        found.append(
            warning(
                "speculative.n_max",
                f"K = {speculative.n_max} drafts more tokens than a draft usually gets accepted",
                "4-6 suits chat, 6-8 long output; measure with `llm-appliance tune`",
            )
        )
    return found


def _cache_problems(field: str, model: Model, flash_attn: str) -> list[Problem]:
    found = []
    if model.cache_type_v in QUANTIZED_CACHE and flash_attn == "off":
        found.append(
            error(
                f"{field}.cache_type_v",
                f"a quantized V cache ({model.cache_type_v}) needs flash attention, and server.flash_attn is off: llama.cpp refuses to create the context",
                'set server.flash_attn = "auto" or "on", or cache_type_v = "f16"',
            )
        )
    if model.cache_type_k != model.cache_type_v and any(d.startswith("CUDA") for d in model.devices):
        found.append(
            warning(
                f"{field}.cache_type_k",
                f"K cache {model.cache_type_k} and V cache {model.cache_type_v} differ: the default CUDA build has flash-attention kernels only for matching pairs",
                "use the same type for both (f16/f16, q8_0/q8_0 or q4_0/q4_0)",
            )
        )
    return found
