"""Render a plan into the appliance's files: a pure function from (Plan, install paths) to {path: text}.

Templates see only the small view built here, never the spec model, so they stay loops and conditionals.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2

from appliance import __version__
from appliance.plan.plan import Plan, draft_devices, gpu_devices
from appliance.system import paths

# Device nodes every CUDA process opens, besides /dev/nvidiaN of its GPUs.
GPU_COMMON_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{'127.0.0.1' if self.host in ('0.0.0.0', '::') else host}:{self.port}"


@dataclass(frozen=True)
class View:
    header: str
    spec_file: str
    cli: str
    rendered_dir: str
    state_dir: str
    user: str
    nft_table: str
    server: Endpoint
    exporter: Endpoint
    api_key_file: str | None
    gpu_devices: tuple[str, ...]
    gpu_nodes: tuple[str, ...]
    gpu_node_common: tuple[str, ...]
    mlock: bool
    allow_v4: tuple[str, ...]
    allow_v6: tuple[str, ...]
    egress_deny: bool
    schedule: str
    randomized_delay_seconds: int
    watchdog_seconds: int
    health_watchdog_seconds: int
    restart_unit: str
    server_unit: str
    health_unit: str
    launch_json: str
    health_json: str
    scrape_interval: str
    labels: tuple[tuple[str, str], ...]  # the spec's labels, each value quoted (valid in YAML and in PromQL)
    decay_ratio: float
    creep_ratio: float
    min_free_bytes: int
    acceptance_min: float
    draft_configured: bool
    max_per_hour: int
    health_interval_seconds: int
    alert_for: dict[str, str]  # alert (AlertForSeconds field) -> its `for:` as a Prometheus duration
    label_matchers: str  # the spec's labels as PromQL matchers: `appliance="demo"`


def view(plan: Plan, spec_file: Path) -> View:
    spec = plan.spec
    allow = spec.network.allow
    devices = sorted(set(gpu_devices(spec.models.target)) | set(draft_devices(spec)))
    header = f"generated from {spec_file} by llm-appliance {__version__}; edit the spec and run `llm-appliance apply`, not this file"
    health_interval = spec.health.interval_seconds
    return View(
        header=header,
        spec_file=str(spec_file),
        cli=str(paths.CLI),
        rendered_dir=str(paths.RENDERED),
        state_dir=str(paths.STATE),
        user=paths.SERVICE_USER,
        nft_table=paths.NFT_TABLE,
        server=Endpoint(spec.server.host, spec.server.port),
        exporter=Endpoint(spec.prometheus.host, spec.prometheus.port),
        api_key_file=str(spec.server.api_key_file) if spec.server.api_key_file else None,
        gpu_devices=tuple(devices),
        gpu_nodes=tuple(f"/dev/nvidia{d.removeprefix('CUDA')}" for d in devices if d.startswith("CUDA")),
        gpu_node_common=GPU_COMMON_NODES if devices else (),
        mlock="mlock" in spec.server.load_mode,
        allow_v4=tuple(a for a in allow if ":" not in a),
        allow_v6=tuple(a for a in allow if ":" in a),
        egress_deny=spec.network.egress == "deny",
        schedule=spec.restart.schedule,
        randomized_delay_seconds=spec.restart.randomized_delay_seconds,
        watchdog_seconds=spec.health.watchdog_seconds,
        health_watchdog_seconds=max(3 * health_interval, 30),
        restart_unit=paths.RESTART_UNIT,
        server_unit=paths.SERVER_UNIT,
        health_unit=paths.HEALTH_UNIT,
        launch_json=_json({"generated": header, **launch_document(plan)}),
        health_json=_json({"generated": header, **health_document(plan)}),
        scrape_interval=f"{spec.prometheus.scrape_interval_seconds}s",
        labels=tuple((name, _quoted(value)) for name, value in sorted(spec.prometheus.labels.items())),
        decay_ratio=spec.health.decay_ratio,
        creep_ratio=spec.health.creep_ratio,
        min_free_bytes=spec.health.min_free_mib << 20,
        acceptance_min=spec.health.acceptance_min,
        draft_configured=plan.speculation,
        max_per_hour=spec.restart.max_per_hour,
        health_interval_seconds=health_interval,
        alert_for={name: duration(s) for name, s in spec.prometheus.alert_for_seconds.model_dump().items()},
        label_matchers=", ".join(f"{name}={_quoted(value)}" for name, value in sorted(spec.prometheus.labels.items())),
    )


def _quoted(value: str) -> str:
    # A JSON string of the text itself (no \u escapes of non-ASCII) is a YAML and a PromQL double-quoted string.
    return json.dumps(value, ensure_ascii=False)


def duration(seconds: int) -> str:
    """Seconds as a Prometheus duration: 900 -> 15m, 90 -> 1m30s, 0 -> 0s."""
    parts = [(seconds // 86400, "d"), (seconds % 86400 // 3600, "h"), (seconds % 3600 // 60, "m"), (seconds % 60, "s")]
    return "".join(f"{n}{unit}" for n, unit in parts if n) or "0s"


def launch_document(plan: Plan) -> dict[str, Any]:
    """What the launcher needs: the argv and how to tell the server is ready and drafting."""
    spec = plan.spec
    return {
        "argv": list(plan.argv),
        "health_url": f"{Endpoint(spec.server.host, spec.server.port).url}/health",
        "api_key_file": str(spec.server.api_key_file) if spec.server.api_key_file else None,
        "draft_configured": plan.speculation,
        "watchdog_seconds": spec.health.watchdog_seconds,
    }


def health_document(plan: Plan) -> dict[str, Any]:
    spec = plan.spec
    return {
        "server_url": Endpoint(spec.server.host, spec.server.port).url,
        "server_unit": paths.SERVER_UNIT,
        "draft_configured": plan.speculation,
        "planned_vram_bytes": {b.device: b.used_bytes for b in plan.budgets},
        "health": spec.health.model_dump(mode="json"),
        "restart": spec.restart.model_dump(mode="json"),
        "versions": spec.versions.model_dump(mode="json"),
        "prometheus": spec.prometheus.model_dump(mode="json"),
    }


def _json(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


# Rendered file (relative to the root) -> its template.
FILES = {
    f"etc/systemd/system/{paths.SERVER_UNIT}": "server.service.j2",
    f"etc/systemd/system/{paths.HEALTH_UNIT}": "health.service.j2",
    f"etc/systemd/system/{paths.RESTART_UNIT}": "restart.service.j2",
    f"etc/systemd/system/{paths.RESTART_TIMER}": "restart.timer.j2",
    "etc/llm-appliance/rendered/llm-appliance.nft": "firewall.nft.j2",
    "etc/llm-appliance/rendered/launch.json": "launch.json.j2",
    "etc/llm-appliance/rendered/health.json": "health.json.j2",
    "etc/llm-appliance/rendered/prometheus/llm-appliance.rules.yml": "alerts.rules.yml.j2",
    "etc/llm-appliance/rendered/prometheus/scrape.yml": "scrape.yml.j2",
    "etc/polkit-1/rules.d/50-llm-appliance.rules": "polkit.rules.j2",
}


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


def render(plan: Plan, spec_file: Path) -> dict[str, str]:
    """Every file of the appliance, by path relative to the root; the same plan gives the same bytes."""
    context = view(plan, spec_file)
    return {path: _environment().get_template(template).render(v=context) for path, template in sorted(FILES.items())}
