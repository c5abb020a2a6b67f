"""A busy machine is not a decaying server: samples taken while other processes ate the CPUs (or the server's
GPU) are counted and not judged, the episode is logged once with its top consumer, the daemon never restarts
for decay meanwhile; a slow canary is a sample, a failed one is not.

The logic with the daemon's fakes (the CPU reading scripted), then the real demo under `up` beside busy loops
on every core of this machine.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import UpProcess
from test_daemon_logic import BUCKET, RATE, Rig, learn_baseline, make_spec
from test_health_daemon import Traffic, Windows, fast_demo, metric, scrape, wait_ready, wait_until
from test_launch import free_port

from appliance.facts.contention import Contention
from appliance.health.detectors import CANARY_BUCKET
from appliance.runtime.server_api import ServerApi, ServerUnreachable

HOG = Contention(0.9, "stress[4242] 88%", 0.88, waited=0.5)
FILLER = Contention(0.9, "backup[4343] 88%", 0.88, waited=0.01)  # uses what the server leaves idle


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


def slow_checks(rig: Rig, count: int) -> list[str]:
    return [rig.check(0.5 * RATE).action for _ in range(count)]


def test_a_contended_slow_sample_is_counted_not_judged(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    learn_baseline(rig)
    rig.cpu.contention = HOG
    with caplog.at_level(logging.INFO, "llm-appliance.health"):
        actions = slow_checks(rig, 12)
    assert set(actions) == {"none"} and rig.control.restarts == []
    assert rig.value("llm_appliance_decode_contended_samples_total") == 12
    assert rig.value("llm_appliance_contended") == 1
    assert rig.value("llm_appliance_contention_share", resource="cpu") == 0.9
    assert rig.daemon.watch.decay.breaches.get(BUCKET, 0) == 0
    shared = [r.getMessage() for r in caplog.records if "the box is shared" in r.getMessage()]
    assert len(shared) == 1 and "stress[4242]" in shared[0] and "90% of the CPUs" in shared[0]  # once an episode
    seen = rig.check(0.5 * RATE)
    assert "contended: other processes used 90%" in seen.status()

    # Over: said once; the server's own slowness is judged again, and restarts it.
    rig.cpu.contention = Contention(0.02, "")
    with caplog.at_level(logging.INFO, "llm-appliance.health"):
        actions = slow_checks(rig, 7)
    assert "contention over after" in caplog.text and "13 decode samples not counted" in caplog.text
    assert actions[-1] == "restart" and rig.control.restarts == ["decay"]
    assert rig.value("llm_appliance_contended") == 0


def test_a_breach_found_before_the_box_got_busy_waits_while_it_is(rig: Rig) -> None:
    learn_baseline(rig)
    assert slow_checks(rig, 6) == ["none"] * 6  # one window short of the restart
    rig.cpu.contention = HOG
    assert slow_checks(rig, 5) == ["none"] * 5


def test_a_neighbour_that_does_not_keep_the_server_waiting_does_not_excuse_it(rig: Rig) -> None:
    learn_baseline(rig)
    rig.cpu.contention = FILLER
    assert slow_checks(rig, 7)[-1] == "restart"
    assert rig.value("llm_appliance_decode_contended_samples_total") == 0


def test_the_threshold_is_the_specs(tmp_path: Path) -> None:
    rig = Rig(tmp_path, make_spec(tmp_path, {"contention_max_share": 1.0}))  # 1: never contended
    learn_baseline(rig)
    rig.cpu.contention = Contention(1.0, "stress[1] 100%", 1.0, waited=1.0)
    assert slow_checks(rig, 7)[-1] == "restart"


def test_the_server_gpu_shared_with_another_process_is_contention(rig: Rig) -> None:
    learn_baseline(rig)
    rig.nvml.utilization = {os.getpid(): 0.3, 2**22 + 17: 0.6}  # another process has 60% of the SMs
    assert set(slow_checks(rig, 10)) == {"none"}
    assert rig.value("llm_appliance_contention_share", resource="gpu") == pytest.approx(0.6)
    assert rig.value("llm_appliance_decode_contended_samples_total") == 10


def test_a_hung_health_check_on_a_contended_box_does_not_count(rig: Rig) -> None:
    learn_baseline(rig)
    rig.cpu.contention = HOG
    rig.api.health_error = ServerUnreachable("GET /health: timed out")
    assert {rig.check(None).action for _ in range(6)} == {"none"}
    rig.cpu.contention = None
    assert [rig.check(None).action for _ in range(3)][-1] == "restart"
    assert rig.control.restarts == ["hang"]


def test_a_slow_canary_is_a_sample_and_a_failed_one_is_not(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(tmp_path, make_spec(tmp_path, {"canary_after_idle_seconds": 60}))
    rig.check(None)
    for _ in range(1 + rig.spec.health.baseline_windows):  # a canary a check: each is idle for 60 s
        rig.clock.advance(60)
        rig.check(None)
    assert rig.daemon.watch.decay.baselines.get(CANARY_BUCKET) == rig.api.canary_tps
    rig.api.canary_tps /= 3
    rig.clock.advance(60)
    with caplog.at_level(logging.INFO, "llm-appliance.health"):
        rig.check(None)
    assert rig.value("llm_appliance_canary_runs_total", outcome="slow") == 1
    assert "canary slow" in caplog.text

    def no_answer(prompt: str, n_predict: int, timeout: float = 600.0, **params: object) -> dict[str, object]:
        raise ServerUnreachable("POST /completion: timed out")

    rig.api.completion = no_answer  # type: ignore[method-assign]
    rig.clock.advance(60)
    with caplog.at_level(logging.INFO, "llm-appliance.health"):
        rig.check(None)
    assert rig.value("llm_appliance_canary_runs_total", outcome="failed") == 1
    assert "canary completion failed (no rate measured, not a slow sample)" in caplog.text
    assert rig.value("llm_appliance_canary_runs_total", outcome="ok") == 1 + rig.spec.health.baseline_windows


# -- the real demo beside busy loops --


@contextmanager
def busy_loops() -> Iterator[list[subprocess.Popen[bytes]]]:
    """A busy loop on every core, in processes of their own (not the appliance's)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


@pytest.mark.engine
def test_busy_loops_on_every_core_do_not_restart_the_real_demo(
    example: Callable[..., Path], appliance_up: UpProcess, tmp_path: Path, outside_tmp: Path
) -> None:
    """The baseline file says the demo decodes far faster than it can: every sample is a decay, and restarts
    it within median_of + consecutive windows, unless the samples are contended. Busy loops on every core from
    before the start make each of them so."""
    server_port, exporter_port = free_port(), free_port()
    baseline = outside_tmp / f"{tmp_path.name}-baseline.json"  # not in /tmp: the units' PrivateTmp= hides it
    unreachable = {f"ctx<={k}K": 1e6 for k in (1, 2, 4)} | {"ctx=unknown": 1e6, CANARY_BUCKET: 1e6}
    baseline.write_text(json.dumps({"decode_tps": unreachable, "versions": {}, "measured_at": "test"}))
    spec_path = fast_demo(example, server_port, exporter_port, f'baseline_file = "{baseline}"\n')
    # At priority "normal": at "high" the server keeps its CPUs beside the loops (plan/priority.py), and there is
    # no contended sample to see.
    spec_path.write_text(spec_path.read_text().replace("[server]\n", '[server]\npriority = "normal"\n', 1))
    api = ServerApi(f"http://127.0.0.1:{server_port}", timeout=30)
    with busy_loops():
        process, output = appliance_up(spec_path)
        wait_ready(process, output, 1)

        def value(name: str) -> float:
            return metric(scrape(exporter_port), name) or 0.0

        def state() -> str:
            counted = value("llm_appliance_decode_contended_samples_total")
            return f"contended samples {counted}\n" + "".join(output[-30:])

        traffic = Traffic(api)
        try:
            # Twice the decay window (median_of 5 windows, then `consecutive` breaches), in contended samples.
            wait_until(
                lambda: value("llm_appliance_decode_contended_samples_total") >= 2 * (5 + 2),
                Windows(traffic, 1, 2 * (5 + 2)),
                lambda: "contended samples under busy loops: " + state(),
            )
            assert value("llm_appliance_contended") == 1
            assert value('llm_appliance_contention_share{resource="cpu"}') > 0.2
        finally:
            traffic.close()
    assert value('llm_appliance_restarts_total{reason="decay"}') == 0
    assert not [line for line in output if "restarting llama-server" in line], state()
    shared = [line for line in output if "the box is shared" in line]
    assert len(shared) >= 1 and "(most: " in shared[0], state()
