"""The measurement of one configuration on a running server: each request of the suite, repeated and
interleaved after a warm-up, streamed over SSE for the time to first token, the server's own `timings`
kept as a `Sample` with the energy the machine drew meanwhile where it can be read; the statistics of the
samples per workload (`WorkloadResult`), each sample told to the progress as it is taken. A sample during
which other processes took the CPUs is measured again.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from appliance.facts.energy_meters import Energy
from appliance.measure.config import BenchError
from appliance.measure.progress import Progress
from appliance.measure.server import CpuTimes, others_share
from appliance.measure.suite import Request, call
from appliance.runtime.server_api import ServerApi, ServerUnreachable

CONTENDED_SHARE = 0.2  # other processes used more than this share of all CPUs during a sample: measure again
REQUEST_TIMEOUT = 600.0


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
    seconds: float | None = None  # the request's wall time, as the client saw it
    joules: float | None = None  # what the readable meters counted over that time; None: nothing read
    text: str = ""  # the answer, to tell whether speculation changed it (greedy speculation should not)

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

    @property
    def joules_per_token(self) -> float | None:
        """The energy of the requests (prompt and generation) over the tokens they generated."""
        joules = [s.joules for s in self.samples]
        tokens = sum(s.predicted_n for s in self.samples)
        return sum(j for j in joules if j is not None) / tokens if tokens and None not in joules else None

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
            "joules_per_token": rounded(self.joules_per_token),
        }


def _stream(
    api: ServerApi, path: str, body: dict[str, Any], timeout: float
) -> tuple[float | None, dict[str, Any], str]:
    """Send a streamed request; (seconds to the first chunk with content, the chunk carrying `timings`, the
    answer's text)."""
    answer = api.stream(path, body, timeout)
    if answer.error or answer.status != 200:
        status = f" answered {answer.status}:" if answer.status not in (None, 200) else ":"
        raise BenchError(f"{api.base_url}{path}{status} {answer.error}")
    if answer.final is None:
        raise BenchError(f"{api.base_url}{path} streamed no timings (is this llama-server?)")
    return answer.first_content_seconds, answer.final, answer.text


def _metrics(api: ServerApi) -> dict[str, float] | None:
    try:
        return api.metrics()
    except ServerUnreachable:
        return None


def run_request(api: ServerApi, request: Request, pid: int | None = None, energy: Energy | None = None) -> Sample:
    before, cpu_before = _metrics(api), CpuTimes.read(pid)
    joules_before, started = energy.joules() if energy else None, time.perf_counter()
    if request.workload.stream:
        ttft, answer, text = _stream(api, request.path, request.body, REQUEST_TIMEOUT)
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
        ttft_ms, text = None, str(answer.get("content", ""))
    seconds, joules_after = time.perf_counter() - started, energy.joules() if energy else None
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
            seconds=seconds,
            joules=joules_after - joules_before if joules_after is not None and joules_before is not None else None,
            text=text,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BenchError(f"{api.base_url}{request.path}: no usable timings in the answer ({exc})") from None


def measure(
    api: ServerApi,
    requests: Sequence[Request],
    reps: int,
    pid: int | None = None,
    progress: Progress | None = None,
    retries: int = 2,
    n_max: int | None = None,
    energy: Energy | None = None,
) -> dict[str, WorkloadResult]:
    """Each request `reps` times, interleaved, after a warm-up; a sample during which other processes took
    the CPUs is measured again (up to `retries` times, then kept and counted as contended)."""
    for endpoint in {r.path for r in requests}:
        warm = next(r for r in requests if r.path == endpoint)
        body = {**warm.body, "stream": False, ("n_predict" if endpoint == "/completion" else "max_tokens"): 4}
        body.pop("stream_options", None)
        call(api, endpoint, body, REQUEST_TIMEOUT)
    if progress:
        progress.resume()
    results = {
        r.workload.name: WorkloadResult(r.workload.name, r.workload.title, r.max_tokens, r.prompt_tokens, n_max)
        for r in requests
    }
    for rep in range(reps):
        for request in requests:
            sample = run_request(api, request, pid, energy)
            result = results[request.workload.name]
            for attempt in range(retries):
                if not sample.contended:
                    break
                result.retried += 1
                time.sleep(0.5 * (attempt + 1))
                sample = run_request(api, request, pid, energy)
            result.samples.append(sample)
            if progress:
                name = request.workload.name
                progress.advance(name, f"{name}, rep {rep + 1}/{reps}", sample.decode_tps)
    return results


@dataclass(frozen=True)
class OutputMatch:
    """Whether speculation changed the answers: each repetition's text with speculation against the same
    repetition's without. Greedy speculation should change nothing; a difference is shown, never hidden (on a
    CPU a batched verification can round differently, and one flipped greedy token changes the rest)."""

    compared: int
    matched: int
    at: int | None = None  # the first differing character of the first differing pair
    speculative: str = ""  # the texts around it
    no_speculation: str = ""

    @property
    def identical(self) -> bool:
        return self.compared > 0 and self.matched == self.compared

    @classmethod
    def of(cls, speculative: WorkloadResult, no_speculation: WorkloadResult) -> OutputMatch:
        pairs = [(a.text, b.text) for a, b in zip(speculative.samples, no_speculation.samples, strict=False)]
        matched = sum(1 for a, b in pairs if a == b)
        differing = next(((a, b) for a, b in pairs if a != b), None)
        if differing is None:
            return cls(len(pairs), matched)
        a, b = differing
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        return cls(len(pairs), matched, at, a[max(0, at - 20) : at + 40], b[max(0, at - 20) : at + 40])

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {"identical": self.identical, "compared": self.compared, "matched": self.matched}
        if self.at is not None:
            document["first_difference"] = {
                "at": self.at,
                "speculative": self.speculative,
                "no_speculation": self.no_speculation,
            }
        return document
