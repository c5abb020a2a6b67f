"""The pure detectors of health/detectors.py over generated sample streams and a fake clock.

Noise comes from random.Random(seed), so every stream, and every verdict, is the same on every run.
"""

from __future__ import annotations

import itertools
import random

import pytest

from appliance.health.detectors import (
    CounterSample,
    CreepDetector,
    DecayDetector,
    RestartPolicy,
    Window,
    context_bucket,
    speculation,
    window,
)

RATE = 150.0  # tok/s
NOISE = 0.08  # one standard deviation, relative
INTERVAL = 30.0  # seconds per window
DAY = int(86400 / INTERVAL)  # 2880 windows
SHORT, LONG = "ctx<=1K", "ctx<=32K"


def detector(**overrides: object) -> DecayDetector:
    settings: dict[str, object] = {"ratio": 0.8, "consecutive": 3, "baseline_windows": 5, "median_of": 5}
    settings.update(overrides)
    return DecayDetector(**settings)  # type: ignore[arg-type]


def noisy(rng: random.Random, rate: float = RATE) -> float:
    return rate * (1 + rng.gauss(0, NOISE))


def first_breach(d: DecayDetector, bucket: str, rates: list[float]) -> int | None:
    """The 1-based index of the window that made `add` say True, or None."""
    for i, rate in enumerate(rates, 1):
        if d.add(bucket, rate):
            return i
    return None


# -- DecayDetector --


@pytest.mark.parametrize("seed", range(5))
def test_a_day_of_steady_noisy_traffic_never_breaches(seed: int) -> None:
    rng = random.Random(seed)
    d = detector()
    assert first_breach(d, SHORT, [noisy(rng) for _ in range(DAY)]) is None
    assert d.baselines[SHORT] == pytest.approx(RATE, rel=0.1)
    assert d.breaches[SHORT] < 3


@pytest.mark.parametrize("seed", range(5))
def test_a_drop_to_75_percent_breaches_within_five_windows(seed: int) -> None:
    """median_of 5 turns low by the 3rd low window (3 of 5 low), then 3 consecutive breaches: window 5 at
    the latest (sooner only if noisy normal windows still in the median were low too).

    The drop windows carry noise too, but stay under ratio x baseline, which is the bound's premise.
    """
    rng = random.Random(seed)
    d = detector()
    assert first_breach(d, SHORT, [noisy(rng) for _ in range(200)]) is None
    baseline = d.baselines[SHORT]
    dropped = [0.75 * baseline * (1 + rng.uniform(-0.05, 0.05)) for _ in range(10)]
    assert max(dropped) < 0.8 * baseline
    found = first_breach(d, SHORT, dropped)
    assert found is not None and found <= 5


def test_the_bound_is_exact_without_noise() -> None:
    d = detector()
    verdicts = [d.add(SHORT, RATE) for _ in range(20)] + [d.add(SHORT, 0.75 * RATE) for _ in range(6)]
    assert verdicts[:20] == [False] * 20
    assert verdicts[20:] == [False, False, False, False, True, True]
    assert d.current(SHORT) == 0.75 * RATE


@pytest.mark.parametrize("seed", range(10))
def test_a_noisy_drop_against_a_measured_baseline_is_caught_within_eight_windows(seed: int) -> None:
    # Noise on the dropped rate too: a low window may land above 0.8 x baseline and reset the count.
    rng = random.Random(seed)
    d = detector(baselines={SHORT: RATE})
    assert first_breach(d, SHORT, [noisy(rng) for _ in range(200)]) is None
    found = first_breach(d, SHORT, [noisy(rng, 0.75 * RATE) for _ in range(30)])
    assert found is not None and 5 <= found <= 8


@pytest.mark.parametrize("seed", range(10))
def test_a_noisy_drop_against_a_learned_baseline_is_caught(seed: int) -> None:
    # A baseline learned from only baseline_windows (5) noisy windows may itself be some 10% low, which
    # leaves a 25% drop barely under 0.8 x baseline: caught, but later (seed 5: 34 windows).
    rng = random.Random(seed)
    d = detector()
    assert first_breach(d, SHORT, [noisy(rng) for _ in range(200)]) is None
    found = first_breach(d, SHORT, [noisy(rng, 0.75 * RATE) for _ in range(60)])
    assert found is not None and found >= 3


@pytest.mark.parametrize("seed", range(3))
def test_one_slow_request_never_breaches(seed: int) -> None:
    rng = random.Random(seed)
    d = detector()
    rates = [0.3 * RATE if i % 10 == 9 else noisy(rng) for i in range(DAY)]
    assert first_breach(d, SHORT, rates) is None
    assert max(d.breaches.values()) < 3


def test_one_slow_request_right_after_the_baseline_never_breaches() -> None:
    d = detector()
    rates = [RATE] * 5 + [0.3 * RATE] + [RATE] * 20
    assert first_breach(d, SHORT, rates) is None
    assert d.breaches[SHORT] == 0


def test_two_slow_windows_in_a_row_cannot_move_a_median_of_five() -> None:
    d = detector()
    assert first_breach(d, SHORT, [RATE] * 10 + [0.3 * RATE] * 2 + [RATE] * 10) is None


@pytest.mark.parametrize("seed", range(3))
def test_buckets_learn_their_own_baselines(seed: int) -> None:
    rng = random.Random(seed)
    d = detector()
    for i in range(DAY):
        bucket, rate = (LONG, RATE / 2) if i % 3 == 0 else (SHORT, RATE)
        assert not d.add(bucket, noisy(rng, rate)), f"window {i} ({bucket}) breached"
    assert d.baselines[SHORT] == pytest.approx(RATE, rel=0.1)
    assert d.baselines[LONG] == pytest.approx(RATE / 2, rel=0.1)


def test_a_long_context_bucket_never_sees_the_short_baseline() -> None:
    d = detector()
    for _ in range(5):
        d.add(SHORT, RATE)
    # LONG is still learning: half the short rate is no breach, however long it lasts.
    assert first_breach(d, LONG, [RATE / 2] * 50) is None
    assert d.baselines[LONG] == RATE / 2
    assert d.breaches.get(SHORT, 0) == 0


def test_after_restart_clears_recent_windows_but_keeps_baselines() -> None:
    d = detector()
    for _ in range(5):
        d.add(SHORT, RATE)
    assert first_breach(d, SHORT, [RATE] * 5 + [0.5 * RATE] * 4) is None  # 2 breaches so far
    assert d.breaches[SHORT] == 2
    d.after_restart()
    assert d.baselines == {SHORT: RATE}
    assert d.breaches == {}
    assert d.current(SHORT) is None
    # Fresh windows: the old low ones do not count, so a healthy server is not blamed for them.
    assert first_breach(d, SHORT, [RATE] * 10) is None
    assert d.current(SHORT) == RATE
    assert d.breaches[SHORT] == 0


def test_after_restart_a_still_slow_server_breaches_once_the_median_is_full() -> None:
    d = detector(baselines={SHORT: RATE})
    assert first_breach(d, SHORT, [RATE] * 5 + [0.5 * RATE] * 2) is None
    d.after_restart()
    # median_of fresh windows first, then `consecutive` breaches: 5 + 3 - 1.
    assert first_breach(d, SHORT, [0.5 * RATE] * 10) == 7


@pytest.mark.parametrize("slow", [[0.3], [0.3, 0.3], [0.3, 1.0, 0.3]])
def test_slow_windows_right_after_a_restart_are_not_a_median(slow: list[float]) -> None:
    # The first requests after a restart (or after the baseline is learned) fill the median first:
    # one or two slow windows there are still one or two slow requests, not a decay.
    d = detector(baselines={SHORT: RATE})
    for _ in range(10):
        d.add(SHORT, RATE)
    d.after_restart()
    assert first_breach(d, SHORT, [f * RATE for f in slow] + [RATE] * 10) is None
    fresh = detector()
    assert first_breach(fresh, SHORT, [RATE] * 5 + [f * RATE for f in slow] + [RATE] * 10) is None


def test_a_preset_baseline_is_used_at_once() -> None:
    d = detector(baselines={SHORT: RATE})
    assert first_breach(d, SHORT, [0.5 * RATE] * 10) == 7  # no learning windows: judged from the first
    assert SHORT not in d._learning
    assert d.baselines == {SHORT: RATE}
    assert first_breach(detector(baselines={SHORT: RATE}), SHORT, [RATE] * 20) is None


def test_a_preset_baseline_does_not_cover_other_buckets() -> None:
    d = detector(baselines={SHORT: RATE})
    assert first_breach(d, LONG, [0.1 * RATE] * 5) is None
    assert d.baselines[LONG] == 0.1 * RATE


def test_current_is_none_while_learning() -> None:
    d = detector()
    d.add(SHORT, RATE)
    assert d.current(SHORT) is None


# -- window() --


def sample(tokens: float, seconds: float, drafted: float = 0, accepted: float = 0) -> CounterSample:
    return CounterSample(tokens, seconds, drafted, accepted)


def test_the_first_sample_has_no_window() -> None:
    assert window(None, sample(100, 1)) is None


def test_counters_going_backwards_mean_a_restart() -> None:
    assert window(sample(1000, 10), sample(50, 0.5)) is None


def test_a_window_is_the_difference() -> None:
    w = window(sample(1000, 10, 600, 400), sample(2500, 20, 1600, 1110))
    assert w == Window(1500, 10, 1000, 710)
    assert w.decode_tps == 150
    assert w.acceptance == pytest.approx(0.71)


def test_no_tokens_no_rate() -> None:
    w = window(sample(1000, 10), sample(1000, 10))
    assert w is not None
    assert w.decode_tps is None
    assert w.acceptance is None


def test_tokens_without_time_have_no_rate() -> None:
    assert Window(10, 0, 0, 0).decode_tps is None


def test_acceptance_needs_drafts() -> None:
    assert Window(100, 1, 0, 0).acceptance is None
    assert Window(100, 1, 50, 25).acceptance == 0.5


# -- context_bucket --


@pytest.mark.parametrize(
    ("tokens", "bucket"),
    [
        (None, "ctx=unknown"),
        (0, "ctx<=1K"),
        (1, "ctx<=1K"),
        (1024, "ctx<=1K"),
        (1025, "ctx<=2K"),
        (2048, "ctx<=2K"),
        (2049, "ctx<=4K"),
        (131072, "ctx<=128K"),
        (131073, "ctx<=256K"),
    ],
)
def test_context_buckets(tokens: int | None, bucket: str) -> None:
    assert context_bucket(tokens) == bucket


# -- CreepDetector --

GIB = float(1 << 30)


def test_no_creep_verdict_before_warm_up() -> None:
    c = CreepDetector(ratio=0.15, consecutive=3)
    for used in (10 * GIB, 20 * GIB, 40 * GIB):
        assert not c.add(used, warmed_up=False)
    assert c.baseline is None
    assert c.creep(40 * GIB) == 0.0


def test_the_baseline_is_the_first_warmed_up_sample() -> None:
    c = CreepDetector(ratio=0.15, consecutive=3)
    assert not c.add(9 * GIB, warmed_up=False)
    assert not c.add(0, warmed_up=True)  # nothing held yet is no baseline
    assert not c.add(10 * GIB, warmed_up=True)
    assert c.baseline == 10 * GIB
    assert not c.add(11 * GIB, warmed_up=True)
    assert c.baseline == 10 * GIB
    assert c.creep(11 * GIB) == pytest.approx(0.1)


def test_growing_creep_breaches_after_consecutive_checks_over_the_ratio() -> None:
    c = CreepDetector(ratio=0.15, consecutive=3)
    c.add(10 * GIB, warmed_up=True)
    # 0% to 30% in steps of 1% a check: over 15% from step 16 on, the third such check breaches.
    verdicts = {step: c.add(10 * GIB * (1 + step / 100), warmed_up=True) for step in range(31)}
    assert next(s for s, v in verdicts.items() if v) == 18
    assert not any(v for s, v in verdicts.items() if s < 18)
    assert all(v for s, v in verdicts.items() if s >= 18)


def test_creep_breaches_must_be_consecutive() -> None:
    c = CreepDetector(ratio=0.15, consecutive=3)
    c.add(10 * GIB, warmed_up=True)
    for used in (12, 12, 10, 12, 12, 10, 12, 12):
        assert not c.add(used * GIB, warmed_up=True)
    assert c.add(12 * GIB, warmed_up=True)


def test_after_restart_resets_the_creep_baseline() -> None:
    c = CreepDetector(ratio=0.15, consecutive=3)
    c.add(10 * GIB, warmed_up=True)
    c.add(12 * GIB, warmed_up=True)
    c.after_restart()
    assert c.baseline is None and c.breaches == 0
    assert not c.add(12 * GIB, warmed_up=True)
    assert c.baseline == 12 * GIB
    assert c.creep(12 * GIB) == 0


# -- speculation() --


def test_no_speculation_configured_no_verdict() -> None:
    verdict = speculation(False, False, Window(100, 1, 0, 0), 0.4)
    assert (verdict.engaged, verdict.acceptance, verdict.low) == (None, None, False)


def test_nothing_generated_no_verdict() -> None:
    verdict = speculation(True, True, Window(0, 0, 0, 0), 0.4)
    assert verdict.engaged is None


def test_tokens_without_drafts_is_not_engaged() -> None:
    verdict = speculation(True, True, Window(100, 1, 0, 0), 0.4)
    assert (verdict.engaged, verdict.acceptance, verdict.low) == (False, None, False)


def test_ngram_speculation_without_drafts_yet_is_no_verdict() -> None:
    # The installed ngram-mod demo: text that repeats nothing drafts nothing, and that is not "not engaged".
    assert speculation(True, False, Window(100, 1, 0, 0), 0.4).engaged is None
    assert speculation(True, False, Window(100, 1, 128, 49), 0.4).engaged is True


def test_low_acceptance_is_flagged() -> None:
    assert speculation(True, True, Window(100, 1, 100, 30), 0.4) == speculation(True, True, Window(100, 1, 10, 3), 0.4)
    verdict = speculation(True, True, Window(100, 1, 100, 30), 0.4)
    assert (verdict.engaged, verdict.acceptance, verdict.low) == (True, 0.3, True)
    assert not speculation(True, True, Window(100, 1, 100, 71), 0.4).low
    assert not speculation(True, True, Window(100, 1, 100, 40), 0.4).low  # at the minimum is fine


# -- RestartPolicy --


def policy(**overrides: float) -> RestartPolicy:
    settings = {"cooldown_seconds": 600, "max_per_hour": 3}
    settings.update(overrides)
    return RestartPolicy(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(("cooldown", "max_per_hour"), [(600, 3), (0, 3), (60, 5), (1200, 2), (0, 1)])
def test_a_restart_storm_is_capped(cooldown: int, max_per_hour: int) -> None:
    p = policy(cooldown_seconds=cooldown, max_per_hour=max_per_hour)
    restarts, actions = [], []
    now = 1_700_000_000.0
    for _ in range(int(3 * 3600 / INTERVAL)):
        decision = p.decide(now, "decay")
        actions.append(decision.action)
        if decision.action == "restart":
            restarts.append(now)
            p.restarted(now)
        if decision.action == "exhausted":
            assert p.exhausted
            assert f"max_per_hour {max_per_hour}" in decision.detail
        now += INTERVAL
    # Never more than max_per_hour in any sliding hour, never closer than the cooldown.
    for i, start in enumerate(restarts):
        assert len([t for t in restarts[i:] if t - start < 3600]) <= max_per_hour
    assert all(b - a >= cooldown for a, b in itertools.pairwise(restarts))
    assert "exhausted" in actions
    # It does restart, about max_per_hour an hour over three hours.
    assert max_per_hour * 3 - 1 <= len(restarts) <= max_per_hour * 3
    assert set(actions) <= {"restart", "cooldown", "exhausted"}


def test_the_storm_timeline_with_the_defaults() -> None:
    p = policy()
    restarts = []
    for check in range(int(3 * 3600 / INTERVAL)):
        now = check * INTERVAL
        if p.decide(now, "creep").action == "restart":
            restarts.append(now)
            p.restarted(now)
    assert restarts == [0, 600, 1200, 3600, 4200, 4800, 7200, 7800, 8400]


def test_exhausted_clears_once_the_hour_passes() -> None:
    p = policy(cooldown_seconds=0, max_per_hour=1)
    assert p.decide(0, "hang").action == "restart"
    p.restarted(0)
    assert p.decide(30, "hang").action == "exhausted"
    assert p.exhausted
    assert p.decide(3599, "hang").action == "exhausted"
    assert p.decide(3600, "hang").action == "restart"
    assert not p.exhausted


def test_zero_restarts_an_hour_means_never() -> None:
    p = policy(max_per_hour=0)
    assert p.decide(0, "decay").action == "exhausted"
    assert p.exhausted


def test_a_wanted_restart_outside_the_cooldown_and_budget_is_done_at_once() -> None:
    decision = policy().decide(0, "creep")
    assert (decision.action, decision.reason, decision.detail) == ("restart", "creep", "idle")


def test_restarted_starts_the_cooldown() -> None:
    p = policy()
    assert p.decide(0, "decay").action == "restart"
    p.restarted(0)
    decision = p.decide(30, "decay")
    assert decision.action == "cooldown"
    assert "570 s of cooldown left" in decision.detail
    assert p.decide(600, "decay").action == "restart"


def test_restarted_forgets_restarts_older_than_an_hour() -> None:
    p = policy()
    for t in (0, 1000, 2000, 5000):
        p.restarted(t)
    assert p.history == [2000, 5000]


def test_a_baseline_learned_on_a_busy_box_rises_to_the_sustained_rate_and_then_sees_decay() -> None:
    detector = DecayDetector(ratio=0.8, consecutive=3, baseline_windows=5)
    for _ in range(5):
        detector.add("ctx<=1K", 10.0)  # learned while something else had the CPU
    assert detector.baselines["ctx<=1K"] == 10.0
    rng = random.Random(7)
    for _ in range(20):
        assert not detector.add("ctx<=1K", 150.0 * rng.uniform(0.95, 1.05))
    assert 140.0 < detector.baselines["ctx<=1K"] < 160.0
    verdicts = [detector.add("ctx<=1K", 75.0) for _ in range(8)]
    assert any(verdicts), "a drop to half the sustained rate must breach"


# -- speculation's measured gain --


def test_speedup_is_the_current_rate_over_the_rate_without_speculation() -> None:
    from appliance.health.detectors import speedup

    assert speedup(40.0, 100.0) == pytest.approx(0.4)
    assert speedup(None, 100.0) is None  # nothing decoded in the bucket yet
    assert speedup(40.0, None) is None  # the baseline never measured the bucket without speculation
    assert speedup(40.0, 0.0) is None


def test_paying_tracker_says_each_turn_once() -> None:
    from appliance.health.detectors import PayingTracker

    tracker = PayingTracker(min_speedup=1.0)
    assert [tracker.update("ctx<=1K", g) for g in (1.3, 0.9, 0.8, 0.99, 1.0, 1.2, 0.5)] == [
        None,
        "slower",
        None,
        None,
        "recovered",
        None,
        "slower",
    ]
    assert tracker.update("canary", 0.5) == "slower"  # buckets are judged apart
