"""Energy: RAPL read for real from files in the kernel's powercap layout (wrap-around included), and from this
machine's own /sys when it has any; NVML's counter and power draw through the fake GPU; the daemon's counter and
joules per generated token, and its silence where nothing can be read."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from test_daemon_logic import INTERVAL, RATE, FakeClock, FakeNvml, Rig, make_spec

from appliance.facts.energy_meters import POWERCAP, Energy, EnergyUnreadable, NvmlMeter, RaplMeter, meters_for
from appliance.facts.gpu import NvmlUnavailable
from appliance.health.energy_probe import EnergyProbe
from appliance.health.exporter import Metrics
from appliance.health.probe import CANARY_PROMPT, WARMUP_PROMPT

REPO = Path(__file__).resolve().parent.parent
RANGE_UJ = 262_143_328_850  # a real package's max_energy_range_uj
ENERGY = "llm_appliance_energy_joules_total"
PER_TOKEN = "llm_appliance_energy_per_token_joules"


class Powercap:
    """/sys/class/powercap as the kernel lays it out: every zone, subzones too, a directory of its own there."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "intel-rapl").mkdir(parents=True)  # the control type: no counter of its own
        (root / "intel-rapl" / "enabled").write_text("1\n")

    def zone(self, zone: str, name: str, energy_uj: int = 0, range_uj: int = RANGE_UJ) -> None:
        path = self.root / zone
        path.mkdir()
        (path / "name").write_text(name + "\n")
        (path / "max_energy_range_uj").write_text(f"{range_uj}\n")
        self.set(zone, energy_uj)

    def set(self, zone: str, energy_uj: int) -> None:
        (self.root / zone / "energy_uj").write_text(f"{energy_uj}\n")

    def add(self, zone: str, joules: float) -> None:
        now = int((self.root / zone / "energy_uj").read_text())
        range_uj = int((self.root / zone / "max_energy_range_uj").read_text())
        self.set(zone, (now + int(joules * 1e6)) % range_uj)


@pytest.fixture
def powercap(tmp_path: Path) -> Powercap:
    tree = Powercap(tmp_path / "powercap")
    tree.zone("intel-rapl:0", "package-0", 5_000_000)
    tree.zone("intel-rapl:0:0", "core", 1_000_000)
    tree.zone("intel-rapl:0:1", "uncore", 1_000_000)
    tree.zone("intel-rapl:0:2", "dram", 7_000_000)
    tree.zone("intel-rapl:1", "package-1", 9_000_000)
    return tree


# -- RAPL --


def test_rapl_counts_the_packages_and_dram_not_their_inner_parts(powercap: Powercap) -> None:
    meter = RaplMeter(powercap.root)
    assert meter.joules() == 0.0  # the first reading is the origin
    powercap.add("intel-rapl:0", 20.0)
    powercap.add("intel-rapl:1", 10.0)
    powercap.add("intel-rapl:0:2", 3.0)
    powercap.add("intel-rapl:0:0", 15.0)  # core lies inside package-0: already counted there
    powercap.add("intel-rapl:0:1", 2.0)
    assert meter.joules() == pytest.approx(33.0)
    assert meter.joules() == pytest.approx(33.0)  # nothing drawn since


def test_rapl_skips_psys_which_holds_the_packages(powercap: Powercap) -> None:
    powercap.zone("intel-rapl:2", "psys", 0)
    meter = RaplMeter(powercap.root)
    meter.joules()
    powercap.add("intel-rapl:2", 50.0)
    powercap.add("intel-rapl:0", 30.0)
    assert meter.joules() == pytest.approx(30.0)


def test_rapl_counts_across_the_wrap_of_a_counter(tmp_path: Path) -> None:
    tree = Powercap(tmp_path / "powercap")
    tree.zone("intel-rapl:0", "package-0", RANGE_UJ - 4_000_000)
    meter = RaplMeter(tree.root)
    meter.joules()
    tree.add("intel-rapl:0", 3.0)
    assert meter.joules() == pytest.approx(3.0)
    tree.add("intel-rapl:0", 2.5)  # 1 J to the top of the range, then from 0 to 1.5 J
    assert int((tree.root / "intel-rapl:0" / "energy_uj").read_text()) == 1_500_000
    assert meter.joules() == pytest.approx(5.5)
    tree.add("intel-rapl:0", 0.25)
    assert meter.joules() == pytest.approx(5.75)


def test_rapl_where_the_kernel_has_none_says_so(tmp_path: Path) -> None:
    with pytest.raises(EnergyUnreadable, match=r"no .*/absent: this kernel exposes no RAPL counters"):
        RaplMeter(tmp_path / "absent").joules()
    Powercap(tmp_path / "empty")
    with pytest.raises(EnergyUnreadable, match="no RAPL package zone under"):
        RaplMeter(tmp_path / "empty").joules()


def test_rapl_files_that_hold_no_count_are_unreadable_not_a_crash(powercap: Powercap) -> None:
    (powercap.root / "intel-rapl:1" / "energy_uj").write_text("")
    with pytest.raises(EnergyUnreadable, match=r"intel-rapl:1/energy_uj holds '', not a count of microjoules"):
        RaplMeter(powercap.root).joules()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another user")
def test_rapl_readable_by_root_only_says_so_to_another_user(tmp_path: Path) -> None:
    # What a kernel since 5.10 does to energy_uj, and what the health daemon (User=llm-appliance) meets.
    outside = Path(os.environ.get("TMPDIR", "/tmp")) / f"powercap-{os.getpid()}"
    tree = Powercap(outside)
    try:
        tree.zone("intel-rapl:0", "package-0", 1_000_000)
        for path in outside.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o444)
        outside.chmod(0o755)
        (outside / "intel-rapl:0" / "energy_uj").chmod(0o400)
        code = f"from pathlib import Path; from appliance.facts.energy_meters import RaplMeter; RaplMeter(Path({str(outside)!r})).joules()"
        result = subprocess.run(
            ["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups", sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            cwd="/",
            check=False,
        )
    finally:
        subprocess.run(["rm", "-rf", str(outside)], check=True)
    assert result.returncode == 1
    assert (
        f"EnergyUnreadable: {outside}/intel-rapl:0/energy_uj is readable by root only (Linux 5.10 and later, "
        "against the PLATYPUS power side channel)" in result.stderr
    )


def test_this_machine_reads_rapl_or_says_why_not() -> None:
    meter = RaplMeter()
    try:
        first = meter.joules()
    except EnergyUnreadable as exc:
        if POWERCAP.is_dir():
            assert "RAPL" in str(exc) or "root only" in str(exc) or "cannot read" in str(exc)
        else:
            assert str(exc).startswith(f"no {POWERCAP}: this kernel exposes no RAPL counters")
        return
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:  # a busy half second draws energy
        sum(range(10_000))
    assert meter.joules() > first == 0.0


# -- NVML --


class Gpus(FakeNvml):
    """The fake GPU, with an energy counter for each index."""

    def __init__(self, **millijoules: int) -> None:
        super().__init__()
        self.counters = {int(k.removeprefix("gpu")): v for k, v in millijoules.items()}

    def energy_millijoules(self, index: int) -> int | None:
        self._maybe_fail()
        return self.counters[index]


def test_nvml_counts_each_gpu_of_the_server_from_its_energy_counter() -> None:
    nvml = Gpus(gpu0=10**9, gpu1=5 * 10**8, gpu2=0)
    meter = NvmlMeter(nvml, [1, 0])  # GPU 2 is not the server's
    assert meter.joules() == 0.0
    nvml.counters[0] += 1500
    nvml.counters[1] += 500
    nvml.counters[2] += 10**6
    assert meter.joules() == pytest.approx(2.0)
    nvml.counters[1] = 10  # its driver reloaded: the counter starts again, and that window is lost
    assert meter.joules() == pytest.approx(2.0)
    nvml.counters[1] += 2000
    nvml.counters[0] += 1000
    assert meter.joules() == pytest.approx(5.0)


def test_nvml_integrates_the_power_draw_of_a_gpu_without_an_energy_counter() -> None:
    nvml, clock = FakeNvml(), FakeClock(100.0)
    nvml.millijoules = None
    meter = NvmlMeter(nvml, [0], clock=clock)
    assert meter.joules() == 0.0
    clock.advance(10)
    nvml.watts = 200.0  # from 300 W to 200 W: the trapezoid's mean, 250 W, for 10 s
    assert meter.joules() == pytest.approx(2500.0)
    clock.advance(2)
    assert meter.joules() == pytest.approx(2900.0)


def test_nvml_errors_are_energy_unreadable_with_their_text() -> None:
    nvml = FakeNvml()
    nvml.failure = NvmlUnavailable("NVML: NVML Shared Library Not Found")
    with pytest.raises(EnergyUnreadable, match=r"^NVML: NVML Shared Library Not Found$"):
        NvmlMeter(nvml, [0]).joules()


def test_the_meters_of_a_cpu_server_and_of_a_gpu_server() -> None:
    nvml = FakeNvml()
    assert [m.source for m in meters_for([], nvml)] == ["rapl"]
    assert [m.source for m in meters_for(["none"], nvml)] == ["rapl"]
    gpu = meters_for(["CUDA1", "CUDA0"], nvml)
    assert [m.source for m in gpu] == ["nvml", "rapl"]
    assert isinstance(gpu[0], NvmlMeter) and gpu[0].indices == (1, 0)


def test_a_measurement_sums_the_readable_meters_and_keeps_why_the_others_are_not(
    powercap: Powercap, tmp_path: Path
) -> None:
    nvml = FakeNvml()
    energy = Energy([NvmlMeter(nvml, [0]), RaplMeter(powercap.root), RaplMeter(tmp_path / "absent")])
    assert energy.sources == ("nvml", "rapl")
    assert energy.unreadable == {"rapl": f"no {tmp_path}/absent: {RAPL_ABSENT}"}
    start = energy.joules()
    assert start is not None
    assert nvml.millijoules is not None
    nvml.millijoules += 4000
    powercap.add("intel-rapl:1", 1.0)
    assert energy.joules() == pytest.approx(start + 5.0)
    nothing = Energy([RaplMeter(tmp_path / "absent")])
    assert nothing.sources == () and nothing.joules() is None


RAPL_ABSENT = "this kernel exposes no RAPL counters (a virtual machine, or no intel_rapl driver)"


# -- the daemon --


def test_the_probe_counts_joules_and_joules_per_token_over_recent_windows(powercap: Powercap) -> None:
    registry = CollectorRegistry()
    probe = EnergyProbe([RaplMeter(powercap.root)], Metrics(registry), recent=2)
    probe.mark()
    assert registry.get_sample_value(ENERGY, {"source": "rapl"}) == 0.0
    assert registry.get_sample_value(PER_TOKEN, {"source": "rapl"}) is None  # no window yet
    powercap.add("intel-rapl:0", 100.0)
    probe.window(50)
    assert registry.get_sample_value(PER_TOKEN, {"source": "rapl"}) == pytest.approx(2.0)
    powercap.add("intel-rapl:0", 30.0)
    probe.window(0)  # an idle window: counted as energy, not charged to tokens
    powercap.add("intel-rapl:0", 60.0)
    probe.window(100)
    assert registry.get_sample_value(PER_TOKEN, {"source": "rapl"}) == pytest.approx(160 / 150)
    powercap.add("intel-rapl:0", 10.0)
    probe.window(100)  # the first window leaves the recent two
    assert registry.get_sample_value(PER_TOKEN, {"source": "rapl"}) == pytest.approx(70 / 200)
    assert registry.get_sample_value(ENERGY, {"source": "rapl"}) == pytest.approx(200.0)


def test_an_unreadable_source_is_said_once_and_exports_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    registry = CollectorRegistry()
    probe = EnergyProbe([RaplMeter(tmp_path / "absent")], Metrics(registry))
    caplog.set_level(logging.INFO, "llm-appliance.health")
    probe.mark()
    for _ in range(3):
        probe.window(100)
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"energy (rapl) not measured, no metric exported for it: no {tmp_path}/absent: {RAPL_ABSENT}"]
    text = "\n".join(
        f"{s.name} {s.labels}" for family in registry.collect() for s in family.samples if "energy" in s.name
    )
    assert text == ""


def test_the_daemon_exports_the_gpus_joules_per_generated_token(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    for _ in range(4):
        rig.check(RATE, tokens=1500)
    # 300 W for each 30 s window of 1500 tokens.
    assert rig.value(PER_TOKEN, source="nvml") == pytest.approx(300 * INTERVAL / 1500)
    assert rig.value(ENERGY, source="nvml") == pytest.approx(3 * 300 * INTERVAL)
    assert rig.probe_errors("check") == 0.0


def test_the_canary_and_the_warm_up_are_not_charged_to_traffic(tmp_path: Path) -> None:
    rig = Rig(tmp_path, make_spec(tmp_path, health={"canary_after_idle_seconds": 60}))
    for _ in range(3):
        rig.check(RATE, tokens=1500)  # the first check warms up; two windows of traffic follow
    rig.check(None)
    rig.check(None)  # idle for 60 s: the canary runs
    assert [prompt for prompt, _, _ in rig.api.completions] == [WARMUP_PROMPT, CANARY_PROMPT]
    rig.check(RATE, tokens=3000)
    # Three windows of 30 s at 300 W over their tokens; the canary's 32 are not among them.
    assert rig.value(PER_TOKEN, source="nvml") == pytest.approx(3 * 300 * INTERVAL / (1500 + 1500 + 3000))


def test_a_gpu_daemon_without_nvml_exports_no_energy(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.nvml.failure = NvmlUnavailable("NVML: NVML Shared Library Not Found")
    for _ in range(3):
        rig.check(RATE)
    assert rig.value(ENERGY, source="nvml") is None and rig.value(PER_TOKEN, source="nvml") is None
    assert rig.probe_errors("check") == 0.0


class Broken:
    source = "nvml"

    def joules(self) -> float:
        raise RuntimeError("a bug in a meter")


def test_a_surprise_in_a_meter_costs_the_check_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "llm-appliance.health")
    rig = Rig(tmp_path)
    rig.daemon.watch.energy.meters = [Broken()]
    for _ in range(3):
        seen = rig.check(RATE)
    assert seen.up and seen.decode_tps == RATE
    assert rig.probe_errors("check") == 0.0
    said = [r.getMessage() for r in caplog.records if "energy" in r.getMessage()]
    assert said == ["energy (nvml) not measured, no metric exported for it: RuntimeError: a bug in a meter"]
