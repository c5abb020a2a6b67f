"""What tune tells and writes: the report (every configuration measured, each workload's best type and its
speedup over no speculation, the shared choice), and `tune --write`'s rewrite of the spec (the choice in the
sections the configuration maps onto, a fresh [tuning]; every other line kept as written), through the
appliance's one writer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from appliance.measure.config import spec_values
from appliance.measure.search import TuneResult, harmonic_mix
from appliance.system.files import write_atomically


def _pct(value: float) -> str:
    return f"{100 * value:+.1f}%"


def format_report(result: TuneResult, spec_path: Path, suite: str, reps: int, tokens: int | None) -> str:
    """Every configuration measured, each workload's own best against the shared choice, and the choice."""
    weights = ", ".join(f"{n}={w:g}" for n, w in result.weights.items())
    grids = "; ".join(
        f"{p.name} {', '.join(f'{v:g}' if isinstance(v, float) else str(v) for v in p.grid)}" for p in result.params
    )
    lines = [
        f"{spec_path}: {suite}, median of {reps} rep{'s' if reps != 1 else ''}"
        + (f" x up to {tokens} tokens" if tokens else "")
        + f"; mix {weights} (weighted harmonic mean of decode tok/s)",
        f"grids: {grids}",
        f"{result.measurements} configurations measured (one server start each); an exhaustive sweep of these grids: {result.grid_size}",
        "",
        *_measured_lines(result),
        "",
        *_profile_lines(result),
        "",
        *_choice_lines(result),
    ]
    return "\n".join(lines)


def _measured_lines(result: TuneResult) -> list[str]:
    names, mix = list(result.weights), harmonic_mix(result.weights)
    width = max([48, *(len(c.label()) + 18 for c in result.table)])
    lines = [f"{'configuration':<{width}}" + "".join(f"{n:>11}" for n in names) + f"{'mix':>11}"]
    for config, rates in result.table.items():
        marks = " (spec)" if config == result.start else ""
        marks += " (choice)" if config == result.choice else ""
        lines.append(
            f"{config.label() + marks:<{width}}"
            + "".join(f"{rates.get(n, 0.0):>11.1f}" for n in names)
            + f"{mix(rates):>11.1f}"
        )
    return lines


def _speedup(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def _profile_lines(result: TuneResult) -> list[str]:
    """Per workload: its best type and values, their speedup over no speculation, and what sharing costs."""
    lines = [
        f"{'workload':<10} {'none':>7}  {'best type':<24} {'tok/s':>7} {'speedup':>8}  {'shared':>7} {'loss by sharing':>15}",
    ]
    none = result.no_speculation or {}
    values = []
    for name, config in result.profiles.items():
        own, shared = result.rate(config, name), result.rate(result.choice, name)
        lines.append(
            f"{name:<10} {none.get(name, 0.0):>7.1f}  {config.type_label():<24} {own:>7.1f} "
            f"{_speedup(result.speedup(config, name)):>8}  {shared:>7.1f} {_pct(shared / own - 1) if own else '-':>15}"
        )
        if config.speculates:
            values.append(f"  {name}: {config.label()}")
    return [*lines, *(["each workload's own best values:", *values] if values else [])]


def _choice_lines(result: TuneResult) -> list[str]:
    choice_mix, start_mix = result.mix(result.choice), result.mix(result.start)
    speedup = result.speedup(result.choice)
    lines = [
        "llama-server applies one set of speculative values to all requests (its per-request fields are compiled out),",
        f"so the mix gets: {result.choice.label()} -> {choice_mix:.1f} tok/s, "
        + (f"{_pct(choice_mix / start_mix - 1)} over the spec's current values" if start_mix else "")
        + (f"; {speedup:.2f}x no speculation" if speedup is not None else ""),
    ]
    if not result.choice.speculates:
        lines.append('no speculation type was faster than none for this mix: the choice is type = "none"')
    return lines


def profile_values(result: TuneResult, name: str) -> dict[str, Any]:
    """A workload's own best as a [tuning.profiles] entry: its values and its decode tok/s there."""
    config = result.profiles[name]
    values = config.to_json()
    if config.draft:
        values["p_min"] = float(config.p_min)
    values["decode_tps"] = round(result.rate(config, name), 2)
    return values


def updated_spec(text: str, result: TuneResult, suite: str, measured_at: str, ctx_size: int | None = None) -> str:
    """The spec with the choice in the sections it maps onto ([speculative], [models.draft]), server.ctx_size
    when tuned (`tune --ctx max`), and a fresh [tuning] section; every other line, comment and blank kept."""
    import tomlkit

    document = tomlkit.parse(text)
    if ctx_size is not None:
        _table(document, "server")["ctx_size"] = ctx_size
    for section, values in spec_values(result.choice).items():
        table = _table(document, section)
        for key, value in values.items():
            table[key] = value
    tuning = tomlkit.table()
    tuning.add(tomlkit.comment("written by `llm-appliance tune --write`: [speculative] is the best measured for this"))
    tuning.add(
        tomlkit.comment("mix (workload = weight); each profile is one workload's own best, with its decode tok/s")
    )
    workloads = tomlkit.inline_table()
    workloads.update({name: float(weight) for name, weight in result.weights.items()})
    tuning["workloads"] = workloads
    tuning["suite"] = suite
    tuning["measured_at"] = measured_at
    profiles = tomlkit.table(is_super_table=True)
    for name in result.profiles:
        profile = tomlkit.table()
        profile.update(profile_values(result, name))
        profiles[name] = profile
    tuning["profiles"] = profiles
    if "tuning" in document:
        document["tuning"] = tuning
    else:
        document.add(tomlkit.nl())
        document.add("tuning", tuning)
    return str(tomlkit.dumps(document))


def _table(document: Any, section: str) -> Any:
    """The table of a dotted section ("models.draft"), added where the spec has none."""
    import tomlkit

    table = document
    for key in section.split("."):
        if key not in table:
            table.add(key, tomlkit.table())
        table = table[key]
    return table


def write_spec(path: Path, text: str) -> None:
    """The tuned spec in place of the old one, with the old one's permissions."""
    write_atomically(path, text, mode=path.stat().st_mode & 0o7777)
