"""HealthDaemon's decisions, driven with fakes behind its small interfaces and a fake clock.

FakeNvml stands for appliance.facts.gpu.Nvml, FakeControl for appliance.health.units.ServerControl, FakeApi for
appliance.runtime.server_api.ServerApi. The server process is this test process: the daemon counts the GPU
memory of the descendants of control.main_pid(), found through /proc.
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from conftest import appliance_of
from prometheus_client import CollectorRegistry

from appliance.facts.contention import Contention
from appliance.facts.gpu import MISMATCH_FIX, GpuMemory, GpuProcess, NvmlUnavailable
from appliance.health.daemon import CANARY_PROMPT, WARMUP_PROMPT, DaemonConfig, HealthDaemon, Observation
from appliance.health.exporter import Metrics
from appliance.health.state import RestartLog
from appliance.health.units import UnitError
from appliance.health.versions import Baseline
from appliance.runtime.server_api import ServerApi, ServerUnreachable
from appliance.spec.model import Spec

GIB = 1 << 30
MIB = 1 << 20
START = 1_700_000_000.0
INTERVAL = 30.0
RATE = 150.0
BUCKET = "ctx=unknown"  # FakeApi.slots() says nothing about context by default
MISMATCH = NvmlUnavailable(f"NVML: Driver/library version mismatch; {MISMATCH_FIX}", mismatch=True)


class FakeClock:
    def __init__(self, now: float = START) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float = INTERVAL) -> None:
        self.now += seconds


class FakeNvml:
    """One 80 GiB GPU; the server (this process) holds `server_bytes`; `failure` is raised by every call."""

    def __init__(self) -> None:
        self.total = 80 * GIB
        self.other_used = 2 * GIB
        self.server_bytes = 20 * GIB
        self.driver = "550.54.14"
        self.cuda = "12.4"
        self.xids = 0
        self.utilization: dict[int, float] = {}  # GPU 0's SM share by pid
        self.failure: NvmlUnavailable | None = None
        self.others: list[GpuMemory] = []  # more GPUs, not the server's
        self.watts = 300.0  # GPU 0's draw: its energy counter grows by this much each second of the clock
        self.millijoules: int | None = 10**9  # NVML's counter since the driver loaded; None: this GPU has none

    def _maybe_fail(self) -> None:
        if self.failure is not None:
            raise self.failure

    def gpus(self) -> list[GpuMemory]:
        self._maybe_fail()
        used = self.other_used + self.server_bytes
        return [GpuMemory(0, "NVIDIA H100 80GB HBM3", self.total, used, self.total - used), *self.others]

    def driver_version(self) -> str:
        self._maybe_fail()
        return self.driver

    def cuda_version(self) -> str:
        self._maybe_fail()
        return self.cuda

    def processes(self, index: int) -> list[GpuProcess]:
        self._maybe_fail()
        # Another process on the same GPU (not the server's) must not be counted.
        if index != 0:
            return [GpuProcess(2**22 + 18, self.total)]
        mine = [GpuProcess(os.getpid(), self.server_bytes)] if self.server_bytes else []
        return [*mine, GpuProcess(2**22 + 17, self.other_used)]

    def process_utilization(self, index: int) -> dict[int, float]:
        self._maybe_fail()
        return dict(self.utilization) if index == 0 else {}

    def xid_errors(self, index: int) -> int:
        self._maybe_fail()
        return self.xids

    def energy_millijoules(self, index: int) -> int | None:
        self._maybe_fail()
        return self.millijoules

    def power_milliwatts(self, index: int) -> int:
        self._maybe_fail()
        return int(self.watts * 1000)


class FakeCpu:
    """appliance.health.probe.CpuProbe's reading, scripted: what else used the machine (None: unreadable)."""

    def __init__(self) -> None:
        self.contention: Contention | None = None
        self.ours: set[int] = set()

    def read(self, ours: set[int]) -> Contention | None:
        self.ours = ours
        return self.contention


class FakeControl:
    def __init__(self, api: FakeApi | None = None) -> None:
        self.api = api
        self.is_active = True
        self.restarts: list[str] = []
        self.fail_restart = False

    def main_pid(self) -> int | None:
        return os.getpid()

    def active(self) -> bool:
        return self.is_active

    def restart(self, reason: str) -> None:
        self.restarts.append(reason)
        if self.fail_restart:
            raise UnitError("systemctl restart exited 1: access denied")
        if self.api is not None:
            self.api.reset()  # a new llama-server: its counters start from zero


class FakeApi:
    """llama-server's endpoints as scripted values; `*_error` is raised instead of answering."""

    timeout = 5.0

    def __init__(self) -> None:
        self.health_error: ServerUnreachable | None = None
        self.metrics_error: ServerUnreachable | None = None
        self.health_status = 200
        self.processing = 0.0
        self.deferred = 0.0
        self.slot_list: list[dict[str, Any]] = []
        self.canary_tps = 140.0
        self.completions: list[tuple[str, int, dict[str, Any]]] = []
        self.reset()

    def reset(self) -> None:
        self.tokens = self.seconds = self.drafted = self.accepted = 0.0

    def decode(self, rate: float, tokens: float = 1500, drafted: float = 0, accepted: float = 0) -> None:
        """Traffic since the last check: `tokens` generated at `rate` tok/s."""
        self.tokens += tokens
        self.seconds += tokens / rate
        self.drafted += drafted
        self.accepted += accepted

    def health(self) -> int:
        if self.health_error is not None:
            raise self.health_error
        return self.health_status

    def metrics(self) -> dict[str, float]:
        if self.metrics_error is not None:
            raise self.metrics_error
        return {
            "prompt_tokens_total": 0.0,
            "tokens_predicted_total": self.tokens,
            "tokens_predicted_seconds_total": self.seconds,
            "spec_decode_num_draft_tokens_total": self.drafted,
            "spec_decode_num_accepted_tokens_total": self.accepted,
            "requests_processing": self.processing,
            "requests_deferred": self.deferred,
        }

    def slots(self) -> list[dict[str, Any]]:
        return self.slot_list

    def completion(self, prompt: str, n_predict: int, timeout: float = 600.0, **params: Any) -> dict[str, Any]:
        self.completions.append((prompt, n_predict, params))
        self.decode(self.canary_tps, n_predict)
        return {"content": "...", "timings": {"predicted_per_second": self.canary_tps}}


def make_spec(tmp_path: Path, health: dict[str, Any] | None = None, draft: bool = False, **sections: Any) -> Spec:
    models: dict[str, Any] = {"target": {"path": "/models/target.gguf", "devices": ["CUDA0"], "gpu_layers": "all"}}
    if draft:
        models["draft"] = {"path": "/models/draft.gguf", "devices": ["CUDA0"], "gpu_layers": "all"}
    settings = {"baseline_file": str(tmp_path / "baseline.json"), "canary_after_idle_seconds": 0, **(health or {})}
    return Spec.model_validate({"models": models, "health": settings, **sections})


class Rig:
    """A daemon with its fakes, a fake clock and a registry of its own."""

    def __init__(self, tmp_path: Path, spec: Spec | None = None, **daemon: Any) -> None:
        self.tmp_path = tmp_path
        self.spec = spec or make_spec(tmp_path)
        self.state_file = tmp_path / "state" / "health-state.json"
        self.clock = FakeClock()
        self.api = FakeApi()
        self.nvml = FakeNvml()
        self.control = FakeControl(self.api)
        self.cpu = FakeCpu()
        self.extra = daemon  # more of HealthDaemon's parts (an evictor)
        self.daemon = self.new_daemon()

    def new_daemon(self) -> HealthDaemon:
        """A daemon as systemd starts it again (it is bound to the server): same state file, fresh metrics."""
        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry)
        config = DaemonConfig(appliance_of(self.spec, state_file=self.state_file), engine_dir=self.tmp_path)
        self.daemon = HealthDaemon(
            config,
            self.control,
            self.nvml,
            self.metrics,
            api=self.api,  # type: ignore[arg-type]
            clock=self.clock,
            cpu=self.cpu,  # type: ignore[arg-type]
            **self.extra,
        )
        return self.daemon

    def check(self, rate: float | None = RATE, **decode: float) -> Observation:
        """Thirty seconds pass (with traffic at `rate`, or none), then one check."""
        self.clock.advance()
        if self.nvml.millijoules is not None:
            self.nvml.millijoules += int(self.nvml.watts * INTERVAL * 1000)
        if rate is not None:
            self.api.decode(rate, **decode)
        return self.daemon.check()

    def value(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)

    def restarts(self, reason: str) -> float | None:
        return self.value("llm_appliance_restarts_total", reason=reason)

    def probe_errors(self, probe: str) -> float | None:
        return self.value("llm_appliance_probe_errors_total", probe=probe)


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


def learn_baseline(rig: Rig, rate: float = RATE) -> None:
    """The first check has no window; then baseline_windows windows make the baseline."""
    for _ in range(1 + rig.spec.health.baseline_windows):
        assert rig.check(rate).action == "none"
    assert rig.daemon.watch.decay.baselines == {BUCKET: rate}


def no_surprises(rig: Rig) -> None:
    assert rig.probe_errors("check") in (None, 0.0), "check() caught an unexpected exception"


# -- (a) decay --


def test_decay_restarts_the_server_and_is_remembered(rig: Rig) -> None:
    learn_baseline(rig)
    # median_of (5) slow windows fill the median, then `consecutive` (3) breaches: the 7th slow window.
    actions = [rig.check(0.7 * RATE).action for _ in range(7)]
    assert actions == ["none"] * 6 + ["restart"]
    restarted_at = rig.clock.now
    assert rig.control.restarts == ["decay"]
    assert rig.restarts("decay") == 1
    assert all(rig.restarts(r) == 0 for r in ("creep", "headroom", "hang", "not_on_gpu"))
    assert rig.value("llm_appliance_last_restart_timestamp_seconds") == restarted_at
    assert rig.value("llm_appliance_decode_baseline_tokens_per_second", bucket=BUCKET) == RATE
    assert rig.value("llm_appliance_decode_tokens_per_second", bucket=BUCKET) == pytest.approx(0.7 * RATE)
    assert RestartLog(rig.state_file).read() == [(restarted_at, "decay")]
    no_surprises(rig)

    # systemd restarts the daemon with the server: the count and the hourly budget survive.
    rig.clock.advance(60)
    daemon = rig.new_daemon()
    assert rig.restarts("decay") == 1
    assert rig.value("llm_appliance_last_restart_timestamp_seconds") == restarted_at
    assert daemon.turn.policy.history == [restarted_at]
    assert daemon.turn.policy.decide(rig.clock.now, "decay").action == "cooldown"


def test_restart_history_older_than_an_hour_counts_but_does_not_limit(rig: Rig) -> None:
    log = RestartLog(rig.state_file)
    for age in (7200, 5400, 30):
        log.append(START - age, "creep")
    daemon = rig.new_daemon()
    assert rig.restarts("creep") == 3
    assert daemon.turn.policy.history == [START - 30]


def test_the_restart_history_is_never_written_through_a_planted_link(tmp_path: Path) -> None:
    # The state directory belongs to the service user: a link at the old fixed temporary name, or at the
    # file itself, must not make the daemon write somewhere else.
    precious = tmp_path / "shadow"
    precious.write_text("root:secret\n")
    state = tmp_path / "state" / "health-state.json"
    state.parent.mkdir()
    state.with_suffix(".tmp").symlink_to(precious)
    log = RestartLog(state)
    log.append(START, "decay")
    state.unlink()
    state.symlink_to(precious)
    log.append(START + 1, "creep")
    assert precious.read_text() == "root:secret\n"
    assert not state.is_symlink()
    assert RestartLog(state).totals() == {"creep": 1}  # the link was replaced, not read as history


def test_a_slow_bucket_of_its_own_is_not_decay(rig: Rig) -> None:
    learn_baseline(rig)
    # Long conversations decode slower; they are a bucket of their own, not a decay of the short one.
    rig.api.slot_list = [{"id": 0, "n_prompt_tokens": 30000, "next_token": [{"n_decoded": 100}]}]
    for _ in range(20):
        assert rig.check(0.5 * RATE).action == "none"
    assert rig.daemon.watch.decay.baselines == {BUCKET: RATE, "ctx<=32K": 0.5 * RATE}
    assert rig.control.restarts == []


def test_decay_continues_counting_after_a_failed_restart(rig: Rig) -> None:
    rig.control.fail_restart = True
    learn_baseline(rig)
    for _ in range(7):
        rig.check(0.7 * RATE)
    assert rig.control.restarts == ["decay"]
    assert rig.restarts("decay") == 1  # attempted; the error is logged, the daemon lives on
    no_surprises(rig)


# -- (b) creep --


def test_vram_creep_restarts_the_server(rig: Rig) -> None:
    rig.check()  # no window yet: not warmed up
    assert rig.daemon.watch.creep.baseline is None
    rig.check()  # tokens generated: warmed up, the baseline is this sample
    assert rig.daemon.watch.creep.baseline == 20 * GIB
    assert rig.value("llm_appliance_server_vram_bytes") == 20 * GIB
    assert rig.value("llm_appliance_server_on_gpu") == 1
    rig.nvml.server_bytes = int(26 * GIB)  # +30%
    seen = rig.check()
    assert seen.action == "none"
    assert seen.creep == pytest.approx(0.3)
    assert rig.value("llm_appliance_server_vram_creep_ratio") == pytest.approx(0.3)
    assert rig.value("llm_appliance_server_vram_baseline_bytes") == 20 * GIB
    assert rig.value("llm_appliance_server_vram_bytes") == 26 * GIB
    assert rig.check().action == "none"
    seen = rig.check()
    assert (seen.action, seen.reason) == ("restart", "creep")
    assert rig.control.restarts == ["creep"]
    assert rig.restarts("creep") == 1
    # After the restart the fresh server gets a fresh baseline.
    assert rig.daemon.watch.creep.baseline is None
    rig.nvml.server_bytes = 20 * GIB
    for _ in range(10):
        assert rig.check().action == "none"
    assert rig.daemon.watch.creep.baseline == 20 * GIB
    assert rig.value("llm_appliance_server_vram_creep_ratio") == 0
    no_surprises(rig)


def test_creep_under_the_ratio_is_reported_not_acted_on(rig: Rig) -> None:
    rig.check()
    rig.check()
    rig.nvml.server_bytes = int(22 * GIB)  # +10%, under creep_ratio 0.15
    for _ in range(20):
        seen = rig.check()
    assert seen.creep == pytest.approx(0.1)
    assert rig.control.restarts == []


# -- (c) NVML failing mid-run --


def test_nvml_failing_mid_run_is_a_probe_error_not_a_restart(rig: Rig) -> None:
    rig.check()
    rig.check()
    assert rig.value("llm_appliance_gpu_visible") == 1
    rig.nvml.failure = NvmlUnavailable("NVML: GPU is lost")
    seen = rig.check()
    assert rig.value("llm_appliance_gpu_visible") == 0
    assert rig.probe_errors("nvml") == 1
    assert "GPU not visible (NVML: GPU is lost)" in seen.status()
    for expected in range(2, 12):
        seen = rig.check()
        assert seen.action == "none"
        assert rig.probe_errors("nvml") == expected
    assert rig.control.restarts == []
    assert seen.up and seen.decode_tps == RATE  # the server is still watched
    # A reading that cannot be taken is not a version change.
    assert rig.value("llm_appliance_version_drift") == 0
    assert "baseline stale" not in seen.status()
    no_surprises(rig)
    rig.nvml.failure = None
    rig.check()
    assert rig.value("llm_appliance_gpu_visible") == 1
    assert rig.value("llm_appliance_version_drift") == 0


def test_nvml_failing_only_for_processes_is_counted(rig: Rig) -> None:
    rig.check()
    original = rig.nvml.processes

    def lost(index: int) -> list[GpuProcess]:
        raise NvmlUnavailable("NVML: Unknown Error")

    rig.nvml.processes = lost  # type: ignore[method-assign]
    for _ in range(5):
        assert rig.check().action == "none"
    assert rig.probe_errors("nvml") == 5
    assert rig.value("llm_appliance_gpu_visible") == 1
    rig.nvml.processes = original  # type: ignore[method-assign]
    rig.check()
    assert rig.probe_errors("nvml") == 5
    assert rig.control.restarts == []
    no_surprises(rig)


def test_nvml_unavailable_from_the_start_then_back(rig: Rig) -> None:
    rig.nvml.failure = NvmlUnavailable("NVML: NVML Shared Library Not Found")
    for _ in range(3):
        rig.check()
    rig.nvml.failure = None
    seen = rig.check()
    # The versions seen once NVML answers are not a drift from "unknown".
    assert rig.value("llm_appliance_version_drift") == 0, seen.status()
    assert rig.value("llm_appliance_gpu_visible") == 1


def test_a_cpu_spec_expects_no_nvml(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    spec = spec.model_copy(
        update={
            "models": spec.models.model_copy(
                update={"target": spec.models.target.model_copy(update={"devices": ["none"], "gpu_layers": 0})}
            )
        }
    )
    rig = Rig(tmp_path, spec)
    assert rig.daemon.config.appliance.on_gpu is False
    rig.nvml.failure = NvmlUnavailable("NVML: NVML Shared Library Not Found")
    for _ in range(10):
        seen = rig.check()
    assert rig.probe_errors("nvml") == 0
    assert "GPU not visible" not in seen.status()
    assert rig.value("llm_appliance_gpu_visible") == 0
    assert rig.control.restarts == []


# -- (d) driver/library version mismatch --


def test_the_driver_library_mismatch_is_reported_as_such(rig: Rig) -> None:
    rig.check()
    assert rig.value("llm_appliance_version_mismatch") == 0
    rig.nvml.failure = MISMATCH
    for _ in range(3):
        seen = rig.check()
    assert rig.value("llm_appliance_version_mismatch") == 1
    assert "version mismatch: NVML: Driver/library version mismatch" in seen.status()
    assert "reboot" in seen.status()
    assert rig.value("llm_appliance_gpu_visible") == 0
    assert rig.control.restarts == []  # a restart cannot cure it; a reboot does
    no_surprises(rig)


def test_a_mismatch_from_the_start(rig: Rig) -> None:
    rig.nvml.failure = MISMATCH
    seen = rig.check()
    assert rig.value("llm_appliance_version_mismatch") == 1
    assert "Driver/library version mismatch" in seen.status()


def test_pinned_versions_that_differ_are_a_mismatch(tmp_path: Path) -> None:
    rig = Rig(tmp_path, make_spec(tmp_path, versions={"driver": "550", "cuda": "12.4"}))
    seen = rig.check()
    assert rig.value("llm_appliance_version_mismatch") == 0, seen.status()
    rig.nvml.driver = "555.42"
    seen = rig.check()
    assert rig.value("llm_appliance_version_mismatch") == 1
    assert "NVIDIA driver is 555.42, the spec pins 550" in seen.status()


# -- (e) garbage /metrics --


class GarbageServer(ServerApi):
    """The real client's parsing, over a body that is not Prometheus text."""

    def _request(
        self, path: str, body: dict[str, Any] | None = None, timeout: float | None = None
    ) -> tuple[int, bytes]:
        return 200, b"<html><body>502 Bad Gateway {{{</body></html>\n"


def test_garbage_metrics_are_a_probe_error_not_a_restart(rig: Rig) -> None:
    with pytest.raises(ServerUnreachable, match="not Prometheus text") as caught:
        GarbageServer("http://127.0.0.1:8080").metrics()
    rig.api.metrics_error = caught.value
    for expected in range(1, 21):
        seen = rig.check()
        assert seen.up and seen.action == "none"
        assert rig.probe_errors("metrics") == expected
    assert rig.control.restarts == []
    assert rig.value("llm_appliance_server_up") == 1
    no_surprises(rig)


def test_metrics_failing_after_warm_up_is_no_restart(rig: Rig) -> None:
    learn_baseline(rig)
    rig.api.metrics_error = ServerUnreachable(
        "http://127.0.0.1:8080/metrics answered 401 (is --metrics set, is the API key right?)"
    )
    for _ in range(20):
        assert rig.check().action == "none"
    assert rig.control.restarts == []
    assert rig.probe_errors("metrics") == 20


def test_an_unexpected_exception_is_counted_and_survived(rig: Rig) -> None:
    def broken() -> list[dict[str, Any]]:
        raise RuntimeError("surprise")

    rig.api.slots = broken  # type: ignore[method-assign]
    for _ in range(3):  # the first check has no window, so it asks for no slots
        rig.check()
    assert rig.probe_errors("check") == 2
    assert rig.control.restarts == []


# -- (f) hung server --


def test_a_hung_server_is_restarted(rig: Rig) -> None:
    rig.check()
    rig.api.health_error = ServerUnreachable("http://127.0.0.1:8080/health: timed out")
    assert [rig.check(None).action for _ in range(3)] == ["none", "none", "restart"]
    assert rig.control.restarts == ["hang"]
    assert rig.restarts("hang") == 1
    assert rig.probe_errors("health") == 3
    assert rig.value("llm_appliance_server_up") == 0


def test_a_refused_connection_is_down_not_hung(rig: Rig) -> None:
    rig.check()
    rig.api.health_error = ServerUnreachable("http://127.0.0.1:8080/health: [Errno 111] Connection refused")
    for _ in range(20):
        seen = rig.check(None)
        assert seen.action == "none"
        assert seen.status().startswith("server not answering /health")
    assert rig.control.restarts == []
    assert rig.probe_errors("health") == 20


def test_timeouts_of_an_inactive_unit_are_not_a_hang(rig: Rig) -> None:
    rig.control.is_active = False
    rig.api.health_error = ServerUnreachable("http://127.0.0.1:8080/health: timed out")
    for _ in range(10):
        rig.check(None)
    assert rig.control.restarts == []


def test_a_hang_must_be_consecutive(rig: Rig) -> None:
    timed_out = ServerUnreachable("http://127.0.0.1:8080/health: timed out")
    for _ in range(5):
        for error in (timed_out, timed_out, None):
            rig.api.health_error = error
            rig.check(None)
    assert rig.control.restarts == []


# -- (g) not on the GPU --


def test_a_server_off_the_gpu_is_restarted_once(rig: Rig) -> None:
    rig.nvml.server_bytes = 0
    seen = rig.check()  # no tokens yet: not warmed up, no verdict
    assert seen.action == "none" and "NOT on the GPU" not in seen.status()
    seen = rig.check()
    assert (seen.action, seen.reason) == ("restart", "not_on_gpu")
    assert "server is NOT on the GPU" in seen.status()
    assert rig.value("llm_appliance_server_on_gpu") == 0
    for _ in range(200):  # well past the cooldown and the hour
        seen = rig.check()
        assert seen.action == "none"
    assert "server is NOT on the GPU" in seen.status()
    assert rig.control.restarts == ["not_on_gpu"]
    assert rig.restarts("not_on_gpu") == 1


def test_not_on_gpu_is_restarted_once_across_daemon_restarts(rig: Rig) -> None:
    # systemd stops and starts the daemon with the server (BindsTo=): the one restart must hold across it.
    rig.nvml.server_bytes = 0
    rig.check()
    rig.check()
    assert rig.control.restarts == ["not_on_gpu"]
    for _ in range(3):
        rig.new_daemon()
        for _ in range(50):
            assert rig.check().action == "none"
    assert rig.control.restarts == ["not_on_gpu"]


def test_a_server_on_the_gpu_is_left_alone(rig: Rig) -> None:
    for _ in range(20):
        assert rig.check().action == "none"
    assert rig.value("llm_appliance_server_on_gpu") == 1
    assert rig.control.restarts == []


# -- (h) the status line --


def test_the_status_line(tmp_path: Path) -> None:
    rig = Rig(tmp_path, make_spec(tmp_path, draft=True))
    assert rig.daemon.config.appliance.draft_in_use
    traffic = {"drafted": 1000, "accepted": 710}
    assert rig.check(**traffic).status() == "server up, no decode measured yet"
    rig.nvml.server_bytes = int(20 * GIB)
    assert rig.check(**traffic).status() == "decode 150 tok/s (learning baseline), acceptance 0.71, creep 0%"
    rig.nvml.server_bytes = int(20.6 * GIB)
    for _ in range(4):
        rig.check(**traffic)
    seen = rig.check(**traffic)
    assert seen.status() == "decode 150 tok/s (baseline 150), acceptance 0.71, creep 3%"
    assert rig.value("llm_appliance_speculation_acceptance_ratio") == pytest.approx(0.71)
    assert rig.value("llm_appliance_speculation_engaged") == 1
    assert rig.value("llm_appliance_speculation_drafted_tokens_total") == 6000
    assert rig.value("llm_appliance_speculation_accepted_tokens_total") == 4260


def test_a_draft_that_never_drafts_is_reported(tmp_path: Path) -> None:
    rig = Rig(tmp_path, make_spec(tmp_path, draft=True))
    rig.check()
    seen = rig.check()
    assert "SPECULATION NOT ENGAGED" in seen.status()
    assert rig.value("llm_appliance_speculation_engaged") == 0


def test_the_status_line_of_a_server_that_is_down(rig: Rig) -> None:
    rig.api.health_error = ServerUnreachable("http://127.0.0.1:8080/health: [Errno 111] Connection refused")
    assert rig.check(None).status() == "server not answering /health"


def test_the_status_line_names_a_pending_restart(rig: Rig) -> None:
    learn_baseline(rig)
    rig.api.processing = 1
    for _ in range(7):
        seen = rig.check(0.5 * RATE)
    assert seen.status() == "decode 75 tok/s (baseline 150), creep 0%, restart wait (decay)"


# -- (i) version drift --


def test_a_baseline_measured_under_another_driver_is_stale(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    baseline = Baseline(
        {BUCKET: RATE}, {"driver": "550.54.14", "cuda": "12.4", "llama_cpp": None}, "2024-05-01T12:00:00Z"
    )
    spec.health.baseline_file.write_text(baseline.to_json())
    rig = Rig(tmp_path, spec)
    assert rig.daemon.watch.decay.baselines == {BUCKET: RATE}  # preset: no learning windows
    rig.nvml.driver = "555.42"
    rig.check()
    seen = rig.check()
    assert rig.value("llm_appliance_version_drift") == 1
    assert "versions changed since the baseline (driver: 550.54.14 -> 555.42); baseline stale" in seen.status()
    assert seen.status().startswith("decode 150 tok/s (baseline 150)")
    bindings = metadata.version("llama-cpp-python")
    assert (
        rig.value(
            "llm_appliance_version_info", driver="555.42", cuda="12.4", llama_cpp="unknown", llama_cpp_python=bindings
        )
        == 1
    )


def test_a_baseline_under_the_same_versions_is_current(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    baseline = Baseline(
        {BUCKET: RATE}, {"driver": "550.54.14", "cuda": "12.4", "llama_cpp": None}, "2024-05-01T12:00:00Z"
    )
    spec.health.baseline_file.write_text(baseline.to_json())
    rig = Rig(tmp_path, spec)
    seen = rig.check()
    assert rig.value("llm_appliance_version_drift") == 0
    assert "stale" not in seen.status()


def test_a_driver_upgraded_under_a_running_daemon_is_drift(rig: Rig) -> None:
    rig.check()
    assert rig.value("llm_appliance_version_drift") == 0
    rig.nvml.driver, rig.nvml.cuda = "555.42", "12.5"
    seen = rig.check()
    assert rig.value("llm_appliance_version_drift") == 1
    assert "driver: 550.54.14 -> 555.42, cuda: 12.4 -> 12.5" in seen.status()


def test_a_broken_baseline_file_is_ignored(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    spec.health.baseline_file.write_text("{not json")
    rig = Rig(tmp_path, spec)
    assert rig.daemon.watch.decay.baselines == {}
    learn_baseline(rig)


# -- (j) a busy server --


def test_a_busy_server_is_restarted_after_idle_timeout(rig: Rig) -> None:
    learn_baseline(rig)
    rig.api.processing = 2
    for _ in range(6):
        assert rig.check(0.7 * RATE).action == "none"
    seen = rig.check(0.7 * RATE)
    assert (seen.action, seen.reason) == ("wait", "decay")
    wanted_at = rig.clock.now
    assert rig.value("llm_appliance_restart_pending") == 1
    idle_timeout = rig.spec.restart.idle_timeout_seconds
    while rig.clock.now + INTERVAL < wanted_at + idle_timeout:
        assert rig.check(0.7 * RATE).action == "wait"
        assert rig.control.restarts == []
    seen = rig.check(0.7 * RATE)
    assert rig.clock.now == wanted_at + idle_timeout
    assert seen.action == "restart"
    assert rig.control.restarts == ["decay"]
    assert rig.value("llm_appliance_restart_pending") == 0


def test_a_busy_server_is_restarted_as_soon_as_it_is_idle(rig: Rig) -> None:
    learn_baseline(rig)
    rig.api.processing = 1
    for _ in range(8):
        rig.check(0.7 * RATE)
    assert rig.control.restarts == []
    rig.api.processing = 0
    assert rig.check(0.7 * RATE).action == "restart"
    assert rig.control.restarts == ["decay"]


def test_restarts_stop_at_max_per_hour(tmp_path: Path) -> None:
    rig = Rig(tmp_path, make_spec(tmp_path, restart={"cooldown_seconds": 0, "max_per_hour": 2}))
    rig.api.health_error = ServerUnreachable("http://127.0.0.1:8080/health: timed out")
    actions = [rig.check(None).action for _ in range(30)]
    assert rig.control.restarts == ["hang", "hang"]
    assert actions[-1] == "exhausted"
    assert rig.value("llm_appliance_restart_budget_exhausted") == 1


# -- the rest of what a check sees --


def test_low_headroom_restarts_the_server(rig: Rig) -> None:
    rig.check()
    rig.nvml.other_used = rig.nvml.total - rig.nvml.server_bytes - 100 * MIB  # under min_free_mib 512
    actions = [rig.check().action for _ in range(3)]
    assert actions == ["none", "none", "restart"]
    assert rig.control.restarts == ["headroom"]
    assert rig.value("llm_appliance_gpu_memory_free_bytes", device="CUDA0") == 100 * MIB


def test_a_full_gpu_the_server_does_not_use_is_not_its_headroom(rig: Rig) -> None:
    # models.target.devices = ["CUDA0"]; another workload fills CUDA1.
    rig.nvml.others = [GpuMemory(1, "NVIDIA H100 80GB HBM3", 80 * GIB, 80 * GIB - 10 * MIB, 10 * MIB)]
    for _ in range(20):
        assert rig.check().action == "none"
    assert rig.control.restarts == []
    assert rig.value("llm_appliance_gpu_memory_free_bytes", device="CUDA1") == 10 * MIB
    assert rig.value("llm_appliance_server_vram_bytes") == 20 * GIB  # CUDA1's process is not the server's


def test_xid_errors_are_counted_once_each(rig: Rig) -> None:
    rig.nvml.xids = 2
    rig.check()
    rig.check()
    rig.nvml.xids = 5
    rig.check()
    assert rig.value("llm_appliance_gpu_xid_errors_total", device="CUDA0") == 5


def canaries(rig: Rig) -> list[tuple[str, int, dict[str, Any]]]:
    """The canary completions, not the warm-up one after each (re)start."""
    return [c for c in rig.api.completions if c[0] != WARMUP_PROMPT]


def test_an_idle_server_is_measured_by_a_canary(tmp_path: Path) -> None:
    rig = Rig(tmp_path, make_spec(tmp_path, {"canary_after_idle_seconds": 300}))
    for _ in range(9):
        rig.check(None)
    assert canaries(rig) == []
    rig.check(None)  # 300 s idle
    assert [(p, n) for p, n, _ in canaries(rig)] == [(CANARY_PROMPT, 32)]
    assert canaries(rig)[0][2]["temperature"] == 0
    assert rig.daemon.watch.decay._learning["canary"] == [140.0]
    # The canary's own tokens are not traffic, and a busy server gets no canary.
    rig.check(None)
    assert BUCKET not in rig.daemon.watch.decay._learning
    rig.api.processing = 1
    for _ in range(30):
        rig.check(None)
    assert len(canaries(rig)) == 1


# -- readiness for balancers (/ready) --


def test_readiness_follows_the_server_loading_up_down_and_a_restart(rig: Rig) -> None:
    readiness = rig.daemon.readiness
    assert readiness.reason == "loading"  # nothing seen yet
    rig.api.health_status = 503  # llama-server loading its model
    rig.check(None)
    assert readiness.reason == "loading"
    rig.api.health_status = 200
    rig.check(None)
    assert readiness.reason is None and rig.value("llm_appliance_ready") == 1
    rig.api.health_error = ServerUnreachable("connection refused")
    rig.check(None)
    assert readiness.reason == "down" and rig.value("llm_appliance_ready") == 0
    rig.api.health_error = None
    rig.check(None)
    rig.daemon.restart("manual", "test", rig.clock.now)
    assert readiness.reason == "restarting"
    rig.check(None)
    assert readiness.reason is None


def test_a_draining_daemon_stays_not_ready_while_the_server_is_up(rig: Rig) -> None:
    rig.daemon.turn.draining = True
    rig.check(None)
    assert rig.daemon.readiness.reason == "draining"
    assert rig.value("llm_appliance_draining") == 1 and rig.value("llm_appliance_ready") == 0


def test_a_window_of_a_few_tokens_sets_no_rate(rig: Rig) -> None:
    # A warm-up the daemon gave up on and the server finished: 4 tokens timed in microseconds by llama-server.
    rig.check(None)
    seen = rig.check(1_000_000, tokens=4)
    assert seen.decode_tps is None
    assert rig.value("llm_appliance_decode_tokens_per_second", bucket="ctx<=1K") is None
    assert rig.check(RATE).decode_tps == RATE


# -- speculation that stops paying: the measured gain against the baseline's no-speculation rate --


def _no_speculation_baseline(tmp_path: Path, rate: float, draft: bool = True) -> Spec:
    spec = make_spec(tmp_path, draft=draft)
    baseline = Baseline(
        {BUCKET: RATE},
        {"driver": "550.54.14", "cuda": "12.4", "llama_cpp": None},
        "2024-05-01T12:00:00Z",
        {BUCKET: rate},
    )
    spec.health.baseline_file.write_text(baseline.to_json())
    return spec


def test_speculation_slower_than_without_is_exported_and_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig = Rig(tmp_path, _no_speculation_baseline(tmp_path, 2 * RATE))
    assert rig.value("llm_appliance_decode_no_speculation_tokens_per_second", bucket=BUCKET) == 2 * RATE
    caplog.set_level("INFO", logger="llm-appliance.health")
    rig.check()
    for _ in range(6):
        rig.check(RATE, drafted=800, accepted=700)
    assert rig.value("llm_appliance_speculation_speedup", bucket=BUCKET) == pytest.approx(0.5)
    said = [r.getMessage() for r in caplog.records if "does not pay" in r.getMessage()]
    assert said == [
        f"speculation does not pay in {BUCKET}: 0.50x the rate without it (300.0 tok/s);"
        f" run `llm-appliance tune {rig.daemon.config.appliance.spec_file}`"
    ]
    for _ in range(6):
        rig.check(3 * RATE, drafted=800, accepted=700)
    assert rig.value("llm_appliance_speculation_speedup", bucket=BUCKET) == pytest.approx(1.5)
    assert [r.getMessage() for r in caplog.records if "pays again" in r.getMessage()] == [
        f"speculation pays again in {BUCKET}: 1.50x the rate without it"
    ]
    assert rig.control.restarts == []  # the config and the server are the admin's: nothing changed by itself


def test_no_speedup_without_a_no_speculation_baseline_or_without_a_draft(tmp_path: Path) -> None:
    rig = Rig(tmp_path, make_spec(tmp_path, draft=True))
    for _ in range(7):
        rig.check(RATE, drafted=800, accepted=700)
    assert rig.value("llm_appliance_speculation_speedup", bucket=BUCKET) is None
    plain = tmp_path / "plain"
    plain.mkdir()
    rig = Rig(plain, _no_speculation_baseline(plain, 2 * RATE, draft=False))
    for _ in range(7):
        rig.check(RATE)
    assert rig.value("llm_appliance_speculation_speedup", bucket=BUCKET) is None
