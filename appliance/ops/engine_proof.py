"""No engine serves before it is proven on the machine it runs on: the proof of one engine (the ladder that
climbs on a failure is ops/engine_ladder.py).

The proof: the real llama-server with the spec's own command line (its model, threads, devices, KV types,
speculation) on a free loopback port of its own, as the service user, with a key of its own, decodes a fixed
greedy prompt to its natural stop. It passes when it answers with text; its decode and prompt tok/s are the
engine's figures on this machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from appliance.facts.contention import CpuUse, contention
from appliance.facts.cpu import Cpu
from appliance.facts.engine_record import (
    Rung,
    Trial,
)
from appliance.plan.plan import plan
from appliance.plan.validate import Validated
from appliance.runtime.server_api import ServerApi, ServerUnreachable
from appliance.runtime.server_death import describe_exit
from appliance.runtime.server_process import die_with_parent, stop, wait_until_ready
from appliance.spec.problems import Severity
from appliance.system.run import DEVNULL, PIPE, STDOUT, Popen, spawn
from appliance.system.users import Account, NoServiceUser, runs_as

LOAD_TIMEOUT = 900.0  # a 27B model takes minutes to load from a cold disk
ANSWER_TIMEOUT = 600.0
# A question with one short answer: the natural stop comes within a sentence on any instruction-tuned model.
PROOF_MESSAGES = [
    {"role": "system", "content": "You are a concise coding assistant."},
    {
        "role": "user",
        "content": "In one sentence: what does this Python function return for [3, 1, 2]?\n\n"
        "def largest(xs):\n    return sorted(xs)[-1]\n",
    },
]
PROOF_MAX_TOKENS = 160
PROOF_ANSWERS = 2
GREEDY = {"temperature": 0.0, "top_k": 1, "seed": 0, "cache_prompt": False}


class EngineUnproven(Exception):
    """No rung of the ladder works on this machine, or the proof cannot run here; the message says what to do."""


def proof_plan(validated: Validated, port: int, key_file: Path) -> tuple[str, ...]:
    """The spec's argv planned again on 127.0.0.1:port with `key_file` as its key, as the server unit would run
    it but for that, and without the flags of any rung (the ladder adds each rung's own)."""
    spec = validated.plan.spec
    server = spec.server.model_copy(update={"host": "127.0.0.1", "port": port, "api_key_file": key_file})
    spec = spec.model_copy(update={"server": server})
    planned = plan(spec, replace(validated.facts, engine=None), validated.plan.target, validated.plan.draft)
    errors = [p for p in planned.problems if p.severity is Severity.ERROR]
    if errors:
        raise EngineUnproven("cannot plan the proof: " + "; ".join(f"{p.field}: {p.message}" for p in errors))
    return planned.argv


def run_proof(
    argv: Sequence[str],
    who: Account | None,
    key: str,
    port: int,
    build_sets: tuple[str, ...],
    cpu: Cpu,
    rung: Rung,
    load_timeout: float = LOAD_TIMEOUT,
    nice: int = 0,
) -> Trial:
    """One rung's proof: start, wait for /health, one greedy chat completion, stop. Never raises for the
    engine's own failure: that is the Trial's."""
    tail: deque[str] = deque(maxlen=400)
    with niced(nice):  # the server's own priority: its figures are what it will serve at
        process = spawn(
            argv,
            stdin=DEVNULL,
            stdout=PIPE,
            stderr=STDOUT,
            errors="replace",
            bufsize=1,
            preexec_fn=die_with_parent,
            user=who.uid if who else None,
            group=who.gid if who else None,
            extra_groups=list(who.groups) if who else None,
        )
    reader = threading.Thread(
        target=lambda: tail.extend(line.rstrip("\n") for line in process.stdout or ()), daemon=True
    )
    reader.start()
    api = ServerApi(f"http://127.0.0.1:{port}", key, timeout=5.0)
    try:
        if not wait_until_ready(process, api, load_timeout):
            return _failed(rung, process, tail, reader, build_sets, cpu, f"did not load within {load_timeout:.0f} s")
        answers = []
        # Twice: the first answer warms the caches; the better of the two is the figure (a neighbour's burst
        # on a small machine can halve one sample). What else used the CPUs meanwhile is kept with it: a figure
        # taken beside a neighbour judges no engine (facts/engine_record.py regression_ratio).
        ours = {os.getpid(), process.pid}
        before = CpuUse.read(ours)
        for _ in range(PROOF_ANSWERS):
            try:
                answers.append(api.chat(PROOF_MESSAGES, PROOF_MAX_TOKENS, timeout=ANSWER_TIMEOUT, **GREEDY))
            except ServerUnreachable as exc:
                return _failed(rung, process, tail, reader, build_sets, cpu, f"did not answer: {exc}")
        shared = contention(before, CpuUse.read(ours), ours)
        return replace(_judged(rung, answers), contended=round(shared.share, 3) if shared else 0.0)
    finally:
        stop(process, timeout=30)


@contextlib.contextmanager
def niced(nice: int) -> Iterator[None]:
    """This thread at `nice` while it starts a child, which inherits it; as it was afterwards. A nice value is a
    thread's on Linux, and the child drops to the service user before a preexec could lower it."""
    thread = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, thread)
    try:
        os.setpriority(os.PRIO_PROCESS, thread, nice)
    except PermissionError:  # not root: it runs at this process's own
        yield
        return
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, thread, before)


def _judged(rung: Rung, answers: list[dict[str, Any]]) -> Trial:
    """The proof's verdict on its answers: text, and the best figures of them."""
    choice = (answers[0].get("choices") or [{}])[0]
    text = str((choice.get("message") or {}).get("content") or "").strip()
    if not text:
        reason = choice.get("finish_reason")
        return Trial(rung, False, failure=f"answered with no text (finish_reason {reason!r}): no usable answer")
    timings = [answer.get("timings") or {} for answer in answers]
    return Trial(
        rung,
        True,
        decode_tps=round(max(float(t.get("predicted_per_second") or 0.0) for t in timings), 2),
        prompt_tps=round(max(float(t.get("prompt_per_second") or 0.0) for t in timings), 2),
        output_sha256=hashlib.sha256(text.encode()).hexdigest(),
    )


def _failed(
    rung: Rung,
    process: Popen[str],
    tail: deque[str],
    reader: threading.Thread,
    build_sets: tuple[str, ...],
    cpu: Cpu,
    otherwise: str,
) -> Trial:
    """A failed proof, described by how the server ended when it did (a signal, an exit), else by `otherwise`."""
    with contextlib.suppress(Exception):
        process.wait(timeout=5)
    code = process.poll()
    if code is None:
        return Trial(rung, False, failure=f"llama-server {otherwise}")
    reader.join(timeout=5)
    return Trial(rung, False, failure="llama-server " + describe_exit(code, list(tail), build_sets, cpu))


def proof_user() -> Account | None:
    """Whom the proof runs as: the service user when root runs it (root runs nothing of the appliance's),
    else whoever runs it."""
    try:
        return runs_as()
    except NoServiceUser as exc:
        raise EngineUnproven(str(exc)) from None
