"""The compute buffer estimate against llama-server's own log; the largest context that fits; explain --json;
tune --ctx max."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
from compute_log import compute_log
from conftest import EXAMPLE_FACTS, gpu_facts

from appliance.facts.gguf import read_model
from appliance.measure.search import default_params, tune
from appliance.measure.tune import with_longest_context
from appliance.measure.tune_report import updated_spec
from appliance.plan.budget import KV_CELL_PAD, MIB
from appliance.plan.compute import peaks, shape, target_outputs_per_seq
from appliance.plan.explain import plan_json
from appliance.plan.fit import device_fits, largest_fits
from appliance.plan.validate import validate
from appliance.spec.model import Spec

# The stated margin: never below the log, and at most +25% or +10 MiB above it.
MARGIN_SHARE, MARGIN_MIB = 0.25, 10.0

# (ctx, batch, ubatch, parallel, flash attention, draft n_max or 0): both models at each.
CASES = [
    (4096, 2048, 512, 1, "on", 0),
    (32768, 2048, 512, 1, "off", 0),
    (8192, 2048, 512, 4, "off", 0),
    (8192, 2048, 2048, 1, "auto", 0),
    (8192, 512, 128, 1, "off", 0),
    (8192, 2048, 512, 4, "on", 16),
]


def estimate_mib(model: Path, ctx: int, batch: int, ubatch: int, parallel: int, fa: str, n_max: int) -> list[float]:
    """The estimate for the target's context, then the draft's (which asks one output per slot)."""
    server = {"ctx_size": ctx, "batch_size": batch, "ubatch_size": ubatch, "parallel": parallel, "flash_attn": fa}
    speculative = {"n_max": n_max} if n_max else {"type": "none"}
    spec = Spec.model_validate(
        {"models": {"target": {"path": str(model)}}, "server": server, "speculative": speculative}
    )
    info = read_model(model)
    contexts = [target_outputs_per_seq(spec, bool(n_max))] + ([1] if n_max else [])
    return [peaks(info, shape(spec, per_seq)).whole / MIB for per_seq in contexts]


@pytest.mark.engine
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_the_estimate_covers_the_logged_compute_buffer(
    engine_binary: Path, name: str, case: tuple[int, int, int, int, str, int], request: pytest.FixtureRequest
) -> None:
    model: Path = request.getfixturevalue(name)
    ctx, batch, ubatch, parallel, fa, n_max = case
    flags = ["-c", str(ctx), "-b", str(batch), "-ub", str(ubatch), "-np", str(parallel), "-fa", fa]
    if n_max:
        flags += ["-md", str(model), "--spec-type", "draft-simple", "--spec-draft-n-max", str(n_max)]
    logged = [context["CPU"] for context in compute_log(engine_binary, model, *flags).contexts]
    estimated = estimate_mib(model, *case)
    assert len(logged) == len(estimated), logged
    for log, guess in zip(logged, estimated, strict=True):
        assert log <= guess <= max(log * (1 + MARGIN_SHARE), log + MARGIN_MIB), (logged, estimated)


def test_a_layer_split_gives_each_gpu_a_compute_buffer_of_its_own(example: Callable[[str], Path]) -> None:
    spec = example("dual-gpu.toml")
    planned = validate(spec, facts=EXAMPLE_FACTS["dual-gpu.toml"]).plan
    computes = {
        b.device: [line.bytes for line in b.lines if line.label == "target compute buffer (estimated)"]
        for b in planned.budgets
    }
    split = [device for device, found in computes.items() if found]
    if len(split) > 1:  # a split: every device holds a whole body peak, not a share
        model_peaks = peaks(planned.target, shape(planned.spec, target_outputs_per_seq(planned.spec, True)))
        assert all(found[0] >= model_peaks.body for found in computes.values() if found)


@pytest.mark.parametrize("name", ["demo-draft.toml", "appliance.toml", "dual-gpu.toml"])
def test_the_largest_context_fits_and_one_step_more_does_not(example: Callable[[str], Path], name: str) -> None:
    facts = EXAMPLE_FACTS[name]
    planned = validate(example(name), facts=facts).plan
    fits = largest_fits(planned.spec, facts, planned.target, planned.draft)
    assert {f.device for f in fits} == {b.device for b in planned.budgets} | {"host RAM"}
    for fit in fits:
        assert fit.ctx_size % KV_CELL_PAD == 0 and fit.ctx_size <= fit.ctx_cap
        at = planned.spec.model_copy(
            update={"server": planned.spec.server.model_copy(update={"ctx_size": fit.ctx_size})}
        )
        assert device_fits(at, facts, planned.target, planned.draft)[fit.device]
        if fit.ctx_size < fit.ctx_cap:
            more = at.model_copy(
                update={"server": at.server.model_copy(update={"ctx_size": fit.ctx_size + KV_CELL_PAD})}
            )
            assert not device_fits(more, facts, planned.target, planned.draft)[fit.device]


def test_an_over_budget_error_names_the_largest_context_that_fits(example: Callable[[str], Path]) -> None:
    from appliance.spec.problems import SpecInvalid

    spec = example("appliance.toml")
    small = gpu_facts(20)
    with pytest.raises(SpecInvalid) as raised:
        validate(spec, facts=small)
    text = str(raised.value)
    assert "CUDA0 is over budget" in text
    planned_spec = Spec.model_validate(tomllib.loads(spec.read_text()))
    target = read_model(planned_spec.models.target.path)
    draft = read_model(planned_spec.models.draft.path) if planned_spec.models.draft else None
    fit = next(f for f in largest_fits(planned_spec, small, target, draft) if f.device == "CUDA0")
    assert fit.ctx_size >= KV_CELL_PAD and f"server.ctx_size = {fit.ctx_size} or less" in text


def test_explain_json_adds_up(example: Callable[[str], Path]) -> None:
    facts = EXAMPLE_FACTS["appliance.toml"]
    result = validate(example("appliance.toml"), facts=facts)
    planned = result.plan
    document = json.loads(
        json.dumps(
            plan_json(planned, largest_fits(planned.spec, facts, planned.target, planned.draft), result.warnings)
        )
    )
    assert document["argv"] == list(planned.argv)
    assert [d["device"] for d in document["devices"]] == ["CUDA0", "host RAM"]
    for device in document["devices"]:
        assert device["used_bytes"] == sum(item["bytes"] for item in device["items"])
        assert device["usable_bytes"] == int(device["total_bytes"] * device["utilization"])
        assert device["largest_ctx_size"] >= KV_CELL_PAD and device["largest_parallel"] >= 1
    labels = [item["label"] for item in document["devices"][0]["items"]]
    assert "target compute buffer (estimated)" in labels and "margin (memory.compute_headroom_mib)" in labels


def test_tune_ctx_max_replans_at_the_longest_context_and_writes_it(example: Callable[[str], Path]) -> None:
    facts = EXAMPLE_FACTS["appliance.toml"]
    validated = validate(example("appliance.toml"), facts=facts)
    longest = with_longest_context(validated)
    ctx = longest.plan.spec.server.ctx_size
    fits = largest_fits(validated.plan.spec, facts, validated.plan.target, validated.plan.draft)
    assert ctx == min(f.ctx_size for f in fits)
    assert ctx != validated.plan.spec.server.ctx_size  # the example is not already at its largest
    assert ("--ctx-size", str(ctx)) in zip(longest.plan.argv, longest.plan.argv[1:], strict=False) or str(
        ctx
    ) in longest.plan.argv
    from test_tune import START, Landscape, peaked

    result = tune(START, {"code": 1.0}, default_params(), Landscape(peaked), tolerance=0.0)
    text = updated_spec(example("demo-draft.toml").read_text(), result, "suite-v1", "2026-01-01T00:00:00+00:00", ctx)
    assert tomllib.loads(text)["server"]["ctx_size"] == ctx
