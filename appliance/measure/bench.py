"""`llm-appliance bench`: measure the speculative server against a no-draft baseline, on a fixed prompt suite.

Speculative settings are server-wide (the current llama-server compiles its per-request fields out), so
every configuration measured is its own llama-server process: the spec's plan rebuilt with other
speculative values (or none), on a free loopback port, started, measured, stopped. Without `--standalone`
the with-draft numbers come from the running appliance and only the baseline gets a server of its own.

Every figure comes from the server's own `timings`, except time to first token: the wall time from
sending the (streamed) request to the first chunk with content, measured here. Mean accepted length is
1 + accepted / drafts, with drafts from the `llamacpp:spec_decode_num_drafts_total` delta.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TextIO

from appliance.plan.plan import build_argv
from appliance.plan.resolved import Endpoint
from appliance.plan.validate import Validated
from appliance.runtime.server_api import ServerApi, ServerUnreachable, read_api_key
from appliance.spec.model import Spec
from appliance.spec.problems import Severity
from appliance.system import paths

SUITE = "suite-v1.json"
CHAT_MARGIN = 64  # tokens the chat template and the question add around a long document
CONTENDED_SHARE = 0.2  # other processes used more than this share of all CPUs during a sample: measure again
LOAD_TIMEOUT = 900.0  # a 27B model takes minutes to load
REQUEST_TIMEOUT = 600.0
CANARY = "canary"

ApiKind = Literal["chat", "completion"]


class BenchError(Exception):
    """A server would not start or answer as a benchmark needs; the message says what to do."""


class BenchUsage(BenchError):
    """An option that cannot work (exit 2)."""


# The prompt suite ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    endpoint: ApiKind
    max_tokens: int
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] = ()
    document: Mapping[str, Any] | None = None
    stream: bool = True  # the canary is sent exactly as the health daemon sends it: not streamed


@dataclass(frozen=True)
class Suite:
    version: str
    workloads: tuple[Workload, ...]

    @property
    def names(self) -> list[str]:
        return [w.name for w in self.workloads]

    def select(self, names: Sequence[str] | None) -> Suite:
        if not names:
            return self
        unknown = [n for n in names if n not in self.names]
        if unknown:
            raise BenchUsage(f"no workload {', '.join(unknown)} in {self.version}; it has {', '.join(self.names)}")
        return Suite(self.version, tuple(w for w in self.workloads if w.name in names))


def load_suite(path: Path | None = None) -> Suite:
    """The versioned prompt suite shipped in the package (appliance/prompts/), or another file."""
    try:
        text = path.read_text() if path else resources.files("appliance.measure").joinpath("prompts", SUITE).read_text()
        data: dict[str, Any] = json.loads(text)
        workloads = tuple(
            Workload(
                name=str(w["name"]),
                title=str(w.get("title", w["name"])),
                endpoint="completion" if w["endpoint"] == "completion" else "chat",
                max_tokens=int(w["max_tokens"]),
                prompt=w.get("prompt"),
                messages=tuple((str(m["role"]), str(m["content"])) for m in w.get("messages", [])),
                document=w.get("document"),
            )
            for w in data["workloads"]
        )
        return Suite(str(data["version"]), workloads)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"cannot read the prompt suite {path or SUITE}: {exc}") from None


def canary_workload() -> Workload:
    """The health daemon's canary, so its decay check has a measured baseline of its own."""
    from appliance.health.daemon import CANARY_PROMPT, CANARY_TOKENS

    return Workload(CANARY, "health canary", "completion", CANARY_TOKENS, prompt=CANARY_PROMPT, stream=False)


def document_entry(lists: Mapping[str, Sequence[str]], n: int) -> dict[str, str]:
    """Entry n of the long-context document: fixed arithmetic, so every run and version builds the same text."""

    def pick(key: str, step: int, offset: int) -> str:
        items = lists[key]
        return str(items[(n * step + offset) % len(items)])

    return {
        "n": str(n),
        "day": str(1 + (n * 11) % 365),
        "name": pick("name", 7, 3),
        "station": str(100 + (n * 37) % 900),
        "district": pick("district", 3, 1),
        "pressure": f"{2 + (n * 13) % 40 / 10:.1f}",
        "part": pick("part", 5, 2),
        "action": pick("action", 2, 0),
    }


def long_prompt(document: Mapping[str, Any], entries: int) -> str:
    """The document of `entries` log entries with a question about the one in its middle."""
    lists = document["lists"]
    lines = [str(document["entry"]).format(**document_entry(lists, n)) for n in range(1, entries + 1)]
    question = str(document["question"]).format(**document_entry(lists, (entries + 1) // 2))
    return str(document["prompt"]).format(intro=document["intro"], document="\n".join(lines), question=question)


def fit_document(document: Mapping[str, Any], budget: int, count: Callable[[str], int]) -> tuple[str, int]:
    """The longest prompt of whole entries within `budget` tokens (and the suite's target); its token count."""
    budget = min(budget, int(document.get("target_tokens", budget)))
    entries = 20
    tokens = count(long_prompt(document, entries))
    for _ in range(10):
        if 0.92 * budget <= tokens <= budget:
            break
        entries = max(1, int(entries * budget * 0.98 / tokens))
        tokens = count(long_prompt(document, entries))
    while tokens > budget and entries > 1:
        entries = max(1, int(entries * 0.95))
        tokens = count(long_prompt(document, entries))
    if tokens > budget:
        raise BenchError(f"the long-context prompt cannot fit in {budget} tokens; raise server.ctx_size")
    return long_prompt(document, entries), tokens


@dataclass(frozen=True)
class Request:
    workload: Workload
    path: str
    body: dict[str, Any]
    max_tokens: int
    prompt_tokens: int | None


def prepare(workload: Workload, max_tokens: int, slot_ctx: int, count: Callable[[str], int]) -> Request:
    """The request for a workload, within one slot's context (a long document is cut to fit)."""
    common: dict[str, Any] = {"temperature": 0, "ignore_eos": True, "cache_prompt": False, "stream": workload.stream}
    prompt_tokens: int | None = None
    if workload.document is not None:
        text, prompt_tokens = fit_document(workload.document, slot_ctx - max_tokens - CHAT_MARGIN, count)
        messages = [{"role": "user", "content": text}]
    else:
        messages = [{"role": role, "content": content} for role, content in workload.messages]
        text = workload.prompt or "\n".join(content for _, content in workload.messages)
        prompt_tokens = count(text)
    room = slot_ctx - (prompt_tokens or 0) - CHAT_MARGIN
    if room < 1:
        raise BenchError(f"workload {workload.name} does not fit in a slot of {slot_ctx} tokens; raise server.ctx_size")
    max_tokens = min(max_tokens, room)
    if workload.endpoint == "completion":
        body = {"prompt": workload.prompt or text, "n_predict": max_tokens, **common}
        return Request(workload, "/completion", body, max_tokens, prompt_tokens)
    body = {"messages": messages, "max_tokens": max_tokens, **common}
    if workload.stream:
        body["stream_options"] = {"include_usage": True}
    return Request(workload, "/v1/chat/completions", body, max_tokens, prompt_tokens)


# Server configurations ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One server-wide speculative setting; `draft=False` is the no-draft baseline."""

    draft: bool = True
    n_max: int = 0
    n_min: int = 0
    p_min: float = 0.0
    draft_gpu_layers: int | str | None = None  # None: as the spec says
    draft_cache_type: str | None = None

    @classmethod
    def of(cls, spec: Spec) -> Config:
        s = spec.speculative
        return cls(True, s.n_max, s.n_min, s.p_min)

    def label(self) -> str:
        if not self.draft:
            return "no draft"
        text = f"n_max {self.n_max}, n_min {self.n_min}, p_min {self.p_min:g}"
        if self.draft_gpu_layers is not None:
            text += f", draft gpu_layers {self.draft_gpu_layers}"
        if self.draft_cache_type is not None:
            text += f", draft cache {self.draft_cache_type}"
        return text

    def to_json(self) -> dict[str, Any]:
        if not self.draft:
            return {"draft": False}
        values: dict[str, Any] = {"draft": True, "n_max": self.n_max, "n_min": self.n_min, "p_min": self.p_min}
        if self.draft_gpu_layers is not None:
            values["draft_gpu_layers"] = self.draft_gpu_layers
        if self.draft_cache_type is not None:
            values["draft_cache_type"] = self.draft_cache_type
        return values


NO_DRAFT = Config(draft=False)


def server_argv(validated: Validated, config: Config, port: int) -> list[str]:
    """The plan's llama-server argv on 127.0.0.1:port with `config`'s speculative values, in the binary's dialect.

    For the baseline no speculative flag is given at all (no draft model is loaded)."""
    spec = validated.plan.spec
    update: dict[str, Any] = {"server": spec.server.model_copy(update={"host": "127.0.0.1", "port": port})}
    if config.draft:
        values = {"n_max": config.n_max, "n_min": config.n_min, "p_min": config.p_min}
        update["speculative"] = spec.speculative.model_copy(update=values)
        draft = spec.models.draft
        changes: dict[str, Any] = {}
        if config.draft_gpu_layers is not None:
            changes["gpu_layers"] = config.draft_gpu_layers
        if config.draft_cache_type is not None:
            changes["cache_type_k"] = changes["cache_type_v"] = config.draft_cache_type
        if draft is not None and changes:
            update["models"] = spec.models.model_copy(update={"draft": draft.model_copy(update=changes)})
    else:
        update["speculative"] = spec.speculative.model_copy(update={"type": "none"})
    variant = spec.model_copy(update=update)
    draft_in_use = config.draft and validated.plan.draft is not None
    argv, problems = build_argv(variant, validated.facts.dialect, validated.plan.argv[0], draft_in_use)
    errors = [p for p in problems if p.severity is Severity.ERROR]
    if errors:
        raise BenchError(f"cannot build the llama-server argv for {config.label()}: {errors[0].message}")
    return list(argv)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no orphan servers


class TempServer:
    """A llama-server of its own for one configuration: started on a free loopback port, stopped on exit."""

    def __init__(self, validated: Validated, config: Config, load_timeout: float = LOAD_TIMEOUT) -> None:
        self.validated = validated
        self.config = config
        self.load_timeout = load_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self.api = ServerApi("http://127.0.0.1:0")
        self.log = tempfile.NamedTemporaryFile(prefix="llm-appliance-bench-", suffix=".log")  # noqa: SIM115
        self.api_key = read_api_key(validated.plan.spec.server.api_key_file)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def __enter__(self) -> TempServer:
        for _attempt in range(3):  # another process may take the free port first
            port = free_port()
            argv = server_argv(self.validated, self.config, port)
            self.log.seek(0)
            self.log.truncate()
            self.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
            self.api = ServerApi(f"http://127.0.0.1:{port}", self.api_key, timeout=5.0)
            if self._wait_ready():
                return self
            if "bind" not in self._tail().lower():
                break
        tail = self._tail()
        self.stop()
        raise BenchError(f"llama-server for {self.config.label()} did not start: {tail or 'no output'}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.load_timeout
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                if self.api.health() == 200:
                    return True
            except ServerUnreachable:
                pass
            time.sleep(0.1)
        return False

    def _tail(self) -> str:
        self.log.flush()
        lines = Path(self.log.name).read_text(errors="replace").splitlines()
        errors = [line for line in lines if "error" in line.lower() or "failed" in line.lower()]
        return (errors[-1] if errors else lines[-1] if lines else "").strip()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()
        self.log.close()


# Measuring ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuTimes:
    total: float  # seconds, all CPUs, idle included
    busy: float
    ours: float  # the server's and this process's own

    @classmethod
    def read(cls, pid: int | None) -> CpuTimes | None:
        if pid is None:
            return None
        try:
            tick = os.sysconf("SC_CLK_TCK")
            values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
            server = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ours = (int(server[11]) + int(server[12])) / tick + sum(os.times()[:2])
        except (OSError, ValueError, IndexError):
            return None
        return cls(sum(values) / tick, (sum(values) - values[3] - values[4]) / tick, ours)


def others_share(before: CpuTimes | None, after: CpuTimes | None) -> float | None:
    """The share of all CPUs other processes used between two readings (steal time included)."""
    if before is None or after is None or after.total <= before.total:
        return None
    others = (after.busy - before.busy) - (after.ours - before.ours)
    return max(0.0, others) / (after.total - before.total)


@dataclass(frozen=True)
class Sample:
    decode_tps: float
    prompt_tps: float
    ttft_ms: float | None
    prompt_n: int
    predicted_n: int
    draft_n: int
    draft_accepted: int
    drafts: float | None  # speculative rounds, from the /metrics delta
    others_cpu: float | None = None

    @property
    def contended(self) -> bool:
        return self.others_cpu is not None and self.others_cpu > CONTENDED_SHARE


@dataclass(frozen=True)
class Stats:
    median: float
    low: float
    high: float
    samples: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats | None:
        return cls(statistics.median(values), min(values), max(values), tuple(values)) if values else None

    @property
    def spread(self) -> float:
        """Half the range, relative to the median."""
        return (self.high - self.low) / 2 / self.median if self.median else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "median": round(self.median, 3),
            "min": round(self.low, 3),
            "max": round(self.high, 3),
            "samples": [round(v, 3) for v in self.samples],
        }


@dataclass
class WorkloadResult:
    name: str
    title: str
    max_tokens: int
    prompt_tokens: int | None
    n_max: int | None = None  # for the mean accepted length when /metrics has no draft counter
    samples: list[Sample] = field(default_factory=list)
    retried: int = 0  # samples measured again because other processes took the CPUs

    @property
    def decode(self) -> Stats | None:
        return Stats.of([s.decode_tps for s in self.samples])

    @property
    def prompt(self) -> Stats | None:
        return Stats.of([s.prompt_tps for s in self.samples])

    @property
    def ttft(self) -> Stats | None:
        return Stats.of([s.ttft_ms for s in self.samples if s.ttft_ms is not None])

    @property
    def drafted(self) -> int:
        return sum(s.draft_n for s in self.samples)

    @property
    def acceptance(self) -> float | None:
        return sum(s.draft_accepted for s in self.samples) / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per target verification: 1 + accepted / drafts (drafts approximated as draft_n / n_max when
        the server does not count them)."""
        if not self.drafted:
            return None
        rounds = [s.drafts for s in self.samples]
        if all(r is not None for r in rounds):
            drafts = sum(r for r in rounds if r is not None)
        elif self.n_max:
            drafts = sum(math.ceil(s.draft_n / self.n_max) for s in self.samples)
        else:
            return None
        return 1 + sum(s.draft_accepted for s in self.samples) / drafts if drafts else None

    @property
    def contended(self) -> int:
        return sum(1 for s in self.samples if s.contended)

    def to_json(self) -> dict[str, Any]:
        def rounded(value: float | None) -> float | None:
            return round(value, 4) if value is not None else None

        stats = {"decode_tps": self.decode, "prompt_tps": self.prompt, "ttft_ms": self.ttft}
        return {
            **{k: v.to_json() if v else None for k, v in stats.items()},
            "acceptance": rounded(self.acceptance),
            "mean_accepted_length": rounded(self.mean_accepted_length),
            "prompt_tokens": self.samples[0].prompt_n if self.samples else self.prompt_tokens,
            "predicted_tokens": self.samples[0].predicted_n if self.samples else None,
            "contended_samples": self.contended,
            "retried_samples": self.retried,
        }


def _stream(api: ServerApi, path: str, body: dict[str, Any], timeout: float) -> tuple[float | None, dict[str, Any]]:
    """Send a streamed request; (seconds to the first chunk with content, the chunk carrying `timings`)."""
    headers = {"Content-Type": "application/json"}
    if api.api_key:
        headers["Authorization"] = f"Bearer {api.api_key}"
    request = urllib.request.Request(api.base_url + path, data=json.dumps(body).encode(), headers=headers)
    started = time.perf_counter()
    first: float | None = None
    final: dict[str, Any] | None = None
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            for raw in response:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk: dict[str, Any] = json.loads(payload)
                if "error" in chunk:
                    raise BenchError(f"{api.base_url}{path}: {chunk['error']}")
                if first is None and _content(chunk):
                    first = time.perf_counter() - started
                if "timings" in chunk:
                    final = chunk
    except urllib.error.HTTPError as exc:
        raise BenchError(f"{api.base_url}{path} answered {exc.code}: {exc.read()[:300]!r}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise BenchError(f"{api.base_url}{path}: {getattr(exc, 'reason', exc)}") from None
    if final is None:
        raise BenchError(f"{api.base_url}{path} streamed no timings (is this llama-server?)")
    return first, final


def _content(chunk: dict[str, Any]) -> bool:
    if chunk.get("content"):
        return True
    choices = chunk.get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


def _call(api: ServerApi, path: str, body: dict[str, Any] | None = None, timeout: float = 60.0) -> Any:
    try:
        return api.call(path, body, timeout)
    except ServerUnreachable as exc:
        raise BenchError(str(exc)) from None


def _metrics(api: ServerApi) -> dict[str, float] | None:
    try:
        return api.metrics()
    except ServerUnreachable:
        return None


def run_request(api: ServerApi, request: Request, pid: int | None = None) -> Sample:
    before, cpu_before = _metrics(api), CpuTimes.read(pid)
    if request.workload.stream:
        ttft, answer = _stream(api, request.path, request.body, REQUEST_TIMEOUT)
        ttft_ms: float | None = ttft * 1000 if ttft is not None else None
    else:
        try:
            answer = api.completion(
                request.body["prompt"],
                request.max_tokens,
                timeout=REQUEST_TIMEOUT,
                **{k: v for k, v in request.body.items() if k not in ("prompt", "n_predict")},
            )
        except ServerUnreachable as exc:
            raise BenchError(str(exc)) from None
        ttft_ms = None
    cpu_after, after = CpuTimes.read(pid), _metrics(api)
    try:
        t = answer["timings"]
        drafts = None
        if before is not None and after is not None and "spec_decode_num_drafts_total" in after:
            drafts = after["spec_decode_num_drafts_total"] - before.get("spec_decode_num_drafts_total", 0.0)
        return Sample(
            decode_tps=float(t["predicted_per_second"]),
            prompt_tps=float(t["prompt_per_second"]),
            ttft_ms=ttft_ms,
            prompt_n=int(t["prompt_n"]),
            predicted_n=int(t["predicted_n"]),
            draft_n=int(t.get("draft_n", 0)),
            draft_accepted=int(t.get("draft_n_accepted", 0)),
            drafts=drafts,
            others_cpu=others_share(cpu_before, cpu_after),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BenchError(f"{api.base_url}{request.path}: no usable timings in the answer ({exc})") from None


class Progress:
    """A bar on a terminal; on a log, one line per server configuration."""

    def __init__(self, stream: TextIO | None = None, total: int | None = None, enabled: bool = True) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.total = total
        self.done = 0
        self.enabled = enabled
        self.phase_text = ""

    def phase(self, text: str) -> None:
        self.phase_text = text
        if not self.enabled:
            return
        if self.tty:
            self._draw("starting")
        else:
            print(f"bench: {text}", file=self.stream, flush=True)

    def advance(self, detail: str) -> None:
        self.done += 1
        if self.enabled and self.tty:
            self._draw(detail)

    def _draw(self, detail: str) -> None:
        if self.total:
            filled = int(24 * min(self.done, self.total) / self.total)
            bar = f"[{'#' * filled}{'.' * (24 - filled)}] {self.done}/{self.total}"
        else:
            bar = f"[{self.done}]"
        self.stream.write(f"\r\x1b[K{bar}  {self.phase_text}: {detail}"[:160])
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


class Prepared:
    """Requests built once per run (the long document sized on the first server), so every configuration
    gets exactly the same prompts."""

    def __init__(self, workloads: Sequence[Workload], tokens: int | None, slot_ctx: int) -> None:
        self.workloads = list(workloads)
        self.tokens = tokens
        self.slot_ctx = slot_ctx
        self.requests: dict[str, Request] = {}

    def get(self, api: ServerApi) -> list[Request]:
        if not self.requests:
            slot_ctx = _slot_context(api) or self.slot_ctx
            count = _token_counter(api)
            for w in self.workloads:
                tokens = w.max_tokens if self.tokens is None or w.name == CANARY else min(self.tokens, w.max_tokens)
                self.requests[w.name] = prepare(w, tokens, slot_ctx, count)
        return [self.requests[w.name] for w in self.workloads]


def _slot_context(api: ServerApi) -> int | None:
    try:
        return int(_call(api, "/props")["default_generation_settings"]["n_ctx"])
    except (BenchError, ValueError, KeyError, TypeError):
        return None


def _token_counter(api: ServerApi) -> Callable[[str], int]:
    def count(text: str) -> int:
        try:
            return len(_call(api, "/tokenize", {"content": text})["tokens"])
        except (BenchError, KeyError, TypeError):
            pass
        return len(text.encode()) // 3 + 1  # no /tokenize: a cautious estimate (bytes per token is ~3-4)

    return count


def measure(
    api: ServerApi,
    requests: Sequence[Request],
    reps: int,
    pid: int | None = None,
    progress: Progress | None = None,
    retries: int = 2,
    n_max: int | None = None,
) -> dict[str, WorkloadResult]:
    """Each request `reps` times, interleaved, after a warm-up; a sample during which other processes took
    the CPUs is measured again (up to `retries` times, then kept and counted as contended)."""
    for endpoint in {r.path for r in requests}:
        warm = next(r for r in requests if r.path == endpoint)
        body = {**warm.body, "stream": False, ("n_predict" if endpoint == "/completion" else "max_tokens"): 4}
        body.pop("stream_options", None)
        _call(api, endpoint, body, REQUEST_TIMEOUT)
    results = {
        r.workload.name: WorkloadResult(r.workload.name, r.workload.title, r.max_tokens, r.prompt_tokens, n_max)
        for r in requests
    }
    for rep in range(reps):
        for request in requests:
            sample = run_request(api, request, pid)
            result = results[request.workload.name]
            for attempt in range(retries):
                if not sample.contended:
                    break
                result.retried += 1
                time.sleep(0.5 * (attempt + 1))
                sample = run_request(api, request, pid)
            result.samples.append(sample)
            if progress:
                progress.advance(f"{request.workload.name} {rep + 1}/{reps}")
    return results


# A bench run --------------------------------------------------------------------------------------


@dataclass
class Side:
    """One server configuration's results."""

    label: str
    config: Config
    url: str | None  # the running appliance's; None for a server started by bench
    results: dict[str, WorkloadResult]


@dataclass
class BenchResult:
    spec: Path
    suite: str
    mode: Literal["standalone", "appliance"]
    reps: int
    tokens: int | None
    draft: Side
    baseline: Side
    canary: WorkloadResult | None
    measured_at: str
    chart: Path | None = None

    @property
    def workloads(self) -> list[str]:
        return list(self.draft.results)

    def speedup(self, name: str) -> float | None:
        with_draft, without = self.draft.results[name].decode, self.baseline.results[name].decode
        return with_draft.median / without.median if with_draft and without and without.median else None

    def decode_rates(self) -> dict[str, float]:
        """The with-draft decode rates as the health daemon's buckets: workload:<name> and the canary's."""
        rates = {f"workload:{n}": r.decode.median for n, r in self.draft.results.items() if r.decode}
        if self.canary is not None and self.canary.decode:
            from appliance.health.detectors import CANARY_BUCKET

            rates[CANARY_BUCKET] = self.canary.decode.median
        return rates

    def to_json(self) -> dict[str, Any]:
        rows = []
        for name in self.workloads:
            d, b = self.draft.results[name], self.baseline.results[name]
            speedup = self.speedup(name)
            rows.append(
                {
                    "name": name,
                    "title": d.title,
                    "max_tokens": d.max_tokens,
                    "draft": d.to_json(),
                    "no_draft": b.to_json(),
                    "speedup": round(speedup, 4) if speedup is not None else None,
                }
            )
        return {
            "spec": str(self.spec),
            "suite": self.suite,
            "mode": self.mode,
            "reps": self.reps,
            "tokens": self.tokens,
            "measured_at": self.measured_at,
            "configs": {
                "draft": {**self.draft.config.to_json(), "label": self.draft.label, "url": self.draft.url},
                "no_draft": {**self.baseline.config.to_json(), "label": self.baseline.label},
            },
            "workloads": rows,
            "canary": self.canary.to_json() if self.canary else None,
            "chart": str(self.chart) if self.chart else None,
            "ttft": "wall time from sending the streamed request to the first chunk with content, measured by the client",
        }


def run_bench(
    validated: Validated,
    spec_path: Path,
    *,
    standalone: bool,
    reps: int = 3,
    tokens: int | None = None,
    suite: Suite | None = None,
    progress: Progress | None = None,
    with_canary: bool = True,
    load_timeout: float = LOAD_TIMEOUT,
) -> BenchResult:
    spec = validated.plan.spec
    suite = suite or load_suite()
    workloads = list(suite.workloads)
    config = Config.of(spec) if validated.plan.speculation else NO_DRAFT
    prepared = Prepared(workloads, tokens, spec.server.slot_ctx)
    canary = Prepared([canary_workload()], None, prepared.slot_ctx) if with_canary else None
    progress = progress or Progress(enabled=False)
    progress.total = (2 * len(workloads) + (1 if with_canary else 0)) * reps
    n_max = config.n_max if config.draft else None

    def measure_side(api: ServerApi, pid: int | None) -> tuple[dict[str, WorkloadResult], WorkloadResult | None]:
        results = measure(api, prepared.get(api), reps, pid, progress, n_max=n_max)
        found_canary = None
        if canary is not None:
            found_canary = measure(api, canary.get(api), reps, pid, progress, n_max=n_max)[CANARY]
        return results, found_canary

    if standalone:
        progress.phase(f"starting llama-server with the draft ({config.label()})")
        with TempServer(validated, config, load_timeout) as server:
            progress.phase(f"with draft ({config.label()})")
            draft_results, canary_result = measure_side(server.api, server.pid)
        url = None
    else:
        url = Endpoint(spec.server.host, spec.server.port).url
        api = ServerApi(url, read_api_key(spec.server.api_key_file), timeout=5.0)
        try:
            status = api.health()
        except ServerUnreachable as exc:
            raise BenchError(f"the appliance does not answer at {url} ({exc}); start it, or use --standalone") from None
        if status != 200:
            raise BenchError(
                f"the appliance at {url} is not ready (/health answered {status}); wait, or use --standalone"
            )
        progress.phase(f"the running appliance at {url} ({config.label()})")
        draft_results, canary_result = measure_side(api, None)
    progress.phase("starting llama-server without the draft (baseline)")
    with TempServer(validated, NO_DRAFT, load_timeout) as server:
        progress.phase("no draft (baseline)")
        baseline_results = measure(server.api, prepared.get(server.api), reps, server.pid, progress)
    progress.close()
    return BenchResult(
        spec=spec_path,
        suite=suite.version,
        mode="standalone" if standalone else "appliance",
        reps=reps,
        tokens=tokens,
        draft=Side(config.label(), config, url, draft_results),
        baseline=Side(NO_DRAFT.label(), NO_DRAFT, None, baseline_results),
        canary=canary_result,
        measured_at=now(),
    )


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# Output -------------------------------------------------------------------------------------------


def _rate(stats: Stats | None, contended: int = 0) -> str:
    if stats is None:
        return "-"
    return f"{stats.median:.1f} ±{100 * stats.spread:.0f}%{'*' if contended else ''}"


def _ms(stats: Stats | None) -> str:
    return f"{stats.median:.0f}" if stats else "-"


def format_table(result: BenchResult) -> str:
    head = (
        f"{result.spec}: {result.suite}, {result.reps} rep{'s' if result.reps != 1 else ''} per workload, "
        f"median ± half-range; with draft: {result.draft.label}"
        + (f" (the appliance at {result.draft.url})" if result.draft.url else "")
    )
    columns = (
        f"{'workload':<10} {'tokens':>6} {'prompt':>6}  {'decode tok/s draft':>18} {'no draft':>14} {'speedup':>7}"
        f"  {'TTFT ms':>15}  {'prompt tok/s':>12}  {'accept':>6} {'mean len':>8}"
    )
    lines = [head, "", columns, "-" * len(columns)]
    contended = 0
    for name in result.workloads:
        d, b = result.draft.results[name], result.baseline.results[name]
        contended += d.contended + b.contended
        speedup = result.speedup(name)
        prompt_n = d.samples[0].prompt_n if d.samples else 0
        acceptance, mean_len = d.acceptance, d.mean_accepted_length
        lines.append(
            f"{name:<10} {d.samples[0].predicted_n if d.samples else 0:>6} {prompt_n:>6}  "
            f"{_rate(d.decode, d.contended):>18} {_rate(b.decode, b.contended):>14} "
            f"{f'{speedup:.2f}x' if speedup else '-':>7}  "
            f"{_ms(d.ttft) + ' / ' + _ms(b.ttft):>15}  "
            f"{(f'{d.prompt.median:.0f}' if d.prompt else '-') + ' / ' + (f'{b.prompt.median:.0f}' if b.prompt else '-'):>12}  "
            f"{f'{acceptance:.2f}' if acceptance is not None else '-':>6} {f'{mean_len:.2f}' if mean_len else '-':>8}"
        )
    if result.canary is not None and result.canary.decode:
        lines.append(f"{'canary':<10} {result.canary.max_tokens:>6} {'':>6}  {_rate(result.canary.decode):>18}")
    lines += [
        "",
        "decode and prompt tok/s: the server's own timings; TTFT (draft / none): wall time to the first streamed",
        "content chunk; accept: accepted / drafted tokens; mean len: 1 + accepted / drafts (tokens per target pass).",
    ]
    if contended:
        lines.append(
            f"* {contended} sample(s) ran while other processes took more than {CONTENDED_SHARE:.0%} of the CPUs"
        )
    return "\n".join(lines)


def write_baseline(path: Path, rates: Mapping[str, float], details: Mapping[str, Any]) -> dict[str, Any]:
    """The health daemon's baseline file: decode tok/s per bucket and the versions they were measured under."""
    from appliance.facts.gpu import Pynvml
    from appliance.health.versions import Baseline, detect

    found = detect(Pynvml(), paths.ENGINE_DIR)
    baseline = Baseline({k: round(v, 3) for k, v in rates.items()}, found.comparable(), now())
    document = {**json.loads(baseline.to_json()), **details}
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    os.replace(temporary, path)
    return document


def chart_rows(result: BenchResult) -> list[tuple[str, float | None, float | None]]:
    rows = []
    for name in result.workloads:
        d, b = result.draft.results[name].decode, result.baseline.results[name].decode
        rows.append((name, d.median if d else None, b.median if b else None))
    return rows


def main_bench(
    spec_path: Path,
    validated: Validated,
    *,
    standalone: bool,
    reps: int,
    tokens: int | None,
    workloads: Sequence[str] | None,
    suite_file: Path | None,
    as_json: bool,
    chart: Path | None,
    baseline: Path | None,
    out: TextIO | None = None,
) -> int:
    """The `bench` command; returns its exit code (3 when the baseline file cannot be written)."""
    out = out or sys.stdout
    if reps < 1 or (tokens is not None and tokens < 1):
        raise BenchUsage("--reps and --tokens must be at least 1")
    suite = load_suite(suite_file).select(workloads)
    result = run_bench(
        validated, spec_path, standalone=standalone, reps=reps, tokens=tokens, suite=suite, progress=Progress()
    )
    if chart is not None:
        from appliance.measure.chart import draw_bench_chart

        title = f"{spec_path.name}: decode tok/s with and without the draft ({result.suite}, median of {reps})"
        draw_bench_chart(chart, title, chart_rows(result), (f"draft: {result.draft.label}", "no draft"))
        result.chart = chart
    code = 0
    written = None
    if baseline is not None:
        details = {
            "measured_by": "llm-appliance bench",
            "suite": result.suite,
            "speculative": result.draft.config.to_json(),
            "tokens": tokens,
            "reps": reps,
        }
        try:
            write_baseline(baseline, result.decode_rates(), details)
            written = baseline
        except OSError as exc:
            print(
                f"bench: cannot write the baseline {baseline}: {exc}; run as root, or pass --baseline PATH",
                file=sys.stderr,
            )
            code = 3
    if as_json:
        document = result.to_json()
        document["baseline_file"] = str(written) if written else None
        print(json.dumps(document, indent=2, ensure_ascii=False), file=out)
    else:
        print(format_table(result), file=out)
        if result.chart:
            print(f"chart: {result.chart}", file=out)
        if written:
            print(f"baseline: {written} (decode tok/s per workload and the canary, for the health daemon)", file=out)
    return code
