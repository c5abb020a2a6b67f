"""tune: the one-parameter-at-a-time search, checked on made-up landscapes and replayed on a recorded exhaustive
sweep of the real server, and `tune --write` for real on a copy of the demo spec."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

import appliance.cli.main as cli
from appliance.cli.commands import EXIT_USAGE
from appliance.health import versions
from appliance.health.detectors import CANARY_BUCKET
from appliance.measure.config import BenchError, Config, configured, spec_values, valid
from appliance.measure.report import format_report, updated_spec
from appliance.measure.search import (
    N_MAX_GRID,
    Memo,
    Param,
    Value,
    default_params,
    descend,
    exhaustive,
    grid_configs,
    harmonic_mix,
    single,
    tune,
)
from appliance.measure.tune import ServerMeasure, parse_grid, parse_workloads
from appliance.plan.validate import validate
from appliance.spec.load import parse_spec

START = Config(True, 6, 0, 0.0)
DEMO = Path(__file__).resolve().parent.parent / "etc" / "llm-appliance" / "demo.toml"


class Landscape:
    """A made-up measurement: decode tok/s of each workload for a configuration; records every call."""

    def __init__(self, rate: Callable[[Config], Mapping[str, float]]) -> None:
        self.rate = rate
        self.calls: list[Config] = []

    def __call__(self, config: Config) -> Mapping[str, float]:
        assert config not in self.calls, f"{config} measured twice"
        assert config.n_min <= config.n_max, f"{config} is not a valid configuration"
        self.calls.append(config)
        return self.rate(config)


def peaked(config: Config) -> dict[str, float]:
    """Code likes long drafts (peak at n_max 10), chat short ones (peak at 4); p_min only costs; n_min 1 helps a bit."""
    base = {"code": 100 - 2 * abs(config.n_max - 10), "chat": 100 - 4 * abs(config.n_max - 4)}
    factor = (1 - 0.3 * config.p_min) * (1.01 if config.n_min == 1 else 1.0)
    return {name: rate * factor for name, rate in base.items()}


def test_each_workload_gets_its_own_best_and_the_mix_a_shared_one() -> None:
    landscape = Landscape(peaked)
    params = default_params()
    result = tune(START, {"code": 1.0, "chat": 1.0}, params, landscape, tolerance=0.0)
    assert (result.profiles["code"].n_max, result.profiles["code"].n_min, result.profiles["code"].p_min) == (10, 1, 0.0)
    assert (result.profiles["chat"].n_max, result.profiles["chat"].p_min) == (4, 0.0)
    exhaustive_table = {c: peaked(c) for c in grid_configs(START, params)}
    mix = harmonic_mix({"code": 1.0, "chat": 1.0})
    best = max(mix(r) for r in exhaustive_table.values())
    assert result.mix(result.choice) >= 0.97 * best
    assert result.measurements == len(landscape.calls) < len(exhaustive_table) / 4
    document = json.loads(json.dumps(result.to_json()))
    assert document["measurements"] == result.measurements and document["exhaustive_size"] == len(exhaustive_table)
    assert document["profiles"]["code"]["n_max"] == 10 and document["choice"]["gain"] > 0
    report = format_report(result, DEMO, "suite-v1", 3, None)
    assert "loss by sharing" in report and f"an exhaustive sweep of these grids: {len(exhaustive_table)}" in report
    # Each workload loses something by sharing one value; the report says how much.
    assert result.rate(result.choice, "code") < result.rate(result.profiles["code"], "code")
    assert result.rate(result.choice, "chat") <= result.rate(result.profiles["chat"], "chat")


def test_a_direction_stops_at_the_first_slower_value() -> None:
    landscape = Landscape(lambda c: {"code": 100 - abs(c.n_max - 6) - 10 * c.p_min - abs(c.n_min - 0)})
    search = descend(single("code"), START, default_params(), Memo(landscape), tolerance=0.0)
    assert search.best == START
    # Start, then one step each way for n_max (5 and 8), one up for n_min (1), one up for p_min (0.2).
    assert [(c.n_max, c.n_min, c.p_min) for c in landscape.calls] == [
        (6, 0, 0.0),
        (8, 0, 0.0),
        (5, 0, 0.0),
        (6, 1, 0.0),
        (6, 0, 0.2),
    ]
    assert [s.verdict for s in search.steps] == ["start", "slower", "slower", "slower", "slower"]


def test_upwards_gains_skip_the_other_direction_and_walk_on_to_the_top() -> None:
    landscape = Landscape(lambda c: {"code": 50 + c.n_max - 40 * c.p_min - c.n_min})
    search = descend(single("code"), Config(True, 2, 0, 0.0), [default_params()[0]], Memo(landscape), 0.0)
    assert search.best.n_max == 16
    assert [c.n_max for c in landscape.calls] == [2, 3, 4, 5, 6, 8, 10, 12, 16]  # never below the start


def test_within_tolerance_is_not_slower_so_a_plateau_is_crossed() -> None:
    # Flat from 6 to 10 (noise-sized dips), then a real peak at 12.
    rates = {1: 60, 2: 70, 3: 75, 4: 80, 5: 85, 6: 90, 8: 89.5, 10: 89.8, 12: 95, 16: 80}
    landscape = Landscape(lambda c: {"code": rates[c.n_max]})
    search = descend(single("code"), START, [default_params()[0]], Memo(landscape), tolerance=0.02)
    assert search.best.n_max == 12
    strict = Landscape(lambda c: {"code": rates[c.n_max]})
    assert descend(single("code"), START, [default_params()[0]], Memo(strict), tolerance=0.0).best.n_max == 6


def test_n_min_never_exceeds_n_max() -> None:
    landscape = Landscape(lambda c: {"code": 100 + c.n_min - c.n_max})
    search = descend(single("code"), Config(True, 2, 2, 0.0), default_params(), Memo(landscape), 0.0)
    assert all(c.n_min <= c.n_max for c in landscape.calls)
    assert search.best.n_min <= search.best.n_max
    assert all(c.n_min <= c.n_max for c in grid_configs(START, default_params()))


def test_a_configuration_maps_onto_the_spec_which_says_what_is_valid(tmp_path: Path) -> None:
    spec = parse_spec(DEMO.read_text(), tmp_path / "demo.toml").spec
    config = Config(True, 4, 2, 0.4, draft_gpu_layers="all", draft_cache_type="q8_0")
    tuned = configured(spec, config)
    assert (tuned.speculative.n_max, tuned.speculative.n_min, tuned.speculative.p_min) == (4, 2, 0.4)
    assert tuned.models.draft is not None and tuned.models.draft.gpu_layers == "all"
    assert (tuned.models.draft.cache_type_k, tuned.models.draft.cache_type_v) == ("q8_0", "q8_0")
    assert tuned.models.target == spec.models.target and tuned.server == spec.server
    assert Config.of(tuned, draft_gpu_layers=True, draft_cache_type=True) == config
    assert spec_values(Config(draft=False)) == {"speculative": {"type": "none"}}
    assert configured(spec, Config(draft=False)).speculative.type == "none"
    # The spec model's bounds and its n_min <= n_max check, not tune's own.
    assert valid(Config(True, 2, 2, 0.0)) and not valid(Config(True, 2, 3, 0.0))
    assert not valid(Config(True, 65, 0, 0.0)) and not valid(Config(True, 4, 0, 1.5))
    with pytest.raises(BenchError, match=r"speculative\.n_max: Input should be less than or equal to 64"):
        configured(spec, Config(True, 65, 0, 0.0))


def test_the_mix_is_tokens_over_time() -> None:
    mix = harmonic_mix({"code": 3.0, "chat": 1.0})
    # 3 tokens at 100 tok/s and 1 at 50 tok/s: 4 tokens in 0.05 s.
    assert mix({"code": 100.0, "chat": 50.0}) == pytest.approx(80.0)
    assert mix({"code": 100.0, "chat": 0.0}) == 0.0


def test_workload_and_grid_options() -> None:
    names = ["chat", "code", "long-qa"]
    assert parse_workloads("code=2,chat", {}, names) == {"code": 2.0, "chat": 1.0}
    assert parse_workloads(None, {"chat": 1.0}, names) == {"chat": 1.0}
    assert parse_workloads(None, {}, names) == {"chat": 1.0, "code": 1.0, "long-qa": 1.0}
    for bad in ("code=x", "code=0", "prose=1"):
        with pytest.raises(BenchError):
            parse_workloads(bad, {}, names)
    assert parse_grid(["n_max=2,4", "p_min=0,0.5"]) == {"n_max": [2, 4], "p_min": [0.0, 0.5]}
    for bad in ("k=1", "n_max=0", "p_min=2", "n_max=a"):
        with pytest.raises(BenchError):
            parse_grid([bad])


def test_write_keeps_the_spec_as_written_and_adds_the_tuning_section(tmp_path: Path) -> None:
    result = tune(START, {"code": 2.0, "chat": 1.0}, default_params(), Landscape(peaked), tolerance=0.0)
    original = DEMO.read_text()
    text = updated_spec(original, result, "suite-v1", "2026-01-01T00:00:00+00:00")
    kept = [line for line in original.splitlines() if line.strip().startswith("#") or "#" in line]
    assert kept and all(line in text.splitlines() for line in kept), "comments were lost"
    spec = parse_spec(text, tmp_path / "demo.toml").spec
    assert (spec.speculative.n_max, spec.speculative.n_min, spec.speculative.p_min) == (
        result.choice.n_max,
        result.choice.n_min,
        result.choice.p_min,
    )
    assert spec.speculative.type == "draft-simple"
    assert spec.tuning.workloads == {"code": 2.0, "chat": 1.0}
    assert spec.tuning.suite == "suite-v1"
    assert spec.tuning.profiles["code"].n_max == 10 and spec.tuning.profiles["chat"].n_max == 4
    assert spec.tuning.profiles["code"].decode_tps == pytest.approx(
        result.rate(result.profiles["code"], "code"), abs=0.01
    )
    # Tuning again replaces the section instead of adding a second one.
    again = updated_spec(text, result, "suite-v1", "2026-01-02T00:00:00+00:00")
    assert again.count("[tuning]") == 1 and again.count("[tuning.profiles.code]") == 1
    assert tomllib.loads(again)["tuning"]["measured_at"] == "2026-01-02T00:00:00+00:00"


# A recorded sweep of the real server ----------------------------------------------------------------
#
# What the search decides is checked on measurements made once and kept: every configuration of SWEEP_GRIDS
# on the demo pair, measured with the real llama-server by record_sweep(). Replayed, the same numbers give the
# same decision on any machine, however busy; live numbers belong to `llm-appliance bench` and `tune`.

SWEEP = Path(__file__).resolve().parent / "data" / "tune-sweep-demo.json"
SWEEP_GRIDS: dict[str, list[Value]] = {"n_max": list(N_MAX_GRID), "n_min": [0, 2], "p_min": [0.0, 0.4, 0.8]}
SWEEP_WORKLOADS = ["chat", "code", "prose-en"]


def recorded_sweep() -> tuple[Config, list[Param], dict[Config, dict[str, float]]]:
    document = json.loads(SWEEP.read_text())
    params = default_params(document["grids"])
    table = {Config(**entry["config"]): entry["decode_tps"] for entry in document["measured"]}
    return Config(**document["start"]), params, table


def test_the_search_lands_within_3_percent_of_a_recorded_exhaustive_sweep_with_fewer_measurements(
    capsys: pytest.CaptureFixture[str],
) -> None:
    start, params, table = recorded_sweep()
    assert sorted(table, key=repr) == sorted(grid_configs(start, params), key=repr)  # the whole grid, once each
    weights = dict.fromkeys(SWEEP_WORKLOADS, 1.0)
    replay = Landscape(lambda config: table[config])  # the recorded measurements, none made again
    result = tune(start, weights, params, replay)
    mix = harmonic_mix(weights)
    best = max(table, key=lambda c: mix(table[c]))
    with capsys.disabled():
        print(
            f"\nrecorded sweep ({len(table)} configurations): best {best.label()} at {mix(table[best]):.1f}; "
            f"tune: {result.measurements} measurements, choice {result.choice.label()} at {result.mix(result.choice):.1f}"
        )
    assert result.mix(result.choice) >= 0.97 * mix(table[best])
    assert result.measurements == len(replay.calls) < len(table) / 2


def record_sweep(path: Path = SWEEP, reps: int = 3, tokens: int = 32) -> None:
    """Measure every configuration of SWEEP_GRIDS on the demo pair with the real server and write `path`.

    Run it on a machine with the engine and the demo models installed (.ci/run does that), nothing else busy:
    `python tests/test_tune.py`. It starts one server per configuration and takes some minutes; the file is
    written after each one, so an interrupted run leaves what it measured (and the test refuses a partial grid)."""
    import os

    from appliance.facts.machine import find_binary
    from appliance.measure.measure import Progress
    from appliance.measure.suite import load_suite
    from appliance.ops.engine import version_line

    validated = validate(DEMO)
    binary = find_binary(validated.plan.spec)
    assert binary is not None, "no llama-server: install the engine first"
    params = default_params(SWEEP_GRIDS)
    start = Config.of(validated.plan.spec)
    document: dict[str, Any] = {
        "recorded_by": "tests/test_tune.py record_sweep()",
        "spec": "etc/llm-appliance/demo.toml",
        "engine": version_line(binary),
        "cpus": os.cpu_count(),
        "suite": load_suite(None).version,
        "reps": reps,
        "tokens": tokens,
        "grids": SWEEP_GRIDS,
        "start": start.to_json(),
        "measured": [],
    }
    server = ServerMeasure(validated, SWEEP_WORKLOADS, reps, tokens, progress=Progress())

    def measure(config: Config) -> Mapping[str, float]:
        rates = server(config)
        entry = {"config": config.to_json(), "decode_tps": {name: round(rate, 3) for name, rate in rates.items()}}
        document["measured"].append(entry)
        path.write_text(json.dumps(document, indent=1) + "\n")
        return rates

    table = exhaustive(start, params, measure)
    print(f"wrote {path}: {len(table)} configurations")


# Against the real llama-server -------------------------------------------------------------------


@pytest.mark.engine
def test_tune_writes_the_spec_and_the_baseline_for_real(
    example: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = example("demo.toml")
    original = spec.read_text()
    baseline = tmp_path / "baseline.json"
    argv = ["tune", str(spec), "--workload", "code=2,chat", "--grid", "n_max=4,8", "--grid", "n_min=0"]
    argv += ["--grid", "p_min=0", "--reps", "1", "--tokens", "12", "--write", "--baseline", str(baseline)]
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "+[tuning]" in out and "wrote" in out  # the diff is shown, then written
    assert "loss by sharing" in out and "no draft" in out
    text = spec.read_text()
    comments = [line for line in original.splitlines() if "#" in line]
    assert all(line in text.splitlines() for line in comments), "comments were lost"
    written = tomllib.loads(text)
    assert written["speculative"]["n_max"] in (4, 8) and written["speculative"]["type"] == "draft-simple"
    assert written["tuning"]["workloads"] == {"code": 2.0, "chat": 1.0}
    assert set(written["tuning"]["profiles"]) == {"code", "chat"}
    for profile in written["tuning"]["profiles"].values():
        assert profile["n_max"] in (4, 8) and profile["decode_tps"] > 0
    validate(spec)  # the written spec is valid

    document = json.loads(baseline.read_text())
    assert document["speculative"]["n_max"] == written["speculative"]["n_max"]
    assert set(document["profiles"]) == {"code", "chat"}
    read = versions.Baseline.read(baseline)
    assert read is not None
    assert set(read.decode_tps) == {"workload:code", "workload:chat", CANARY_BUCKET}
    assert all(rate > 0 for rate in read.decode_tps.values())


@pytest.mark.engine
def test_options_that_cannot_work_are_usage_errors(
    example: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    spec = str(example("demo.toml"))
    assert cli.main(["tune", spec, "--tolerance", "0.7", "--no-baseline"]) == EXIT_USAGE
    assert cli.main(["tune", spec, "--workload", "poetry", "--no-baseline"]) == EXIT_USAGE
    assert cli.main(["bench", spec, "--standalone", "--tokens", "0", "--no-baseline"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--tolerance" in err and "no workload poetry" in err and "--tokens" in err


if __name__ == "__main__":
    record_sweep()
