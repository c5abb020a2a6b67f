"""Engine and driver changes are measured, never trusted: a changed fingerprint is proven again and judged
against the figures before it; a slower engine is exported and fires LlmApplianceEngineRegressed.

NVML is a fake here (no GPU on these machines), behind the interface the real code uses; the engines are the
real llama-server, one of them slowed from outside (tests/fake_engines.py `slow`).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import fake_engines
import pytest
import yaml
from conftest import EXAMPLES

from appliance.facts.contention import CONTENDED_SHARE
from appliance.facts.engine_manifest import Manifest
from appliance.facts.engine_record import RECORD, EngineRecord, Measured, current_fingerprint, stale_reason
from appliance.facts.gpu import GpuMemory, GpuProcess
from appliance.health.daemon import export_engine_regression
from appliance.health.exporter import Metrics
from appliance.ops.engine_ladder import ensure_proven
from appliance.plan.resolved import resolve
from appliance.plan.validate import validate
from appliance.render.apply import installed_spec_path
from appliance.render.render import render

pytestmark = pytest.mark.engine
RULES = "etc/llm-appliance/rendered/prometheus/llm-appliance.rules.yml"
GIB = 1 << 30


class DriverNvml:
    """NVML of a machine with one RTX 4090 and the given driver: what `nvidia-smi` would say after an upgrade."""

    def __init__(self, driver: str, cuda: str = "12.4") -> None:
        self.driver, self.cuda = driver, cuda

    def gpus(self) -> list[GpuMemory]:
        return [GpuMemory(0, "NVIDIA GeForce RTX 4090", 24 * GIB, 0, 24 * GIB)]

    def driver_version(self) -> str:
        return self.driver

    def cuda_version(self) -> str:
        return self.cuda

    def processes(self, index: int) -> list[GpuProcess]:
        return []

    def process_utilization(self, index: int) -> dict[int, float]:
        return {}

    def xid_errors(self, index: int) -> int:
        return 0

    def energy_millijoules(self, index: int) -> int | None:
        return None

    def power_milliwatts(self, index: int) -> int:
        return 0


def test_a_new_driver_changes_the_fingerprint_and_the_proof_no_longer_holds(engine_binary: Path) -> None:
    manifest = Manifest.read(engine_binary.parent.parent)
    before = current_fingerprint(engine_binary, manifest, nvml=DriverNvml("550.54"))
    after = current_fingerprint(engine_binary, manifest, nvml=DriverNvml("560.28"))
    assert (before.driver, before.cuda, before.gpus) == ("550.54", "12.4", "NVIDIA GeForce RTX 4090")
    assert after.changes_from(before) == ["driver 550.54 -> 560.28"]
    cuda = current_fingerprint(engine_binary, manifest, nvml=DriverNvml("550.54", cuda="12.8"))
    assert cuda.changes_from(before) == ["CUDA 12.4 -> 12.8"]
    record = EngineRecord(before, "as-built", "proven as built", (), (str(engine_binary),), "2026-12-07T00:00:00Z")
    why = stale_reason(engine_binary, record, manifest, nvml=DriverNvml("560.28"))
    assert why == "it changed since its proof (driver 550.54 -> 560.28)"
    assert stale_reason(engine_binary, record, manifest, nvml=DriverNvml("550.54")) is None


def test_a_slower_engine_after_a_driver_upgrade_is_measured_against_the_one_before(
    engine_dir: Path, engine_binary: Path, spec_of: Callable[[Path], Path]
) -> None:
    binary = fake_engines.working(engine_dir / "bin" / "llama-server", engine_binary)
    spec = spec_of(binary)
    first, _ = ensure_proven(validate(spec), lambda _: None, engine_dir=engine_dir, nvml=DriverNvml("550.54"))
    assert first.previous is None and first.regression_ratio is None
    # The upgrade: a new driver, and an engine that now runs at a quarter of the speed.
    fake_engines.slow(binary, engine_binary)
    lines: list[str] = []
    second, proved = ensure_proven(validate(spec), lines.append, engine_dir=engine_dir, nvml=DriverNvml("560.28"))
    assert proved
    assert second.previous is not None
    assert (second.previous.decode_tps, second.previous.fingerprint) == (first.kept.decode_tps, first.fingerprint)
    assert "driver 550.54 -> 560.28" in second.changed and any(c.startswith("engine files") for c in second.changed)
    assert second.kept.decode_tps > 0
    ratio = second.regression_ratio
    print(f"\nbefore {first.kept.decode_tps} tok/s, after {second.kept.decode_tps} tok/s: {second.change_summary()}")
    if ratio is None:  # a neighbour took the CPUs while it was measured: no verdict, and it says so
        assert (
            max(first.kept.contended, second.kept.contended) > CONTENDED_SHARE
            or second.kept.contended > CONTENDED_SHARE
        )
        assert "not judged" in second.change_summary()
    else:
        assert ratio < 0.9, second.change_summary()
        assert "driver 550.54 -> 560.28" in second.change_summary()
    assert any(
        line.startswith("measured against the engine before: ") and "driver 550.54 -> 560.28" in line for line in lines
    )
    # Read back as written; a proof asked for again (nothing changed) keeps what it is judged against.
    assert EngineRecord.read(engine_dir / RECORD) == second
    again, _ = ensure_proven(
        validate(spec), lambda _: None, force=True, engine_dir=engine_dir, nvml=DriverNvml("560.28")
    )
    assert again.previous == second.previous and again.changed == second.changed


def test_the_regression_is_exported_and_fires_the_alert_through_promtool(
    engine_binary: Path, tmp_path: Path, fixture_models: Path
) -> None:
    """The daemon's export of a regressed record, scraped as Prometheus would, through the rendered rules."""
    before = current_fingerprint(engine_binary, None, nvml=DriverNvml("550.54"))
    after = dataclasses.replace(before, driver="560.28")
    trial = fake_trial(decode=40.0)
    record = EngineRecord(
        after,
        "as-built",
        "proven as built",
        (trial,),
        (str(engine_binary),),
        "2026-12-07T12:00:00Z",
        previous=Measured(before, 159.0, 900.0, "a" * 64, "2026-12-01T12:00:00Z"),
        changed=("driver 550.54 -> 560.28",),
    )
    metrics = Metrics()
    export_engine_regression(metrics, record, band=0.1)
    exposed = scraped(metrics)
    ((labels, value),) = exposed["llm_appliance_engine_regression_ratio"]
    # A build that answers differently says so too.
    assert labels == {"change": "driver 550.54 -> 560.28: decode 159 -> 40 tok/s, 0.25x; the greedy answer changed"}
    assert value == pytest.approx(0.252, abs=0.001)
    # Nothing changed: 1, and no change named.
    quiet = Metrics()
    export_engine_regression(quiet, dataclasses.replace(record, previous=None, changed=()), band=0.1)
    assert scraped(quiet)["llm_appliance_engine_regression_ratio"] == [({"change": ""}, 1.0)]

    spec = tmp_path / "demo.toml"
    spec.write_text((EXAMPLES / "demo.toml").read_text().replace("/var/lib/llm-appliance/models", str(fixture_models)))
    files = render(resolve(validate(spec).plan, installed_spec_path(spec)))
    rules = tmp_path / "rules.yml"
    rules.write_text(files[RULES])
    job = {"job": "llm-appliance-health", "instance": "127.0.0.1:9478", "appliance": "demo", **labels}
    selector = "llm_appliance_engine_regression_ratio{" + ",".join(f"{k}={json.dumps(v)}" for k, v in job.items()) + "}"
    test = {
        "rule_files": [str(rules)],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": [{"series": selector, "values": f"{value}x20"}],
                "alert_rule_test": [
                    {"eval_time": "30s", "alertname": "LlmApplianceEngineRegressed", "exp_alerts": []},
                    {
                        "eval_time": "2m",
                        "alertname": "LlmApplianceEngineRegressed",
                        "exp_alerts": [
                            {
                                "exp_labels": {**job, "severity": "critical"},
                                "exp_annotations": annotations(files[RULES], labels["change"], value),
                            }
                        ],
                    },
                ],
            }
        ],
    }
    case = tmp_path / "test.yml"
    case.write_text(yaml.safe_dump(test))
    result = subprocess.run(["promtool", "test", "rules", str(case)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def fake_trial(decode: float) -> object:
    from appliance.facts.engine_record import Trial

    return Trial("as-built", True, decode_tps=decode, prompt_tps=500.0, output_sha256="b" * 64)


def scraped(metrics: Metrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return found


def annotations(rules_text: str, change: str, value: float) -> dict[str, str]:
    """The alert's annotations as Prometheus expands them for this series (the rendered prose, templates filled)."""
    (rule,) = [
        r
        for group in yaml.safe_load(rules_text)["groups"]
        for r in group["rules"]
        if r.get("alert") == "LlmApplianceEngineRegressed"
    ]
    filled = {}
    for name, text in rule["annotations"].items():
        filled[name] = text.replace("{{ $labels.change }}", change).replace(
            "{{ $value | humanize }}", f"{value * 1000:.0f}m"
        )
    return filled
