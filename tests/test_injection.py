"""Text a spec or a fleet file carries into a rendered file (the ruleset, a unit, haproxy.cfg, YAML) holds nothing
that file reads as syntax: each value printed bare is validated to its grammar, so `;`, braces, a quote or a line
break is refused where it is written, with the field named, and nothing renders (issue 36, high 1)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import EXAMPLE_FACTS, EXAMPLES, KeyFile

from appliance.cli.main import main
from appliance.fleet.load import load_fleet
from appliance.plan.validate import validate
from appliance.spec.problems import Problem, SpecInvalid

# The attack of the issue: a peer whose "host" closes the rule and lifts the service user's egress limits.
EXPLOIT = 'http://10.0.0.2 accept; meta skuid "llm-appliance" accept; ip daddr 10.0.0.2:9478/ready'
SYNTAX = [";", "{", "}", '"', "\n", " accept; flush ruleset; "]
PEERS = '[fleet]\nhost = "a"\npeers = {{ b = {value} }}\nmin_ready = 0\n'
# ...and with the host or the peer's name to break: formatted twice, so its braces are doubled twice.
ONE_PEER = '[fleet]\nhost = {host}\npeers = {{{{ {peer} = "http://10.0.0.2:9478/ready" }}}}\nmin_ready = 0\n\n[network]'

# (example, the text its value replaces, the TOML to write with {value}, the field, how to break the value).
SPEC_FIELDS: list[tuple[str, str, str, str, Callable[[str], str]]] = [
    ("demo.toml", "[network]", PEERS + "\n[network]", "fleet.peers.b", lambda x: f"http://10.0.0.2{x}:9478/ready"),
    ("demo.toml", "[network]", PEERS + "\n[network]", "fleet.peers.b", lambda x: f"http://10.0.0.2:9478/ready{x}"),
    ("demo.toml", "[network]", ONE_PEER.format(host="{value}", peer='"b"'), "fleet.host", lambda x: f"a{x}"),
    ("demo.toml", "[network]", ONE_PEER.format(host='"a"', peer="{value}"), "fleet.peers", lambda x: f"b{x}"),
    (
        "demo-fallback.toml",
        'base_url = "http://192.0.2.10:8000/v1"',
        "base_url = {value}",
        "fallback.base_url",
        lambda x: f"http://192.0.2.10{x}:8000/v1",
    ),
    (
        "demo-fallback.toml",
        'base_url = "http://192.0.2.10:8000/v1"',
        "base_url = {value}",
        "fallback.base_url",
        lambda x: f"http://192.0.2.10:8000/v1{x}",
    ),
    (
        "appliance.toml",
        'schedule = "*-*-* 04:00:00"',
        "schedule = {value}",
        "restart.schedule",
        lambda x: f"*-*-* 04:00:00{x}",
    ),
    ("demo.toml", 'host = "127.0.0.1"', "host = {value}", "server.host", lambda x: f"127.0.0.1{x}"),
    (
        "demo.toml",
        'allow = ["127.0.0.0/8", "::1/128"]',
        "allow = [{value}]",
        "network.allow",
        lambda x: f"10.0.0.0/8{x}",
    ),
    (
        "demo.toml",
        'devices = ["none"]',
        "devices = [{value}]",
        "models.target.devices",
        lambda x: f"CUDA0{x}",
    ),
    (
        "demo.toml",
        'host = "127.0.0.1"',
        'host = "127.0.0.1"\ncors_origins = [{value}]',
        "server.cors_origins",
        lambda x: f"https://ui.example{x}",
    ),
]
FLEET_FALLBACK = "[balancer]"
# (the text of fleet.toml the value replaces, the TOML with {value}, the field, how to break the value).
FLEET_FIELDS: list[tuple[str, str, str, Callable[[str], str]]] = [
    ('address = "10.0.0.11"', "address = {value}", "hosts[0].address", lambda x: f"10.0.0.11{x}"),
    ('address = "10.0.0.10"', "address = {value}", "balancer.address", lambda x: f"10.0.0.10{x}"),
    ('address = "10.0.0.9"', "address = {value}", "prometheus.address", lambda x: f"10.0.0.9{x}"),
    ('name = "demo-1"', "name = {value}", "hosts[0].name", lambda x: f"demo-1{x}"),
    ('name = "demo" ', "name = {value} ", "fleet.name", lambda x: f"demo{x}"),
    ('restart_first = "04:00"', "restart_first = {value}", "rules.restart_first", lambda x: f"04:00{x}"),
    (
        'image = "registry.example/llm-appliance:0.1.0"',
        "image = {value}",
        "kubernetes.image",
        lambda x: f"registry.example/llm-appliance:0.1.0{x}",
    ),
    (
        'image = "registry.example/llm-appliance:0.1.0"',
        'image = "registry.example/llm-appliance:0.1.0"\nhaproxy_image = {value}',
        "kubernetes.haproxy_image",
        lambda x: f"haproxy:2.6{x}",
    ),
    ('namespace = "llm-appliance"', "namespace = {value}", "kubernetes.namespace", lambda x: f"llm-appliance{x}"),
    (
        'namespace = "llm-appliance"',
        'namespace = "llm-appliance"\ncluster_domain = {value}',
        "kubernetes.cluster_domain",
        lambda x: f"cluster.local{x}",
    ),
    (
        'api_server = "192.0.2.10/32"',
        "api_server = {value}",
        "kubernetes.api_server",
        lambda x: f"10.96.0.1/32{x}",
    ),
    (
        FLEET_FALLBACK,
        '[fallback]\nbase_url = {value}\nmodel = "gpt"\nport = 8100\n\n' + FLEET_FALLBACK,
        "fallback.base_url",
        lambda x: f"http://192.0.2.10{x}:8000/v1",
    ),
]


def _toml(value: str) -> str:
    return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's


def _located(problems: list[Problem], path: Path, field: str) -> Problem:
    found = [p for p in problems if p.field == field or p.field.startswith(f"{field}.")]
    assert found, "\n".join(p.render() for p in problems)
    assert found[0].file == path and found[0].line is not None, found[0].render()
    return found[0]


@pytest.mark.parametrize("bad", SYNTAX, ids=repr)
@pytest.mark.parametrize(
    ("name", "old", "new", "field", "value"), SPEC_FIELDS, ids=[f"{f[3]}-{i}" for i, f in enumerate(SPEC_FIELDS)]
)
def test_syntax_in_a_spec_value_is_refused_where_it_is_written(
    example: Callable[..., Path], name: str, old: str, new: str, field: str, value: Callable[[str], str], bad: str
) -> None:
    spec = example(name, replace={old: new.format(value=_toml(value(bad)))})
    with pytest.raises(SpecInvalid) as caught:
        validate(spec, facts=EXAMPLE_FACTS[name])
    _located(caught.value.problems, spec, field)


@pytest.mark.parametrize("bad", SYNTAX, ids=repr)
@pytest.mark.parametrize(
    ("old", "new", "field", "value"), FLEET_FIELDS, ids=[f"{f[2]}-{i}" for i, f in enumerate(FLEET_FIELDS)]
)
def test_syntax_in_a_fleet_value_is_refused_where_it_is_written(
    tmp_path: Path, old: str, new: str, field: str, value: Callable[[str], str], bad: str
) -> None:
    text = (EXAMPLES / "fleet.toml").read_text()
    assert old in text
    path = tmp_path / "fleet.toml"
    path.write_text(text.replace(old, new.format(value=_toml(value(bad))), 1))
    with pytest.raises(SpecInvalid) as caught:
        load_fleet(path)
    _located(caught.value.problems, path, field)


def test_the_peer_that_lifts_every_egress_limit_renders_nothing(
    example: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = example("demo.toml", replace={"[network]": PEERS.format(value=_toml(EXPLOIT)) + "\n[network]"})
    out = tmp_path / "rendered"
    assert main(["render", str(spec), "--out", str(out)]) != 0
    err = capsys.readouterr().err
    assert ": error: fleet.peers.b: " in err and "not a peer's /ready URL" in err, err
    assert "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("url", "turns", "refused"),
    [
        ("http://gpu-2.lan:9478/ready", "peers", True),  # the ruleset could not state the address
        ("http://a-1.a.llm-appliance.svc.cluster.local:9478/ready", "eviction", False),  # Kubernetes: no ruleset
        ("http://[fd00::2]:9478/ready", "peers", False),
    ],
)
def test_a_peer_by_name_only_where_no_ruleset_names_it(
    example: Callable[..., Path], key_file: KeyFile, url: str, turns: str, refused: bool
) -> None:
    # With the fleet's key: peers are believed only with it, and its absence is a problem of its own.
    fleet = (
        PEERS.format(value=_toml(url))
        + f'turns = "{turns}"\nkey_file = "{key_file("0123456789abcdef0123456789abcdef")}"\n'
    )
    spec = example("demo.toml", replace={"[network]": fleet + "\n[network]"})
    if not refused:
        validate(spec, facts=EXAMPLE_FACTS["demo.toml"])
        return
    with pytest.raises(SpecInvalid) as caught:
        validate(spec, facts=EXAMPLE_FACTS["demo.toml"])
    problem = _located(caught.value.problems, spec, "fleet.peers.b")
    assert "the ruleset" in problem.message and "IP address" in problem.fix


# Values that reach a file quoted (YAML, JSON) or the argv: any text, but one line (a journal line, a unit's
# comment, the snapshot a person reads).
ONE_LINE = [
    ("demo.toml", "threads = 2", 'threads = 2\nextra_args = ["--tags", {value}]', "server.extra_args"),
    ("demo.toml", 'alias = "smollm2-135m-instruct"', "alias = {value}", "server.alias"),
    ("demo-fallback.toml", 'model = "qwen3-coder-30b-a3b"', "model = {value}", "fallback.model"),
]


@pytest.mark.parametrize("bad", ["\n", "\r", "\u2028"], ids=repr)
@pytest.mark.parametrize(("name", "old", "new", "field"), ONE_LINE, ids=[f[3] for f in ONE_LINE])
def test_a_quoted_value_is_one_line(
    example: Callable[..., Path], name: str, old: str, new: str, field: str, bad: str
) -> None:
    spec = example(name, replace={old: new.format(value=_toml(f"x{bad}ExecStartPre=/bin/sh"))})
    with pytest.raises(SpecInvalid) as caught:
        validate(spec, facts=EXAMPLE_FACTS[name])
    assert "one line" in _located(caught.value.problems, spec, field).message
