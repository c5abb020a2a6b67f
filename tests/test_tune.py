"""tune: the one-parameter-at-a-time search, checked on made-up landscapes and replayed on a recorded exhaustive
sweep of the real server, and `tune --write` for real on a copy of the demo spec."""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

import appliance.cli.main as cli
from appliance.cli.commands import EXIT_USAGE
from appliance.health import versions
from appliance.health.detectors import CANARY_BUCKET
from appliance.measure.config import NO_SPECULATION, BenchError, Config, configured, spec_values, valid
from appliance.measure.search import (
    N_MAX_GRID,
    Memo,
    Param,
    Params,
    Value,
    default_params,
    descend,
    exhaustive,
    grid_configs,
    harmonic_mix,
    ngram_params,
    single,
    tune,
)
from appliance.measure.tune import ServerMeasure, parse_grid, parse_workloads
from appliance.measure.tune_report import format_report, updated_spec
from appliance.plan.validate import validate
from appliance.spec.load import parse_spec

DRAFT = ("draft-simple",)
START = Config(DRAFT, 6, 0, 0.0)
DEMO = Path(__file__).resolve().parent.parent / "etc" / "llm-appliance" / "demo-draft.toml"


class Landscape:
    """A made-up measurement: decode tok/s of each workload for a configuration; records every call."""

    def __init__(self, rate: Callable[[Config], Mapping[str, float]]) -> None:
        self.rate = rate
        self.calls: list[Config] = []

    def __call__(self, config: Config) -> Mapping[str, float]:
        assert config not in self.calls, f"{config} measured twice"
        assert config.n_min <= config.n_max, f"{config} is not a valid configuration"
        self.calls.append(config)
        if not config.speculates:  # tune always measures no speculation; these landscapes are about drafts
            return dict.fromkeys(self.rate(START), 1.0)
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
    # The exhaustive sweep of the draft's grids, and no speculation measured beside them.
    assert document["measurements"] == result.measurements and document["exhaustive_size"] == len(exhaustive_table) + 1
    assert document["profiles"]["code"]["n_max"] == 10 and document["choice"]["gain"] > 0
    report = format_report(result, DEMO, "suite-v1", 3, None)
    assert "loss by sharing" in report and f"an exhaustive sweep of these grids: {len(exhaustive_table) + 1}" in report
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
    search = descend(single("code"), Config(DRAFT, 2, 0, 0.0), [default_params()[0]], Memo(landscape), 0.0)
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
    search = descend(single("code"), Config(DRAFT, 2, 2, 0.0), default_params(), Memo(landscape), 0.0)
    assert all(c.n_min <= c.n_max for c in landscape.calls)
    assert search.best.n_min <= search.best.n_max
    assert all(c.n_min <= c.n_max for c in grid_configs(START, default_params()))


NGRAM = ("ngram-mod",)
BOTH = ("draft-simple", "ngram-mod")


def by_type(config: Config) -> dict[str, float]:
    """A machine like the demo's: n-gram lookup pays on edit (best with short matches), nothing pays on chat,
    the draft costs everywhere; both together cost the draft's price."""
    if not config.speculates:
        return {"edit": 90.0, "chat": 115.0}
    if config.types == NGRAM:
        match = config.ngram_value("ngram-mod.n_match")
        return {"edit": 150.0 - abs(match - 12), "chat": 110.0}
    return {"edit": 50.0, "chat": 45.0}


class Measured:
    """A landscape that also answers for no speculation (Landscape's does not)."""

    def __init__(self, rate: Callable[[Config], Mapping[str, float]]) -> None:
        self.rate, self.calls = rate, list[Config]()

    def __call__(self, config: Config) -> Mapping[str, float]:
        assert config not in self.calls and valid(config), config
        self.calls.append(config)
        return self.rate(config)


def test_the_type_is_chosen_by_measurement_per_workload_and_for_the_mix() -> None:
    measured = Measured(by_type)
    params = Params(default_params(), ngram_params())
    result = tune(START, {"edit": 1.0, "chat": 1.0}, params, measured, 0.0, [(), DRAFT, NGRAM, BOTH])
    # Every type measured once at its current values, none included, before any parameter moved.
    assert measured.calls[:4] == [START, NO_SPECULATION, START.with_types(NGRAM), START.with_types(BOTH)]
    assert result.profiles["edit"].types == NGRAM and result.profiles["edit"].ngram_value("ngram-mod.n_match") == 12
    assert result.profiles["chat"] == NO_SPECULATION  # where nothing pays, its best is none
    assert result.speedup(result.profiles["edit"], "edit") == pytest.approx(150 / 90)
    assert result.choice.types == NGRAM  # the mix gains on edit more than it loses on chat
    # The draft's values were never walked: the draft was no workload's best type.
    assert all(not c.draft for c in measured.calls[4:]) and len(measured.calls) > 4
    report = format_report(result, DEMO, "suite-v2", 2, None)
    edit_row = next(line for line in report.splitlines() if line.startswith("edit "))
    assert "ngram-mod" in edit_row and "1.67x" in edit_row, edit_row
    chat_row = next(line for line in report.splitlines() if line.startswith("chat "))
    assert " none " in chat_row and "1.00x" in chat_row, chat_row
    document = json.loads(json.dumps(result.to_json()))
    assert document["profiles"]["edit"]["type"] == "ngram-mod" and document["profiles"]["chat"]["type"] == "none"
    assert document["profiles"]["edit"]["speedup"] == pytest.approx(150 / 90, abs=1e-4)


def test_none_is_the_answer_where_nothing_pays_and_write_says_so(tmp_path: Path) -> None:
    measured = Measured(lambda c: {"chat": 100.0 if not c.speculates else 80.0 + c.n_max})
    result = tune(START, {"chat": 1.0}, Params(default_params(), ngram_params()), measured, 0.0, [(), NGRAM])
    assert result.choice == NO_SPECULATION and result.profiles["chat"] == NO_SPECULATION
    report = format_report(result, DEMO, "suite-v2", 2, None)
    assert 'the choice is type = "none"' in report
    text = updated_spec(DEMO.read_text(), result, "suite-v2", "2026-12-04T00:00:00+00:00")
    spec = parse_spec(text, tmp_path / "demo.toml").spec
    assert spec.speculative.types == () and tomllib.loads(text)["speculative"]["type"] == "none"


def test_an_ngram_configuration_maps_onto_its_own_table(tmp_path: Path) -> None:
    spec = parse_spec(DEMO.read_text(), tmp_path / "demo.toml").spec
    config = Config.of(spec).with_types(NGRAM).with_ngram("ngram-mod.n_match", 12)
    assert spec_values(config)["speculative"] == {"type": "ngram-mod", "ngram_mod": {"n_match": 12}}
    tuned = configured(spec, config)
    assert tuned.speculative.types == NGRAM and tuned.speculative.ngram_mod is not None
    assert tuned.speculative.ngram_mod.n_match == 12 and Config.of(tuned).ngram_value("ngram-mod.n_min") == 48
    assert not valid(config.with_ngram("ngram-mod.n_min", 64).with_ngram("ngram-mod.n_max", 16))
    assert parse_grid(["ngram-mod.n_match=8,16"]) == {"ngram-mod.n_match": [8, 16]}
    with pytest.raises(BenchError):
        parse_grid(["ngram-mod.size_n=2"])


def test_a_configuration_maps_onto_the_spec_which_says_what_is_valid(tmp_path: Path) -> None:
    spec = parse_spec(DEMO.read_text(), tmp_path / "demo.toml").spec
    config = Config(DRAFT, 4, 2, 0.4, draft_gpu_layers="all", draft_cache_type="q8_0")
    tuned = configured(spec, config)
    assert (tuned.speculative.n_max, tuned.speculative.n_min, tuned.speculative.p_min) == (4, 2, 0.4)
    assert tuned.models.draft is not None and tuned.models.draft.gpu_layers == "all"
    assert (tuned.models.draft.cache_type_k, tuned.models.draft.cache_type_v) == ("q8_0", "q8_0")
    assert tuned.models.target == spec.models.target and tuned.server == spec.server
    assert Config.of(tuned, draft_gpu_layers=True, draft_cache_type=True) == config
    assert spec_values(NO_SPECULATION) == {"speculative": {"type": "none"}}
    assert configured(spec, NO_SPECULATION).speculative.types == ()
    # The spec model's bounds and its n_min <= n_max check, not tune's own.
    assert valid(Config(DRAFT, 2, 2, 0.0)) and not valid(Config(DRAFT, 2, 3, 0.0))
    assert not valid(Config(DRAFT, 65, 0, 0.0)) and not valid(Config(DRAFT, 4, 0, 1.5))
    with pytest.raises(BenchError, match=r"speculative\.n_max: Input should be less than or equal to 64"):
        configured(spec, Config(DRAFT, 65, 0, 0.0))


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
    table = {_sweep_config(entry["config"]): entry["decode_tps"] for entry in document["measured"]}
    return _sweep_config(document["start"]), params, table


def _sweep_config(recorded: dict[str, Any]) -> Config:
    """A configuration as the sweep recorded it (the draft's values, before tune chose types)."""
    return Config(DRAFT, recorded["n_max"], recorded["n_min"], recorded["p_min"])


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
    from appliance.measure.progress import Progress
    from appliance.measure.suite import load_suite
    from appliance.ops.engine_build import version_line

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
    server = ServerMeasure(
        validated, SWEEP_WORKLOADS, reps, tokens, progress=Progress(name="tune", scope="on this server")
    )

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
    spec = example("demo-draft.toml")
    original = spec.read_text()
    baseline = tmp_path / "baseline.json"
    argv = ["tune", str(spec), "--workload", "code=2,chat", "--types", "none,draft-simple,ngram-mod"]
    argv += ["--grid", "n_max=4,8", "--grid", "n_min=0", "--grid", "p_min=0", "--grid", "ngram-mod.n_match=24"]
    argv += ["--grid", "ngram-mod.n_min=48", "--grid", "ngram-mod.n_max=64"]
    argv += ["--reps", "1", "--tokens", "12", "--write", "--baseline", str(baseline)]
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "+[tuning]" in out and "wrote" in out  # the diff is shown, then written
    # Progress on a log: a line per measurement, counted server by server (how many the search starts is
    # known only at its end), each server's last line N/N.
    lines = re.findall(r"^tune: \[(\d)/(\d)\] (\w+), rep 1/1, server (\d+), .*\(([^()]*)\)$", err, re.M)
    servers: dict[str, list[tuple[str, ...]]] = {}
    for done, total, name, server, left in lines:
        servers.setdefault(server, []).append((done, total, name, left))
    assert list(servers) == [str(n) for n in range(1, len(servers) + 1)] and len(servers) >= 4, err
    for counted in servers.values():
        assert [int(done) for done, *_ in counted] == list(range(1, int(counted[0][1]) + 1)), counted
        assert all(re.fullmatch(r"about \d+ (s|min) left on this server", c[3]) for c in counted[:-1]), counted
        assert counted[-1][3].startswith("done in ") and counted[-1][3].endswith(" on this server")
    assert {name for c in servers.values() for _, _, name, _ in c} == {"code", "chat", "canary"}
    assert "loss by sharing" in out and "best type" in out
    text = spec.read_text()
    comments = [line for line in original.splitlines() if "#" in line]
    assert all(line in text.splitlines() for line in comments), "comments were lost"
    written = tomllib.loads(text)
    document = json.loads(baseline.read_text())
    # Whatever was measured fastest is written, none included, and the report names each workload's best type.
    chosen = written["speculative"]["type"]
    assert chosen in ("none", "draft-simple", "ngram-mod"), chosen
    assert document["speculative"]["type"] == chosen
    if chosen == "draft-simple":
        assert written["speculative"]["n_max"] in (4, 8)
    assert written["tuning"]["workloads"] == {"code": 2.0, "chat": 1.0}
    assert set(written["tuning"]["profiles"]) == {"code", "chat"}
    for name, profile in written["tuning"]["profiles"].items():
        assert profile["type"] in ("none", "draft-simple", "ngram-mod") and profile["decode_tps"] > 0
        row = next(line for line in out.splitlines() if line.startswith(f"{name} "))
        assert profile["type"] in row and re.search(r"\d\.\d\dx", row), row  # its best type and speedup
    validate(spec)  # the written spec is valid

    assert set(document["profiles"]) == {"code", "chat"}
    read = versions.Baseline.read(baseline)
    assert read is not None
    assert set(read.decode_tps) == {"workload:code", "workload:chat", CANARY_BUCKET}
    assert all(rate > 0 for rate in read.decode_tps.values())
    assert set(document["no_speculation_tps"]) == {"workload:code", "workload:chat", CANARY_BUCKET}


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
