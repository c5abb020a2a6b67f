"""The prompt suite: the versioned workloads (loaded from the suite file shipped in the package), the health
daemon's canary, the long-context document built and cut to fit a slot, and the request each workload
makes (`prepare`); `Prepared` builds them once per run, sized with the first server's tokenizer, so every
configuration gets exactly the same prompts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from appliance.measure.config import BenchError, BenchUsage
from appliance.runtime.server_api import ServerApi, ServerUnreachable

SUITE = "suite-v2.json"
CHAT_MARGIN = 64  # tokens the chat template and the question add around a long document
CANARY = "canary"

ApiKind = Literal["chat", "completion"]


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
    # Natural answers: each request ends at the model's end of answer (or max_tokens). suite-v1 decoded exactly
    # max_tokens (ignore_eos), and what a tiny greedy model writes after its answer is a loop n-grams accept.
    stop_at_eos: bool = False

    @property
    def names(self) -> list[str]:
        return [w.name for w in self.workloads]

    def select(self, names: Sequence[str] | None) -> Suite:
        if not names:
            return self
        unknown = [n for n in names if n not in self.names]
        if unknown:
            raise BenchUsage(f"no workload {', '.join(unknown)} in {self.version}; it has {', '.join(self.names)}")
        return Suite(self.version, tuple(w for w in self.workloads if w.name in names), self.stop_at_eos)


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
        return Suite(str(data["version"]), workloads, bool(data.get("stop_at_eos", False)))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"cannot read the prompt suite {path or SUITE}: {exc}") from None


def canary_workload() -> Workload:
    """The health daemon's canary, so its decay check has a measured baseline of its own."""
    from appliance.health.probe import CANARY_PROMPT, CANARY_TOKENS

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


def prepare(
    workload: Workload, max_tokens: int, slot_ctx: int, count: Callable[[str], int], stop_at_eos: bool = False
) -> Request:
    """The request for a workload, within one slot's context (a long document is cut to fit). The canary is
    sent as the health daemon sends it: exactly its tokens, whatever the suite."""
    ignore_eos = workload.name == CANARY or not stop_at_eos
    common: dict[str, Any] = {
        "temperature": 0,
        "ignore_eos": ignore_eos,
        "cache_prompt": False,
        "stream": workload.stream,
    }
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


class Prepared:
    """Requests built once per run (the long document sized on the first server), so every configuration
    gets exactly the same prompts."""

    def __init__(
        self, workloads: Sequence[Workload], tokens: int | None, slot_ctx: int, stop_at_eos: bool = False
    ) -> None:
        self.workloads = list(workloads)
        self.stop_at_eos = stop_at_eos
        self.tokens = tokens
        self.slot_ctx = slot_ctx
        self.requests: dict[str, Request] = {}

    def get(self, api: ServerApi) -> list[Request]:
        if not self.requests:
            slot_ctx = slot_context(api) or self.slot_ctx
            count = token_counter(api)
            for w in self.workloads:
                tokens = w.max_tokens if self.tokens is None or w.name == CANARY else min(self.tokens, w.max_tokens)
                self.requests[w.name] = prepare(w, tokens, slot_ctx, count, self.stop_at_eos)
        return [self.requests[w.name] for w in self.workloads]


def slot_context(api: ServerApi) -> int | None:
    """The context of one slot as the server reports it."""
    try:
        return int(call(api, "/props")["default_generation_settings"]["n_ctx"])
    except (BenchError, ValueError, KeyError, TypeError):
        return None


def token_counter(api: ServerApi) -> Callable[[str], int]:
    """The server's own token count of a text (its /tokenize), or a cautious estimate without one."""

    def count(text: str) -> int:
        try:
            return len(call(api, "/tokenize", {"content": text})["tokens"])
        except (BenchError, KeyError, TypeError):
            pass
        return len(text.encode()) // 3 + 1  # no /tokenize: a cautious estimate (bytes per token is ~3-4)

    return count


def call(api: ServerApi, path: str, body: dict[str, Any] | None = None, timeout: float = 60.0) -> Any:
    """A request to the server whose failure is a BenchError."""
    try:
        return api.call(path, body, timeout)
    except ServerUnreachable as exc:
        raise BenchError(str(exc)) from None
