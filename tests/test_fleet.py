"""The fleet file and `fleet render`: located errors for bad fleet files, each host's tree as its spec renders,
and haproxy.cfg, targets, scrape jobs and rules that HAProxy and promtool accept."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import EXAMPLES, KeyFile
from pydantic import ValidationError
from test_launch import free_port

from appliance.cli.main import main
from appliance.fleet.hosts import schedule
from appliance.fleet.load import load_fleet
from appliance.fleet.model import Rules
from appliance.spec.model import Spec
from appliance.spec.problems import SpecInvalid

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


def write_fleet(directory: Path, edit: Callable[[str], str] = lambda text: text) -> Path:
    path = directory / "fleet.toml"
    path.write_text(edit((EXAMPLES / "fleet.toml").read_text()))
    return path


def problems_of(path: Path) -> list[str]:
    with pytest.raises(SpecInvalid) as caught:
        load_fleet(path)
    return [p.render() for p in caught.value.problems]


def test_the_example_fleet_validates() -> None:
    fleet = load_fleet(EXAMPLES / "fleet.toml").fleet
    assert [h.name for h in fleet.hosts] == ["demo-1", "demo-2", "demo-3"]
    assert fleet.rules.min_ready == 2


@pytest.mark.parametrize(
    ("old", "new", "field", "words"),
    [
        ('name = "demo-2"', 'name = "demo-1"', "hosts[1].name", "names more than one host"),
        ('address = "10.0.0.12"', 'address = "gpu-2.lan"', "hosts[1].address", "not an IP address"),
        ("min_ready = 2", "min_ready = 3", "rules.min_ready", "no host could ever restart"),
        ('restart_first = "04:00"', 'restart_first = "4am"', "rules.restart_first", "HH:MM"),
        ("restart_spacing_minutes = 20", "restart_spacing_minutes = 600", "rules.restart_spacing_minutes", "a day"),
        ("threads = 4", 'host = "0.0.0.0"', "hosts[2].overrides.server.host", "the fleet's to set"),
        ("fall = 2 ", "falls = 2 ", "balancer.falls", "unknown key"),
        ('spec = "demo.toml"', "", "hosts[0].spec", "no spec"),
    ],
)
def test_a_bad_fleet_file_is_refused_with_file_line_field_and_fix(
    tmp_path: Path, old: str, new: str, field: str, words: str
) -> None:
    path = write_fleet(tmp_path, lambda text: text.replace(old, new, 1))
    assert old in (EXAMPLES / "fleet.toml").read_text()
    found = problems_of(path)
    matching = [p for p in found if f": error: {field}: " in p and words in p]
    assert matching, found
    line = int(re.match(rf"{re.escape(str(path))}:(\d+): ", matching[0]).group(1))  # type: ignore[union-attr]
    written = field.split(".")[-1].split("[")[0]
    assert written in path.read_text().splitlines()[line - 1] or field.endswith("spec"), (line, matching[0])
    assert "\n    fix: " in matching[0]


def test_schedules_are_spread_and_wrap_at_midnight() -> None:
    rules = Rules(restart_first="23:30", restart_spacing_minutes=20)
    assert [schedule(rules, i) for i in range(3)] == ["*-*-* 23:30:00", "*-*-* 23:50:00", "*-*-* 00:10:00"]


@pytest.fixture
def fleet_file(tmp_path: Path, example: Callable[..., Path], key_file: KeyFile) -> Path:
    """The example fleet over the demo spec (its models the real ones), with a real key file and the targets
    directory in tmp_path."""
    example("demo.toml")
    keys = key_file("fleet-key-1")
    fleet_key = key_file("the-fleet-shares-this-key", name="fleet-key")
    return write_fleet(
        tmp_path,
        lambda text: (
            text.replace("/etc/llm-appliance/api-keys", str(keys))
            .replace("/etc/llm-appliance/fleet-key", str(fleet_key))
            .replace("[prometheus]\n", f'[prometheus]\nfiles_dir = "{tmp_path / "out" / "prometheus" / "targets"}"\n')
        ),
    )


@pytest.fixture
def rendered(fleet_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    out = tmp_path / "out"
    assert main(["fleet", "render", str(fleet_file), "--out", str(out)]) == 0, capsys.readouterr().err
    return out


def test_each_host_tree_is_its_derived_spec_rendered(rendered: Path) -> None:
    for index, name in enumerate(["demo-1", "demo-2", "demo-3"]):
        tree = rendered / "hosts" / name
        snapshot = json.loads((tree / "etc/llm-appliance/rendered/appliance.json").read_text())
        spec = snapshot["spec"]
        assert spec["server"]["host"] == spec["prometheus"]["host"] == f"10.0.0.{11 + index}"
        assert "10.0.0.10/32" in spec["network"]["allow"] and "10.0.0.9/32" in spec["network"]["allow"]
        assert spec["prometheus"]["labels"] == {"appliance": "demo", "host": name}
        assert (
            f"OnCalendar=*-*-* 04:{20 * index:02d}:00"
            in (tree / "etc/systemd/system/llm-appliance-restart.timer").read_text()
        )
        assert (tree / "etc/llm-appliance/demo.toml").read_text().startswith(f"# host {name} of fleet demo")
    assert (
        json.loads((rendered / "hosts/demo-3/etc/llm-appliance/rendered/appliance.json").read_text())["spec"]["server"][
            "threads"
        ]
        == 4
    )


def test_each_host_spec_names_its_peers_min_ready_and_the_drain(rendered: Path, fleet_file: Path) -> None:
    key_file = re.search(r'^key_file = "([^"]+)"', fleet_file.read_text(), re.MULTILINE)
    assert key_file is not None
    for index, name in enumerate(["demo-1", "demo-2", "demo-3"]):
        spec = json.loads((rendered / "hosts" / name / "etc/llm-appliance/rendered/appliance.json").read_text())["spec"]
        others = {f"demo-{i + 1}": f"http://10.0.0.{11 + i}:9478/ready" for i in range(3) if i != index}
        # 2 s x (fall 2 + 1): HAProxy's fall checks and one more for a check already under way; rise the same.
        assert spec["fleet"] == {
            "host": name,
            "peers": others,
            "min_ready": 2,
            "drain_seconds": 6,
            "settle_seconds": 6,
            "turns": "peers",
            "key_file": key_file[1],  # the same on every host: they prove their /ready with it
        }
        # Peers read this host's /ready: each is a client of its exporter.
        assert {f"10.0.0.{11 + i}/32" for i in range(3) if i != index} <= set(spec["network"]["allow"])
        assert f"10.0.0.{11 + index}/32" not in spec["network"]["allow"]


def test_each_host_may_reach_its_peers_ready_through_its_egress_filter(rendered: Path) -> None:
    ruleset = (rendered / "hosts/demo-2/etc/llm-appliance/rendered/llm-appliance.nft").read_text()
    for peer in ("10.0.0.11", "10.0.0.13"):
        assert f'meta skuid "llm-appliance" ip daddr {peer} tcp dport 9478 accept' in ruleset
    assert "ip daddr 10.0.0.12 tcp dport" not in ruleset


def test_a_peer_on_its_own_exporter_port_is_read_there(fleet_file: Path, tmp_path: Path) -> None:
    fleet_file.write_text(fleet_file.read_text() + "[hosts.overrides.prometheus]\nport = 9500\n")
    out = tmp_path / "out"
    assert main(["fleet", "render", str(fleet_file), "--out", str(out)]) == 0
    spec = json.loads((out / "hosts/demo-1/etc/llm-appliance/rendered/appliance.json").read_text())["spec"]
    assert spec["fleet"]["peers"]["demo-3"] == "http://10.0.0.13:9500/ready"


def test_the_fleet_table_is_the_fleets_to_write(tmp_path: Path) -> None:
    path = write_fleet(
        tmp_path,
        lambda text: text.replace("threads = 4", "min_ready = 1", 1).replace(
            "[hosts.overrides.server]", "[hosts.overrides.fleet]"
        ),
    )
    assert any("hosts[2].overrides.fleet.min_ready" in p and "the fleet's to set" in p for p in problems_of(path))


@pytest.mark.fleet
def test_haproxy_accepts_the_rendered_config(rendered: Path) -> None:
    cfg = rendered / "balancer/etc/haproxy/haproxy.cfg"
    text = cfg.read_text()
    for line in (
        "balance leastconn",
        "option httpchk GET /ready",
        "retry-on conn-failure empty-response response-timeout",
        "option redispatch 1",
        "http-request use-service prometheus-exporter if { path /metrics }",
        "server demo-2 10.0.0.12:8080 check port 9478 maxconn 1",
        "default-server inter 2s fall 2 rise 2",
    ):
        assert line in text
    # -c parses and resolves everything but binds nothing: the example's addresses need not exist here.
    result = subprocess.run([HAPROXY, "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.fleet
def test_with_no_host_ready_haproxy_answers_in_the_clients_language(rendered: Path, tmp_path: Path) -> None:
    """The rendered config, run for real on loopback with none of its hosts there: a client's request gets
    OpenAI's error shape and a Retry-After, before any byte of an answer, which an SDK or a router can act on."""
    port, stats, closed = free_port(), free_port(), free_port()
    text = (rendered / "balancer/etc/haproxy/haproxy.cfg").read_text()
    text = text.replace("bind 10.0.0.10:8000", f"bind 127.0.0.1:{port}").replace(
        "bind 10.0.0.10:8404", f"bind 127.0.0.1:{stats}"
    )
    # The hosts on loopback, where nothing listens: no packet leaves for the example's addresses.
    text = re.sub(r"10\.0\.0\.1[1-3]:8080 check port 9478", f"127.0.0.1:{closed} check port {closed}", text)
    assert "10.0.0." not in text.split("backend llm-appliance")[1]
    text = text.replace("log /dev/log local0", "log stdout format raw local0")
    config = tmp_path / "haproxy.cfg"
    config.write_text(text)
    with subprocess.Popen(
        [HAPROXY, "-db", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    ) as proxy:
        try:
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                data=b'{"model": "smollm2-135m-instruct", "messages": []}',
                headers={"Content-Type": "application/json"},
            )
            deadline = time.monotonic() + 60
            while True:
                try:
                    urllib.request.urlopen(request, timeout=30)
                    pytest.fail("a fleet with no host answered 200")
                except urllib.error.HTTPError as exc:
                    status, headers, body = exc.code, exc.headers, exc.read()
                    break
                except urllib.error.URLError:  # not listening yet
                    assert proxy.poll() is None and time.monotonic() < deadline, proxy.stderr
                    time.sleep(0.1)
            # The balancer's own /ready, which a router in front of it asks: "down" once HAProxy has seen that no
            # host is up (its first checks, or the request above), as a host's /ready would say.
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{stats}/ready", timeout=30)
                    assert time.monotonic() < deadline, "HAProxy's /ready said ready with no host up"
                    time.sleep(0.1)
                except urllib.error.HTTPError as exc:
                    refused, refused_headers, reason = exc.code, exc.headers, exc.read().decode()
                    break
        finally:
            proxy.terminate()
    assert (refused, refused_headers["Retry-After"], reason) == (503, "2", "not ready: down")
    assert status == 503 and headers["Content-Type"] == "application/json", (status, dict(headers))
    assert headers["Retry-After"] == "2"  # the balancer's check interval
    assert json.loads(body) == {
        "error": {
            "message": "no appliance of this fleet can take the request now; retry or fall back",
            "type": "unavailable_error",
            "code": 503,
        }
    }


@pytest.mark.fleet
def test_haproxy_refuses_a_broken_config(rendered: Path, tmp_path: Path) -> None:
    # The check above can fail: the same config with one word wrong is refused.
    broken = tmp_path / "broken.cfg"
    broken.write_text((rendered / "balancer/etc/haproxy/haproxy.cfg").read_text().replace("leastconn", "fewestconn"))
    result = subprocess.run([HAPROXY, "-c", "-f", str(broken)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode != 0


def test_file_sd_has_one_entry_per_host_and_job(rendered: Path) -> None:
    targets = rendered / "prometheus/targets"
    health = json.loads((targets / "llm-appliance-health.json").read_text())
    server = json.loads((targets / "llm-appliance-llama-server.json").read_text())
    assert [g["targets"] for g in health] == [["10.0.0.11:9478"], ["10.0.0.12:9478"], ["10.0.0.13:9478"]]
    assert [g["targets"] for g in server] == [["10.0.0.11:8080"], ["10.0.0.12:8080"], ["10.0.0.13:8080"]]
    assert [g["labels"] for g in health] == [{"appliance": "demo", "host": f"demo-{i}"} for i in (1, 2, 3)]


def test_promtool_accepts_the_rules_and_a_config_using_the_file_sd(rendered: Path, tmp_path: Path) -> None:
    prometheus = rendered / "prometheus"
    rules = sorted((prometheus / "rules").glob("*.yml"))
    assert [r.name for r in rules] == ["demo-1.rules.yml", "demo-2.rules.yml", "demo-3.rules.yml", "fleet.rules.yml"]
    result = subprocess.run(
        [PROMTOOL, "check", "rules", *map(str, rules)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = "\n".join("  " + line for line in (prometheus / "scrape.yml").read_text().splitlines())
    config = tmp_path / "prometheus.yml"
    config.write_text("rule_files:\n" + "".join(f"  - {r}\n" for r in rules) + "scrape_configs:\n" + jobs + "\n")
    result = subprocess.run(
        [PROMTOOL, "check", "config", str(config)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_host_spec_problem_is_located_where_the_fleet_wrote_it(
    fleet_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = fleet_file.read_text()
    missing = "/var/lib/llm-appliance-no-such-dir/api-keys"
    fleet_file.write_text(re.sub(r'api_key_file = "[^"]*"', f'api_key_file = "{missing}"', text))
    out = tmp_path / "refused"
    assert main(["fleet", "render", str(fleet_file), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    line = next(n for n, row in enumerate(fleet_file.read_text().splitlines(), start=1) if missing in row)
    assert f"{fleet_file}:{line}: error: fleet.overrides.server.api_key_file: " in err, err
    assert "as the fleet derives it: server.api_key_file" in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("fleet", "words"),
    [
        ({"host": "a", "peers": {"b": "http://10.0.0.2:9478/ready"}, "min_ready": 2}, "could never restart"),
        ({"host": "a", "peers": {"a": "http://10.0.0.1:9478/ready"}}, "is this host"),
        ({"host": "a", "peers": {"b": "http://10.0.0.2:9478/metrics"}}, "not a peer's /ready URL"),
        ({"host": "a", "peers": {"B": "http://10.0.0.2:9478/ready"}}, "not a host name"),
    ],
)
def test_a_bad_fleet_table_in_a_spec_is_refused(fleet: dict[str, object], words: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(words)):
        Spec.model_validate({"models": {"target": {"path": "/models/t.gguf"}}, "fleet": fleet})


def _rules_of(text: str) -> dict[str, dict[str, dict[str, str]]]:
    """Each alert's labels and annotations from the rendered file (its quoted values are JSON strings)."""
    found = {}
    for block in text.split("- alert: ")[1:]:
        values = {k: json.loads(v) if v.startswith('"') else v for k, v in re.findall(r"^ +(\w+): (.+)$", block, re.M)}
        found[block.split()[0]] = {
            "labels": {k: values[k] for k in ("severity", "appliance")},
            "annotations": {k: values[k] for k in ("summary", "description")},
        }
    return found


def _fleet_alerts(rules: Path, tmp_path: Path, series: dict[str, str], at: str, firing: list[str]) -> None:
    """promtool's own rule unit test: these series, evaluated at `at`, fire exactly the alerts named."""
    rendered = _rules_of(rules.read_text())

    def expected(alert: str) -> dict[str, dict[str, str]]:
        labels, annotations = rendered[alert]["labels"], rendered[alert]["annotations"]
        if alert != DRAINING:  # the others aggregate the hosts away
            return {"exp_labels": labels, "exp_annotations": annotations}
        return {
            "exp_labels": {**labels, "host": "demo-1"},
            "exp_annotations": {k: v.replace("{{ $labels.host }}", "demo-1") for k, v in annotations.items()},
        }

    case = {
        "rule_files": [str(rules)],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": [{"series": name, "values": values} for name, values in series.items()],
                "alert_rule_test": [
                    {
                        "eval_time": at,
                        "alertname": alert,
                        "exp_alerts": [expected(alert)] if alert in firing else [],
                    }
                    for alert in ("LlmApplianceFleetBelowMinReady", "LlmApplianceFleetWideDecay", DRAINING)
                ],
            }
        ],
    }
    path = tmp_path / "case.yml"
    path.write_text(json.dumps(case))  # YAML is a superset of JSON
    result = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


DRAINING = "LlmApplianceDrainingTooLong"


def _ready(host: str) -> str:
    return f'llm_appliance_ready{{appliance="demo", host="{host}"}}'


# demo-1 out (draining), the other two serving: min_ready kept.
SERVING = {_ready("demo-1"): "0x60", _ready("demo-2"): "1x60", _ready("demo-3"): "1x60"}


@pytest.mark.parametrize(
    ("series", "firing"),
    [
        ({_ready("demo-1"): "1x60", _ready("demo-2"): "1x60", _ready("demo-3"): "0x60"}, []),
        # Two hosts down: one not ready, one gone (its exporter with it, so its series ends).
        (
            {_ready("demo-1"): "1x60", _ready("demo-2"): "0x60", _ready("demo-3"): "1 1"},
            ["LlmApplianceFleetBelowMinReady"],
        ),
        ({}, ["LlmApplianceFleetBelowMinReady"]),  # no host answers at all
        (
            {
                **{_ready(f"demo-{i}"): "1x60" for i in (1, 2, 3)},
                'llm_appliance_fleet_decay{appliance="demo", host="demo-1"}': "0 0 1x60",
            },
            ["LlmApplianceFleetWideDecay"],
        ),
        # The example drains 4 s and waits 300 s for idle at most: stuck past that and 5 minutes more.
        ({**SERVING, 'llm_appliance_draining{appliance="demo", host="demo-1"}': "1x60"}, [DRAINING]),
        ({**SERVING, 'llm_appliance_draining{appliance="demo", host="demo-1"}': "1x20 0x40"}, []),
    ],
)
@pytest.mark.skipif(not Path(PROMTOOL).exists(), reason="promtool is not installed")
def test_the_fleet_alerts_fire_when_they_should(
    rendered: Path, tmp_path: Path, series: dict[str, str], firing: list[str]
) -> None:
    # A gone host's series goes stale 5 minutes after its last sample; the alert then waits the example's 300 s.
    _fleet_alerts(rendered / "prometheus/rules/fleet.rules.yml", tmp_path, series, "12m", firing)


def test_hosts_serving_the_model_under_different_names_are_warned_of(
    fleet_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet_file.write_text(fleet_file.read_text().replace("threads = 4", 'threads = 4\nalias = "other-name"'))
    assert main(["fleet", "render", str(fleet_file), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "warning: hosts[2].overrides.server.alias: host demo-3 serves its model as 'other-name'" in err, err


FALLBACK = '\n[fallback]\nbase_url = "http://192.0.2.50:8000/v1"\nmodel = "upstream-model"\nport = 8100\n'


def test_a_fleet_fallback_puts_a_router_in_front_of_haproxy(
    fleet_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet_file.write_text(fleet_file.read_text() + FALLBACK)
    out = tmp_path / "out"
    assert main(["fleet", "render", str(fleet_file), "--out", str(out)]) == 0, capsys.readouterr().err
    router = json.loads((out / "balancer/etc/llm-appliance/rendered/router/router.json").read_text())
    # HAProxy is the router's local side: its API, and its stats frontend's /ready.
    assert router["endpoint"] == {"host": "10.0.0.10", "port": 8100}
    assert router["local_url"] == "http://10.0.0.10:8000/v1" and router["ready_url"] == "http://10.0.0.10:8404/ready"
    assert router["alias"] == "smollm2-135m-instruct" and router["model"] == "upstream-model"
    unit = (out / "balancer/etc/systemd/system/llm-appliance-router.service").read_text()
    assert (
        "ExecStart=/opt/llm-appliance/venv/bin/llm-appliance router --config-dir /etc/llm-appliance/rendered/router"
        in unit
    )
    assert "SupplementaryGroups" not in unit and "Wants=" not in unit  # no service user, no server unit there
    egress = (out / "balancer/etc/llm-appliance/rendered/router/egress.nft").read_text()
    rules = [line.strip() for line in egress.splitlines() if line.strip().startswith("meta skuid")]
    assert rules == [
        'meta skuid "llm-appliance-router" ct state established,related accept',
        'meta skuid "llm-appliance-router" oif "lo" tcp dport { 8000, 8404 } accept comment "llm-appliance: HAProxy and its /ready"',
        'meta skuid "llm-appliance-router" ip daddr 192.0.2.50 tcp dport 8000 accept comment "llm-appliance: the fallback upstream"',
        'meta skuid "llm-appliance-router" counter drop comment "llm-appliance: egress denied"',
    ]
    # The hosts render no router of their own: the fallback is the balancer's.
    assert not list(out.glob("hosts/*/etc/systemd/system/llm-appliance-router.service"))
    nft = shutil.which("nft") or "/usr/sbin/nft"
    if Path(nft).exists():
        checked = subprocess.run(
            [nft, "-c", "-f", str(out / "balancer/etc/llm-appliance/rendered/router/egress.nft")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert checked.returncode == 0, checked.stderr


@pytest.mark.parametrize(
    ("edit", "field", "words"),
    [
        (lambda text: text + FALLBACK.replace("port = 8100", "port = 8404"), "fallback.port", "balancer.stats_port"),
        (
            lambda text: (
                text.replace(
                    "[fleet.overrides.server]\n",
                    "[fleet.overrides.network]\nprivate = true\n\n[fleet.overrides.server]\n",
                )
                + FALLBACK
            ),
            "fallback",
            "is private",
        ),
        (
            lambda text: text + FALLBACK.replace("http://192.0.2.50:8000/v1", "ftp://192.0.2.50/v1"),
            "fallback.base_url",
            "http(s)",
        ),
    ],
)
def test_a_fleet_fallback_that_cannot_work_is_refused(
    fleet_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    edit: Callable[[str], str],
    field: str,
    words: str,
) -> None:
    fleet_file.write_text(edit(fleet_file.read_text()))
    out = tmp_path / "out"
    assert main(["fleet", "render", str(fleet_file), "--out", str(out)]) != 0
    err = capsys.readouterr().err
    assert f": error: {field}: " in err and words in err, err
    assert not out.exists()  # nothing half-written


def test_a_fleet_without_its_key_is_refused(
    fleet_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Peers that take turns without proving their /ready: any host at a peer's address could hold every
    restart. The fleet file must name the key its hosts share."""
    fleet_file.write_text(re.sub(r'^key_file = "[^"]*"\n', "", fleet_file.read_text(), flags=re.MULTILINE))
    out = tmp_path / "refused"
    assert main(["fleet", "render", str(fleet_file), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "peers without key_file" in err and "[fleet] key_file" in err, err
    assert not out.exists()
