"""`llm-appliance status`: one screen an admin reads in five seconds, and an exit code a monitoring plugin reads.

Everything comes from where the running appliance publishes it: systemd (unit states, since when), llama-server
(/health), the health daemon's exporter (/metrics, /ready), the restart history, and the spec on disk against the
applied snapshot. Under `up` (no systemd) the same, less the units. What runs the appliance is found out, not
assumed: systemd when it is PID 1 and the units are loaded, `up` when an `up` of the state directory runs (its pid
file, runtime/running.py), else nothing. An `up` of another spec than the applied one is described as it runs
(what it announced), and the applied snapshot is not held against it. `gather` asks; `assess` and `format_status`
are pure.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, cast

from prometheus_client.parser import text_string_to_metric_families

from appliance.facts.engine_manifest import Manifest
from appliance.facts.engine_record import EngineRecord, engine_lines, record_file, stale_reason
from appliance.health.peers import Peer, read_peer
from appliance.health.requests import ADOPTED, REQUEST
from appliance.plan.resolved import Appliance
from appliance.runtime.running import read_small, running_up
from appliance.runtime.server_api import ServerApi, ServerUnreachable
from appliance.runtime.server_death import LAST_EXIT
from appliance.system import metric_names as metric
from appliance.system import paths
from appliance.system.run import CommandFailed, run

Health = Literal["healthy", "degraded", "down"]
Mode = Literal["systemd", "up"]  # what runs the appliance; None: nothing does
# The monitoring-plugins convention (Nagios, Icinga, Checkmk): OK, WARNING, CRITICAL; UNKNOWN when it cannot tell.
EXIT: dict[Health, int] = {"healthy": 0, "degraded": 1, "down": 2}
EXIT_UNKNOWN = 3
TIMEOUT_SECONDS = 3.0
LAST_RESTARTS = 5
# A state file larger than this is not the daemon's (which prunes to a week of restarts): not read.
STATE_FILE_LIMIT = 1 << 20
# The exporter's whole exposition is a few kilobytes; more is not ours to read.
EXPOSITION_LIMIT = 4 << 20
# What the screen shows of text the service user controls (labels, reasons): no terminal control sequences.
UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f]")

Series = dict[str, list[tuple[dict[str, str], float]]]


@dataclass(frozen=True)
class Unit:
    name: str
    state: str  # "active (running)", "inactive (dead)", "failed (failed)"
    since: str = ""  # systemd's timestamp of the state, or the timer's next run
    loaded: bool = True  # systemd knows the unit (LoadState=loaded)


@dataclass
class Status:
    mode: Mode | None
    spec_file: str  # what runs: the spec an `up` was given, else the applied (or the named) spec
    state_dir: str = ""
    is_applied: bool = True  # what is described is the applied snapshot (else an `up` of another spec, say)
    applied_spec: str | None = None  # the applied snapshot's spec; None: nothing is applied
    systemd_is_init: bool = False  # /run/systemd/system exists, as sd_booted(3) asks
    up_pid: int | None = None  # the `up` that runs the appliance
    units: list[Unit] = field(default_factory=list)
    server: str = "unreachable"  # /health: "ok", "loading", "HTTP n", "unreachable (why)"
    ready: Peer | None = None  # the daemon's /ready; None when its exporter does not answer
    metrics: Series = field(default_factory=dict)
    pins: dict[str, str] = field(default_factory=dict)
    decay_ratio: float = 0.0
    restarts: list[tuple[float, str]] = field(default_factory=list)
    asked: str | None = None  # a restart asked for and not done yet: "scheduled (waiting)", "manual (in progress)"
    spec_differences: list[str] = field(default_factory=list)
    # [fallback]: the router's answers by backend ("local", "fallback"), from its /metrics/; None without one,
    # {} when it does not answer.
    router_answers: dict[str, float] | None = None
    engine: list[str] = field(default_factory=list)  # the engine's proof on this machine (facts/engine_record.py)
    last_exit: str | None = None  # how llama-server last ended, as the launcher described it
    health: Health = "down"
    problems: list[str] = field(default_factory=list)

    def value(self, name: str, **labels: str) -> float | None:
        for found, value in self.metrics.get(name, []):
            if all(found.get(k) == v for k, v in labels.items()):
                return value
        return None

    def acceptance(self) -> float | None:
        """Accepted / drafted tokens; None until drafts exist (an exporter of before the gauge was left unset
        exports 0 then: the drafted counter tells)."""
        if not self.value(metric.SPECULATION_DRAFTED_TOKENS_TOTAL):
            return None
        return self.value(metric.SPECULATION_ACCEPTANCE_RATIO)

    def speedups(self) -> dict[str, float]:
        """Decode with speculation over decode without it, by bucket (where the baseline measured both)."""
        return {labels["bucket"]: v for labels, v in self.metrics.get(metric.SPECULATION_SPEEDUP, [])}

    def contention(self) -> dict[str, object]:
        """What else used the machine in the daemon's last check, and the samples it did not judge for it."""
        shares = {labels["resource"]: v for labels, v in self.metrics.get(metric.CONTENTION_SHARE, [])}
        return {
            "share": shares,
            "contended": self.value(metric.CONTENDED) == 1,
            "contended_samples": self.value(metric.DECODE_CONTENDED_SAMPLES_TOTAL),
        }

    def fallback_share(self) -> float | None:
        """The share of the router's answers the upstream gave, since the router started."""
        answers = self.router_answers or {}
        total = sum(answers.values())
        return answers.get("fallback", 0.0) / total if total else None

    def document(self) -> dict[str, object]:
        """--json: the same facts, for scripts."""
        shown = asdict(self)
        shown["metrics"] = {
            name: [{"labels": labels, "value": v} for labels, v in s] for name, s in self.metrics.items()
        }
        shown["speculation_speedup"] = self.speedups()
        shown["acceptance"] = self.acceptance()
        shown["contention"] = self.contention()
        shown["fallback_share"] = self.fallback_share()
        shown["exit_code"] = EXIT[self.health]
        return shown


def gather(
    appliance: Appliance,
    spec_differences: list[str],
    spec_file: str | None = None,
    applied_spec: str | None = None,
    is_applied: bool = True,
) -> Status:
    """What runs `appliance`, and how it does; `spec_file`: the spec to name (default the appliance's)."""
    spec = appliance.spec
    state = appliance.state_file.parent
    seen = Status(
        None,
        spec_file or str(appliance.spec_file),
        str(state),
        is_applied,
        applied_spec,
        spec_differences=spec_differences,
    )
    seen.pins = {k: str(v) for k, v in spec.versions.model_dump().items() if v and k != "on_mismatch"}
    seen.decay_ratio = spec.health.decay_ratio
    seen.up_pid = running_up(state)
    seen.systemd_is_init = systemd_is_init()
    if seen.up_pid is not None:
        seen.mode = "up"
    elif seen.systemd_is_init:
        # Asked only where systemd runs: elsewhere systemctl has nothing to say but errors.
        units = [_unit(name) for name in (paths.SERVER_UNIT, paths.HEALTH_UNIT, paths.RESTART_TIMER)]
        # A systemctl that cannot answer is shown as such (the unit "unknown"), not taken for no units.
        if units[0].loaded or units[0].state.startswith("unknown"):
            seen.mode, seen.units = "systemd", units
    try:
        code = ServerApi(appliance.server.url, timeout=TIMEOUT_SECONDS).health()
        seen.server = {200: "ok", 503: "loading"}.get(code, f"HTTP {code}")
    except ServerUnreachable as exc:
        seen.server = f"unreachable ({exc})"
    ready = read_peer("self", appliance.exporter.url.rstrip("/") + "/ready", TIMEOUT_SECONDS)
    if not (ready.reason or "").startswith("unreachable"):
        seen.ready = ready
        seen.metrics = _scrape(appliance.exporter.url.rstrip("/") + "/metrics")
    if appliance.router is not None:
        answered = _scrape(f"{appliance.router.endpoint.url}/metrics/").get(metric.ROUTER_ANSWERS_TOTAL, [])
        seen.router_answers = {}
        for labels, value in answered:
            backend = labels.get("model_id", "?")
            seen.router_answers[backend] = seen.router_answers.get(backend, 0.0) + value
    seen.engine = _engine(Path(appliance.argv[0]))
    if seen.server != "ok":
        seen.last_exit = _read_small(state / LAST_EXIT)
    seen.restarts = _restarts(appliance.state_file)[-LAST_RESTARTS:]
    for name, words in ((ADOPTED, "in progress"), (REQUEST, "not yet taken by the daemon")):
        asked = _read_small(state / name)
        if asked is not None:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                seen.asked = f"{json.loads(asked)['reason']} ({words})"
    seen.health, seen.problems = assess(seen)
    return seen


def _engine(binary: Path) -> list[str]:
    """The rung the engine serves from, its proof's figures and age; whether it still holds."""
    manifest = Manifest.read(paths.ENGINE_DIR)
    manifest = manifest if manifest is not None and Path(manifest.binary) == binary else None
    record = EngineRecord.read(record_file(binary, paths.ENGINE_DIR))
    lines = engine_lines(record, stale_reason(binary, record, manifest))
    return [lines[0], *(line for line in lines[1:] if "NOT PROVEN" in line or "since the engine before" in line)]


def systemd_is_init() -> bool:
    return Path("/run/systemd/system").is_dir()


def assess(seen: Status) -> tuple[Health, list[str]]:
    """Down: llama-server does not answer (or its unit is not active). Degraded: it answers, but something an
    admin should look at holds (not ready, decay, versions, speculation, the budget, the daemon, the spec).
    A shared box is neither: the machine line shows it, and LlmApplianceBoxShared pages once it lasts. One busy
    check (a build, this very command's start) says nothing about the server."""
    down, degraded = [], []
    if seen.mode is None:
        down.append(_nothing_runs(seen))
    server_unit = next((u for u in seen.units if u.name == paths.SERVER_UNIT), None)
    if server_unit and not server_unit.state.startswith("active"):
        down.append(f"{server_unit.name} is {server_unit.state}")
    if seen.server != "ok":
        down.append(f"llama-server /health: {seen.server}")
        if seen.last_exit:
            down.append(f"llama-server last ended: it {seen.last_exit.strip()}")
    if seen.ready is None:
        degraded.append("the health daemon's exporter does not answer: nothing is watched")
    else:
        if not seen.ready.ready and seen.server == "ok":
            degraded.append(f"not ready for a balancer: {seen.ready.reason}")
        for name, words in (
            (metric.VERSION_MISMATCH, "versions differ from the spec's pins"),
            (metric.VERSION_DRIFT, "versions changed since the baseline was measured"),
            (metric.RESTART_BUDGET_EXHAUSTED, "max_per_hour restarts reached: the daemon stopped restarting"),
            (metric.FLEET_DECAY, "most of the fleet decays at once: decay restarts held"),
        ):
            if seen.value(name) == 1:
                degraded.append(words)
        if seen.value(metric.DRAFT_CONFIGURED) == 1 and seen.value(metric.SPECULATION_ENGAGED) == 0:
            degraded.append("a draft is configured and no drafts are made")
        for bucket, rate, baseline in _buckets(seen):
            if baseline and rate < seen.decay_ratio * baseline:
                degraded.append(
                    f"decode {rate:.0f} tok/s in {bucket}, below {seen.decay_ratio} x baseline {baseline:.0f}"
                )
    if seen.spec_differences:
        degraded.append("the spec on disk differs from what is applied")
    if down:
        return "down", down + degraded
    return ("degraded" if degraded else "healthy"), degraded


def _nothing_runs(seen: Status) -> str:
    systemd = (
        f"the units are not loaded (`llm-appliance apply` installs them; then `systemctl start {paths.SERVER_UNIT}`)"
        if seen.systemd_is_init
        else "systemd is not PID 1 here"
    )
    own = "" if seen.state_dir == str(paths.STATE) else f" --state-dir {seen.state_dir}"
    return (
        f"nothing runs the appliance: {systemd}, and no `llm-appliance up` runs with state directory "
        f"{seen.state_dir} (`llm-appliance up {seen.spec_file}{own}` starts one)"
    )


def format_status(seen: Status) -> str:
    """The screen. Label values and reasons come from the exporter (the service user's): printed without
    control characters, so a compromised daemon cannot drive root's terminal."""
    return "\n".join(UNPRINTABLE.sub("?", line) for line in _screen(seen))


def _screen(seen: Status) -> list[str]:
    runs = {"systemd": "systemd", "up": f"`llm-appliance up`, pid {seen.up_pid}", None: "nothing runs it"}[seen.mode]
    lines = [f"llm-appliance: {seen.health.upper()} ({seen.spec_file}, {runs})"]
    lines += [f"  ! {problem}" for problem in seen.problems]
    for unit in seen.units:
        lines.append(f"unit     {unit.name}: {unit.state}{f' since {unit.since}' if unit.since else ''}")
    ready = (
        "exporter not answering"
        if seen.ready is None
        else "ready"
        if seen.ready.ready
        else f"not ready: {seen.ready.reason}"
    )
    lines.append(f"server   /health {seen.server}; /ready {ready}")
    lines += [f"engine   {line.removeprefix('engine ').strip()}" for line in seen.engine]
    versions = next(iter(labels for labels, _ in seen.metrics.get(metric.VERSION_INFO, [])), {})
    if versions:
        shown = ", ".join(
            f"{k} {v}" + (f" (pin {seen.pins[k]})" if k in seen.pins else "") for k, v in sorted(versions.items())
        )
        lines.append(f"versions {shown}")
    for bucket, rate, baseline in _buckets(seen):
        against = (
            f" / baseline {baseline:.1f} (decay below {seen.decay_ratio * baseline:.1f})"
            if baseline
            else " (learning baseline)"
        )
        gain = seen.speedups().get(bucket)
        gained = f", {gain:.2f}x the rate without speculation" if gain is not None else ""
        lines.append(f"decode   {bucket}: {rate:.1f} tok/s{against}{gained}")
    lines += _speculation(seen)
    lines += _machine(seen)
    lines += _router(seen)
    lines += _memory(seen)
    energy = [
        f"{labels['source']} {value:.2f} J/token"
        for labels, value in seen.metrics.get(metric.ENERGY_PER_TOKEN_JOULES, [])
    ]
    if energy:
        lines.append("energy   " + ", ".join(energy))
    if seen.restarts:
        last = "; ".join(
            f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(t))} {r}" for t, r in reversed(seen.restarts)
        )
        lines.append(f"restarts {last}")
    pending = _pending(seen)
    if pending:
        lines.append(f"pending  {pending}")
    if not seen.is_applied:
        applied = f"{seen.applied_spec} is" if seen.applied_spec else "nothing is"
        lines.append(f"spec     {seen.spec_file} is not what is applied ({applied})")
    elif seen.spec_differences:
        lines.append("spec     differs from what is applied (`llm-appliance apply` it):")
        lines += [f"  {line}" for line in seen.spec_differences]
    else:
        lines.append("spec     is what is applied")
    return lines


def _buckets(seen: Status) -> list[tuple[str, float, float | None]]:
    return [
        (labels["bucket"], value, seen.value(metric.DECODE_BASELINE_TOKENS_PER_SECOND, bucket=labels["bucket"]))
        for labels, value in seen.metrics.get(metric.DECODE_TOKENS_PER_SECOND, [])
    ]


def _speculation(seen: Status) -> list[str]:
    acceptance = seen.acceptance()
    drafts = "no drafts yet" if acceptance is None else f"acceptance {acceptance:.2f}"
    if seen.value(metric.DRAFT_CONFIGURED) == 1:
        if seen.value(metric.SPECULATION_ENGAGED) == 0:
            return ["draft    NOT ENGAGED" + ("" if acceptance is None else f" (earlier {drafts})")]
        return [f"draft    {'engaged' if acceptance is not None else 'configured'}, {drafts}"]
    if seen.value(metric.SPECULATION_CONFIGURED) == 1:
        # n-gram types draft only once the output repeats earlier text: no drafts yet is no verdict.
        return [f"draft    n-gram lookup (no draft model), {drafts}"]
    return []


def _machine(seen: Status) -> list[str]:
    found = seen.contention()
    shares = cast(dict[str, float], found["share"])
    if not shares:
        return []
    used = ", ".join(f"{share:.0%} of the {'CPUs' if r == 'cpu' else 'GPU'}" for r, share in sorted(shares.items()))
    verdict = "contended: decode samples not judged" if found["contended"] else "not contended"
    return [f"machine  other processes used {used}; {verdict} ({found['contended_samples'] or 0:.0f} samples so far)"]


def _router(seen: Status) -> list[str]:
    if seen.router_answers is None:
        return []
    share = seen.fallback_share()
    if share is None:  # (LiteLLM exports no series before its first answer, nor anything when it is down)
        return ["router   no answers counted yet"]
    counts = ", ".join(f"{backend} {n:.0f}" for backend, n in sorted(seen.router_answers.items()))
    return [f"router   answers since it started: {counts}; {share:.0%} by the fallback"]


def _memory(seen: Status) -> list[str]:
    mib = 1 << 20
    lines = []
    for labels, used in seen.metrics.get(metric.GPU_MEMORY_USED_BYTES, []):
        total = seen.value(metric.GPU_MEMORY_TOTAL_BYTES, device=labels["device"]) or 0.0
        free = seen.value(metric.GPU_MEMORY_FREE_BYTES, device=labels["device"]) or 0.0
        lines.append(
            f"gpu      {labels['device']}: {used / mib:.0f} of {total / mib:.0f} MiB used, {free / mib:.0f} free"
        )
    vram, creep = seen.value(metric.SERVER_VRAM_BYTES), seen.value(metric.SERVER_VRAM_CREEP_RATIO)
    if vram:
        lines.append(
            f"vram     llama-server {vram / mib:.0f} MiB" + (f", creep {100 * creep:.0f}%" if creep is not None else "")
        )
    return lines


def _pending(seen: Status) -> str | None:
    if seen.ready is not None and seen.ready.reason in ("draining", "restarting"):
        return f"restart under way ({seen.ready.reason}" + (f", for {seen.ready.wants})" if seen.ready.wants else ")")
    if seen.ready is not None and seen.ready.wants:
        claim = ", its turn claimed" if seen.ready.claim else ""
        return f"restart wanted ({seen.ready.wants}){claim}; waiting (the daemon's log says why)"
    if seen.asked:
        return f"restart asked for: {seen.asked}"
    return None


def _unit(name: str) -> Unit:
    properties = ("LoadState", "ActiveState", "SubState", "ActiveEnterTimestamp", "NextElapseUSecRealtime")
    try:
        shown = run(["systemctl", "show", *(f"--property={p}" for p in properties), name], timeout=10, quiet=True)
    except CommandFailed as exc:
        return Unit(name, f"unknown ({exc})", loaded=False)
    values = dict(line.partition("=")[::2] for line in shown.stdout.splitlines())
    since = values.get("ActiveEnterTimestamp", "")
    if name.endswith(".timer") and values.get("NextElapseUSecRealtime"):
        since = (
            f"{since}; next {values['NextElapseUSecRealtime']}" if since else f"next {values['NextElapseUSecRealtime']}"
        )
    return Unit(
        name,
        f"{values.get('ActiveState', '?')} ({values.get('SubState', '?')})",
        since,
        loaded=values.get("LoadState") == "loaded",
    )


def _scrape(url: str) -> Series:
    """The exporter's metrics; nothing when it does not answer or answers what no exporter of ours writes (it
    runs as the service user, and root may be the one asking)."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_SECONDS) as answer:
            text = answer.read(EXPOSITION_LIMIT).decode()
        series: Series = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                series.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    except (OSError, ValueError, TypeError, IndexError):
        return {}
    return series


def _restarts(path: Path) -> list[tuple[float, str]]:
    text = _read_small(path)
    try:
        entries = json.loads(text or "{}").get("restarts", [])
        return [(float(t), str(r)) for t, r in entries]
    except (ValueError, TypeError, AttributeError):
        return []


def _read_small(path: Path) -> str | None:
    return read_small(path, STATE_FILE_LIMIT)
