"""The rendered files pass the real tools' own checks: systemd-analyze, nft, promtool."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import EXAMPLE_FACTS, KeyFile, service_settings

from appliance.plan.resolved import resolve
from appliance.plan.validate import validate
from appliance.render.apply import installed_spec_path
from appliance.render.check import check_tree
from appliance.render.render import render
from appliance.spec.load import load_spec
from appliance.system import paths

pytestmark = pytest.mark.system

UNITS = [paths.SERVER_UNIT, paths.HEALTH_UNIT, paths.RESTART_UNIT, paths.RESTART_TIMER]
NFT = "etc/llm-appliance/rendered/llm-appliance.nft"
RULES = "etc/llm-appliance/rendered/prometheus/llm-appliance.rules.yml"
SCRAPE = "etc/llm-appliance/rendered/prometheus/scrape.yml"


def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin")
    if found is None:
        pytest.fail(f"{name} is not installed (.ci/run installs it)")
    return found


@pytest.fixture(scope="session")
def service_user() -> str:
    """nft resolves `meta skuid "llm-appliance"` at load time: the system user must exist."""
    if subprocess.run(["id", paths.SERVICE_USER], capture_output=True, check=False).returncode != 0:
        subprocess.run(
            [
                _tool("useradd"),
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                paths.SERVICE_USER,
            ],
            check=True,
            capture_output=True,
        )
    return paths.SERVICE_USER


def _render(spec: Path, name: str) -> dict[str, str]:
    result = validate(spec, facts=EXAMPLE_FACTS[name])
    return render(resolve(result.plan, installed_spec_path(spec)))


def _write(files: dict[str, str], root: Path) -> Path:
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    return root


@pytest.fixture(params=sorted(EXAMPLE_FACTS))
def rendered(request: pytest.FixtureRequest, example: Callable[..., Path]) -> dict[str, str]:
    name = request.param
    return _render(example(name), name)


def _run(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, cwd=cwd)


def _accepted(files: dict[str, str]) -> None:
    """apply's own check (render/check.py): every checker ran, and none rejected a file."""
    checked = check_tree(files)
    assert checked.rejections == (), "\n".join(map(str, checked.rejections))
    assert checked.notes == (), f"a checker did not run (.ci/run installs the tools and the user): {checked.notes}"


# --- every example -----------------------------------------------------------------------------------------


def test_every_example_passes_the_checks_apply_runs(rendered: dict[str, str], service_user: str) -> None:
    for name in (*UNITS, "llm-appliance.nft", "llm-appliance.rules.yml", "scrape.yml", "appliance.json"):
        assert any(path.endswith(name) for path in rendered), name  # each checker has its file
    _accepted(rendered)


def test_rules_pass_promtool_with_every_alert(rendered: dict[str, str], tmp_path: Path) -> None:
    rules = _write({RULES: rendered[RULES]}, tmp_path) / RULES
    result = _run([_tool("promtool"), "check", "rules", str(rules)])
    assert result.returncode == 0, result.stdout + result.stderr
    found = re.search(r"SUCCESS: (\d+) rules found", result.stdout)
    assert found, result.stdout
    assert int(found.group(1)) >= 9


# --- the sandbox follows the plan's devices ----------------------------------------------------------------


def _server_unit(example: Callable[..., Path], name: str) -> dict[str, list[str]]:
    return service_settings(_render(example(name), name)[f"etc/systemd/system/{paths.SERVER_UNIT}"])


def test_cpu_demo_has_no_devices(example: Callable[..., Path]) -> None:
    unit = _server_unit(example, "demo-draft.toml")
    assert unit["PrivateDevices"] == ["yes"]
    assert "DeviceAllow" not in unit
    assert "DevicePolicy" not in unit
    assert unit["MemoryDenyWriteExecute"] == ["yes"]


def test_gpu_example_opens_its_gpu_only(example: Callable[..., Path]) -> None:
    unit = _server_unit(example, "appliance.toml")
    assert unit["PrivateDevices"] == ["no"]
    assert unit["DevicePolicy"] == ["closed"]
    assert unit["DeviceAllow"] == ["/dev/nvidia0 rw", "/dev/nvidiactl rw", "/dev/nvidia-uvm rw"]
    assert "MemoryDenyWriteExecute" not in unit  # CUDA JIT needs W+X pages


def test_the_gpu_health_unit_opens_what_nvml_opens_read_write(example: Callable[..., Path]) -> None:
    files = _render(example("dual-gpu.toml"), "dual-gpu.toml")
    unit = service_settings(files[f"etc/systemd/system/{paths.HEALTH_UNIT}"])
    # NVML opens the control node and every GPU O_RDWR; read-only access makes each query fail.
    assert unit["DeviceAllow"] == ["/dev/nvidiactl rw", "/dev/nvidia0 rw", "/dev/nvidia1 rw"]


def test_dual_gpu_example_opens_both_gpus(example: Callable[..., Path]) -> None:
    unit = _server_unit(example, "dual-gpu.toml")
    assert unit["DevicePolicy"] == ["closed"]
    assert {"/dev/nvidia0 rw", "/dev/nvidia1 rw"} <= set(unit["DeviceAllow"])
    assert not any(re.fullmatch(r"/dev/nvidia[2-9]\d* rw", allowed) for allowed in unit["DeviceAllow"])


# --- the firewall follows network.allow and network.egress -------------------------------------------------


def _set_elements(ruleset: str, name: str) -> list[str]:
    block = re.search(rf"set {name} \{{(.*?)\n\t\}}", ruleset, re.S)
    assert block, f"no set {name} in\n{ruleset}"
    elements = re.search(r"elements = \{ (.*) \}", block.group(1))
    return elements.group(1).split(", ") if elements else []


@pytest.fixture
def lan_spec(example: Callable[..., Path], key_file: KeyFile) -> Callable[..., Path]:
    keys = key_file("a-key")

    def make(host: str = "0.0.0.0", **extra: str) -> Path:
        return example(
            "demo-draft.toml",
            {
                'host = "127.0.0.1"': f'host = "{host}"\napi_key_file = "{keys}"',
                'allow = ["127.0.0.0/8", "::1/128"]': 'allow = ["192.168.7.0/24", "fd00::/8"]',
                **extra,
            },
        )

    return make


def test_allowed_networks_land_in_their_sets(lan_spec: Callable[..., Path], service_user: str) -> None:
    ruleset = _render(lan_spec(), "demo-draft.toml")[NFT]
    assert _set_elements(ruleset, "api_clients_v4") == ["192.168.7.0/24"]
    assert _set_elements(ruleset, "api_clients_v6") == ["fd00::/8"]
    assert "chain output" in ruleset
    assert 'meta skuid "llm-appliance" counter drop' in ruleset


def test_loopback_example_sets(example: Callable[..., Path]) -> None:
    ruleset = _render(example("appliance.toml"), "appliance.toml")[NFT]
    assert _set_elements(ruleset, "api_clients_v4") == ["127.0.0.0/8"]
    assert _set_elements(ruleset, "api_clients_v6") == ["::1/128"]


def test_egress_allow_filters_no_egress(lan_spec: Callable[..., Path], service_user: str) -> None:
    files = _render(lan_spec(**{'egress = "deny"': 'egress = "allow"'}), "demo-draft.toml")
    ruleset = files[NFT]
    # The output hook keeps the appliance's ports its own (a squatter's SYN-ACK), and filters nothing else.
    output = ruleset[ruleset.index("chain output") :]
    assert [line.strip() for line in output.splitlines()[2:-2]] == [
        "tcp sport { 8080, 9478 } tcp flags & (syn | ack) == syn | ack jump own_ports"
    ]
    assert "egress denied" not in ruleset
    assert "chain input" in ruleset
    _accepted(files)


def _load_in_netns(ruleset: Path) -> dict[str, object]:
    """Load the ruleset for real, in a fresh network namespace, and read it back as nft's JSON."""
    if _run(["unshare", "--net", "true"]).returncode != 0:
        pytest.skip("cannot create a network namespace here")
    result = _run(["unshare", "--net", "sh", "-c", f"nft -f {ruleset} && nft -j list table inet {paths.NFT_TABLE}"])
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def test_lan_ruleset_loads_and_reads_back(lan_spec: Callable[..., Path], service_user: str, tmp_path: Path) -> None:
    files = _render(lan_spec(), "demo-draft.toml")
    path = tmp_path / "lan.nft"
    path.write_text(files[NFT])
    listed = _load_in_netns(path)["nftables"]
    assert isinstance(listed, list)
    sets = {item["set"]["name"]: item["set"] for item in listed if "set" in item}
    assert sets["api_clients_v4"]["elem"] == [{"prefix": {"addr": "192.168.7.0", "len": 24}}]
    assert sets["api_clients_v6"]["elem"] == [{"prefix": {"addr": "fd00::", "len": 8}}]
    chains = {item["chain"]["name"]: item["chain"] for item in listed if "chain" in item}
    assert set(chains) == {"input", "output", "own_ports"}
    assert (chains["input"]["hook"], chains["input"]["policy"]) == ("input", "accept")
    # The server and exporter ports are the ones dropped for other clients.
    drops = [
        item["rule"]
        for item in listed
        if "rule" in item and item["rule"]["chain"] == "input" and any("drop" in e for e in item["rule"]["expr"])
    ]
    assert len(drops) == 1
    assert {"set": [8080, 9478]} in [e["match"]["right"] for e in drops[0]["expr"] if "match" in e]


def test_lan_spec_scrape_uses_the_api_key(lan_spec: Callable[..., Path], service_user: str) -> None:
    spec = lan_spec()
    files = _render(spec, "demo-draft.toml")
    scrape = files[SCRAPE]
    assert f'credentials_file: "{load_spec(spec).spec.server.api_key_file}"' in scrape
    # 0.0.0.0 is scraped over loopback.
    assert '"127.0.0.1:8080"' in scrape
    _accepted(files)


# --- the units' IP filters follow network.allow, network.egress and the server's own address ---------------


def _units(files: dict[str, str]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    return (
        service_settings(files[f"etc/systemd/system/{paths.SERVER_UNIT}"]),
        service_settings(files[f"etc/systemd/system/{paths.HEALTH_UNIT}"]),
    )


def test_egress_deny_filters_the_server_unit(lan_spec: Callable[..., Path]) -> None:
    server, health = _units(_render(lan_spec(), "demo-draft.toml"))
    assert server["IPAddressDeny"] == ["any"]
    assert server["IPAddressAllow"] == ["localhost", "192.168.7.0/24", "fd00::/8"]
    # 0.0.0.0 is probed over loopback; the exporter listens on loopback: the health unit needs nothing more.
    assert health["IPAddressDeny"] == ["any"]
    assert health["IPAddressAllow"] == ["localhost"]


def test_egress_allow_leaves_the_server_unit_unfiltered(lan_spec: Callable[..., Path], service_user: str) -> None:
    """systemd's IPAddressDeny= holds outgoing connections too: with egress = "allow" the server unit has none,
    and the nftables input chain alone keeps out the clients network.allow does not name."""
    files = _render(lan_spec(**{'egress = "deny"': 'egress = "allow"'}), "demo-draft.toml")
    server, health = _units(files)
    assert "IPAddressDeny" not in server and "IPAddressAllow" not in server
    assert "ip saddr @api_clients_v4 accept" in files[NFT] and "counter drop" in files[NFT]
    # The health daemon opens no connection beyond loopback either way.
    assert health["IPAddressDeny"] == ["any"]
    _accepted(files)


@pytest.mark.parametrize(
    ("host", "own"), [("192.168.7.5", "192.168.7.5/32"), ("fd00::5", "fd00::5/128")], ids=["v4", "v6"]
)
def test_the_servers_own_address_passes_both_units(
    lan_spec: Callable[..., Path], service_user: str, host: str, own: str
) -> None:
    """A server on one of the machine's own addresses is probed there (the launcher's /health, the health
    daemon) and local clients come from it: without it in IPAddressAllow the server never becomes READY."""
    files = _render(lan_spec(host), "demo-draft.toml")
    server, health = _units(files)
    assert server["IPAddressAllow"] == ["localhost", "192.168.7.0/24", "fd00::/8", own]
    assert health["IPAddressAllow"] == ["localhost", own]
    _accepted(files)


def test_an_exporter_beyond_loopback_passes_its_clients_and_own_address(lan_spec: Callable[..., Path]) -> None:
    spec = lan_spec("192.168.7.5", **{"port = 9478": 'host = "192.168.7.6"\nport = 9478'})
    _, health = _units(_render(spec, "demo-draft.toml"))
    assert health["IPAddressAllow"] == ["localhost", "192.168.7.5/32", "192.168.7.0/24", "fd00::/8", "192.168.7.6/32"]
