"""bench: the prompt suite, the argv of each configuration, the numbers, and real runs against the demo pair."""

from __future__ import annotations

import io
import json
import os
import re
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path

import pytest
from conftest import EXAMPLE_FACTS, resolved

import appliance.cli.main as cli
from appliance.cli.commands import EXIT_APPLY
from appliance.facts.energy_meters import Energy, RaplMeter
from appliance.health import versions
from appliance.health.detectors import CANARY_BUCKET
from appliance.measure.bench import run_bench
from appliance.measure.bench_report import format_table
from appliance.measure.chart import draw_bench_chart
from appliance.measure.config import NO_SPECULATION, BenchError, Config
from appliance.measure.measure import Sample, Stats, WorkloadResult
from appliance.measure.progress import Progress, duration, time_left
from appliance.measure.server import TempServer, free_port, server_argv
from appliance.measure.suite import CHAT_MARGIN, canary_workload, fit_document, load_suite, long_prompt, prepare
from appliance.plan.validate import validate
from appliance.runtime.server_api import ServerApi, ServerUnreachable
from appliance.system.users import account


def rough_count(text: str) -> int:
    return len(text) // 4 + 1


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def test_the_suite_is_versioned_and_ships_inside_the_package() -> None:
    shipped = resources.files("appliance.measure").joinpath("prompts", "suite-v2.json")
    assert shipped.is_file()
    suite = load_suite()
    assert suite.version == "suite-v2" and suite.stop_at_eos
    assert suite.names == ["chat", "code", "edit", "prose-en", "prose-zh", "long-qa"]
    # edit: a whole source file in the request, the answer rewrites it (an IDE's most common request).
    edit = next(w for w in suite.workloads if w.name == "edit")
    assert edit.endpoint == "chat" and "return the whole file" in edit.messages[0][1].lower()
    assert edit.messages[0][1].count("def ") >= 10 and len(edit.messages[0][1]) > 2000
    # The version before stays readable: baselines name the suite they were measured with.
    v1 = load_suite(Path(str(resources.files("appliance.measure").joinpath("prompts", "suite-v1.json"))))
    assert v1.version == "suite-v1" and not v1.stop_at_eos
    chinese = next(w for w in suite.workloads if w.name == "prose-zh")
    assert re.search(r"[\u4e00-\u9fff]{10}", chinese.messages[0][1]), "the Chinese prose prompt is not Chinese"
    code = next(w for w in suite.workloads if w.name == "code")
    assert code.endpoint == "completion" and code.prompt and code.prompt.startswith("import csv")
    assert suite.select(["code", "chat"]).names == ["chat", "code"]
    with pytest.raises(BenchError, match="no workload nope"):
        suite.select(["nope"])


def test_the_long_document_is_fixed_and_cut_to_fit() -> None:
    document = next(w for w in load_suite().workloads if w.name == "long-qa").document
    assert document is not None
    assert long_prompt(document, 50) == long_prompt(document, 50)
    full, tokens = fit_document(document, 100_000, rough_count)
    assert 0.92 * document["target_tokens"] <= tokens <= document["target_tokens"]
    short, short_tokens = fit_document(document, 600, rough_count)
    assert 0.9 * 600 <= short_tokens <= 600 and len(short) < len(full)
    # The question is about an entry that is in the document.
    station = re.search(r"pump station (\d+) on day (\d+)", short)
    assert station is not None
    assert f"pump station {station.group(1)} in the" in short
    with pytest.raises(BenchError, match="cannot fit"):
        fit_document(document, 20, rough_count)


def test_requests_fit_one_slot_and_are_greedy_uncached_and_natural() -> None:
    suite = {w.name: w for w in load_suite().workloads}
    long_qa = prepare(suite["long-qa"], 128, 1024, rough_count, stop_at_eos=True)
    assert long_qa.prompt_tokens is not None
    assert long_qa.prompt_tokens + long_qa.max_tokens + CHAT_MARGIN <= 1024
    assert long_qa.path == "/v1/chat/completions" and long_qa.body["stream"] is True
    code = prepare(suite["code"], 512, 4096, rough_count, stop_at_eos=True)
    assert code.path == "/completion" and code.body["n_predict"] == code.max_tokens == 512
    for request in (long_qa, code):
        assert request.body["temperature"] == 0
        assert request.body["ignore_eos"] is False  # a natural answer: it ends where the model ends it
        assert request.body["cache_prompt"] is False
    # suite-v1 decoded exactly max_tokens; the canary is always sent as the health daemon sends it.
    assert prepare(suite["code"], 512, 4096, rough_count).body["ignore_eos"] is True
    canary = prepare(canary_workload(), 32, 4096, rough_count, stop_at_eos=True)
    assert canary.body["ignore_eos"] is True and canary.body["n_predict"] == 32
    clipped = prepare(suite["prose-en"], 512, 300, rough_count)
    assert clipped.max_tokens < 512
    with pytest.raises(BenchError, match="does not fit"):
        prepare(suite["code"], 16, 100, rough_count)


def test_each_configuration_is_the_plan_with_its_own_speculative_flags(example: Callable[..., Path]) -> None:
    validated = validate(example("demo-draft.toml"))
    plan_argv = list(validated.plan.argv)
    assert server_argv(validated, Config.of(validated.plan.spec), 8080) == plan_argv
    other = server_argv(validated, Config(("draft-simple",), 3, 1, 0.4), 18080)
    assert other[other.index("--port") + 1] == "18080"
    assert other[other.index("--spec-draft-n-max") + 1] == "3"
    assert other[other.index("--spec-draft-n-min") + 1] == "1"
    assert other[other.index("--spec-draft-p-min") + 1] == "0.4"
    baseline = server_argv(validated, NO_SPECULATION, 18081)
    assert not [arg for arg in baseline if arg.startswith("--spec-")]
    # Everything else is the plan's: the baseline is the same server without the draft.
    without_spec = [
        a
        for i, a in enumerate(plan_argv)
        if not a.startswith("--spec-") and not (i and plan_argv[i - 1].startswith("--spec-"))
    ]
    assert baseline == [("18081" if a == "8080" else a) for a in without_spec]
    layered = server_argv(
        validated, Config(("draft-simple",), 8, 0, 0.0, draft_gpu_layers=0, draft_cache_type="q8_0"), 1
    )
    assert layered[layered.index("--spec-draft-type-k") + 1] == "q8_0"
    assert layered[layered.index("--spec-draft-type-v") + 1] == "q8_0"


def test_a_configuration_is_planned_again_and_refused_when_its_plan_has_errors(example: Callable[..., Path]) -> None:
    validated = validate(example("appliance.toml"), facts=EXAMPLE_FACTS["appliance.toml"])
    argv = server_argv(validated, Config(("draft-simple",), 6, 3, 0.0, draft_cache_type="q4_0"), 18080)
    assert argv[argv.index("--spec-draft-type-k") + 1] == "q4_0"
    # An f32 draft cache at this context does not fit beside the 27B target on 24 GB: the plan says so.
    with pytest.raises(BenchError, match=r"cache f32\): server.ctx_size: CUDA0 is over budget"):
        server_argv(validated, Config(("draft-simple",), 6, 3, 0.0, draft_cache_type="f32"), 18080)
    with pytest.raises(BenchError, match=r"models.draft.gpu_layers: .*less than or equal to 1000"):
        server_argv(validated, Config(("draft-simple",), 6, 3, 0.0, draft_gpu_layers=1001), 18080)


@pytest.mark.engine
@pytest.mark.skipif(os.geteuid() != 0 or account() is None, reason="needs root and the llm-appliance user")
def test_bench_and_tune_servers_run_as_the_service_user_and_answer_only_their_key(
    example: Callable[..., Path],
) -> None:
    """issue 36, High 5: root's bench or tune started llama-server as root, on a loopback port, with no key."""
    service = account()
    assert service is not None
    with TempServer(validate(example("demo.toml")), NO_SPECULATION) as server:
        assert server.pid is not None
        status = Path(f"/proc/{server.pid}/status").read_text()
        uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
        assert uids == [str(service.uid)] * 4  # real, effective, saved, filesystem
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        stranger = ServerApi(server.api.base_url, None, timeout=30.0)
        with pytest.raises(ServerUnreachable, match="answered 401"):
            stranger.call("/v1/chat/completions", body)
        assert server.api.call("/v1/chat/completions", body, timeout=60.0)["choices"]


def test_no_measuring_module_starts_a_process_or_writes_a_file_by_itself() -> None:
    measure = Path(__file__).resolve().parent.parent / "appliance" / "measure"
    for module in measure.glob("*.py"):
        text = module.read_text()
        assert "import subprocess" not in text and "os.replace" not in text, module.name
        assert len(text.splitlines()) <= 400, f"{module.name} is longer than one sitting"


def test_statistics_acceptance_and_mean_accepted_length() -> None:
    def sample(tps: float, draft_n: int, accepted: int, drafts: float | None) -> Sample:
        return Sample(tps, 500.0, 40.0, 30, 64, draft_n, accepted, drafts)

    result = WorkloadResult("chat", "short chat", 64, 30, n_max=8)
    result.samples = [sample(60, 56, 49, 7), sample(66, 56, 42, 7), sample(30, 56, 56, 7)]
    decode = result.decode
    assert decode is not None and decode.median == 60 and decode.low == 30 and decode.high == 66
    assert decode.spread == pytest.approx(0.3)
    assert result.acceptance == pytest.approx(147 / 168)
    assert result.mean_accepted_length == pytest.approx(1 + 147 / 21)
    result.samples = [sample(60, 56, 56, None)]  # no draft counter in /metrics: draft_n / n_max rounds
    assert result.mean_accepted_length == pytest.approx(1 + 56 / 7)
    nothing = WorkloadResult("chat", "short chat", 64, 30)
    nothing.samples = [sample(100, 0, 0, 0)]
    assert nothing.acceptance is None and nothing.mean_accepted_length is None
    assert Stats.of([]) is None


class Clock:
    """Time that moves only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_time_left_is_each_workloads_own_pace_times_what_remains() -> None:
    assert time_left({}, {"chat": 3}) is None  # nothing measured: no figure rather than a guess
    seconds = {"chat": [2.0, 4.0], "long-qa": [30.0]}
    # chat at 3 s, long-qa at 30 s, code (not measured yet) at the mean of all three: 12 s.
    assert time_left(seconds, {"chat": 2, "long-qa": 1, "code": 1}) == pytest.approx(6 + 30 + 12)
    assert time_left(seconds, {"chat": 0, "long-qa": -1}) == 0.0  # more measured than planned is not time back
    assert [duration(s) for s in (0.2, 7.4, 41, 56, 170, 3599, 3900)] == [
        "1 s",
        "8 s",
        "45 s",
        "1 min",
        "3 min",
        "1 h 00 min",
        "1 h 05 min",
    ]


def test_progress_on_a_log_is_a_line_per_measurement_with_the_count_and_the_time_left() -> None:
    stream, clock = io.StringIO(), Clock()
    progress = Progress(stream, clock=clock)
    progress.plan({"chat": 4, "long-qa": 4})
    progress.phase("starting llama-server with draft")
    clock.now += 60  # a server start is no measurement's time
    progress.phase("draft")
    for rep in (1, 2):
        for name, seconds in (("chat", 2.0), ("long-qa", 10.0)):
            clock.now += seconds
            progress.advance(name, f"{name}, rep {rep}/2", 41.25)
    progress.phase("no speculation (baseline)")
    for rep in (1, 2):
        for name, seconds in (("chat", 2.0), ("long-qa", 10.0)):
            clock.now += seconds
            progress.advance(name, f"{name}, rep {rep}/2")
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines[:3] == [
        "bench: starting llama-server with draft",
        "bench: draft",
        "bench: [1/8] chat, rep 1/2, draft: 41.2 tok/s (about 15 s left)",  # only chat measured: 7 x 2 s
    ]
    assert lines[3] == "bench: [2/8] long-qa, rep 1/2, draft: 41.2 tok/s (about 40 s left)"  # 3 x 2 s + 3 x 10 s
    assert lines[6] == "bench: no speculation (baseline)"
    assert lines[7] == "bench: [5/8] chat, rep 1/2, no speculation (baseline) (about 25 s left)"
    assert lines[-1] == "bench: [8/8] long-qa, rep 2/2, no speculation (baseline) (done in 2 min)"
    assert len(lines) == 8 + 3


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_is_a_bar_redrawn_in_place() -> None:
    stream, clock = Terminal(), Clock()
    progress = Progress(stream, clock=clock, name="tune", scope="on this server")
    progress.plan({"chat": 4})
    progress.phase("server 1, draft")
    clock.now += 3
    progress.advance("chat", "chat, rep 1/4", 50.0)
    clock.now += 3
    progress.advance("chat", "chat, rep 2/4", 52.0)
    progress.close()
    text = stream.getvalue()
    assert "\n" not in text and text.count("\r") == 4
    assert (
        "[############............] 2/4  chat, rep 2/4, server 1, draft: 52.0 tok/s (about 6 s left on this server)"
        in text
    )
    progress.plan({"chat": 4})  # tune's next server: counted afresh, at the pace already measured
    assert progress.count == 0 and progress.left() == "about 15 s left on this server"  # 4 x 3 s


def test_the_chart_is_a_png_with_a_bar_pair_per_workload(tmp_path: Path) -> None:
    path = tmp_path / "chart.png"
    rows = [("chat", 60.2, 115.0), ("code", 73.0, 111.0), ("prose-en", 70.0, None), ("long-qa", 33.0, 76.0)]
    draw_bench_chart(path, "demo.toml: decode tok/s", rows)
    width, height = png_size(path)
    assert 640 <= width <= 2000 and 300 <= height <= 1200


# Against the real llama-server -------------------------------------------------------------------


@pytest.mark.engine
def test_bench_standalone_measures_every_workload_with_and_without_speculation(
    example: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The two-model demo (SmolLM2 drafting for itself); a 1280-token context: the edit's file fits, the
    # long-context prompt is cut to fit.
    spec = example("demo-draft.toml", {"ctx_size = 4096": "ctx_size = 1280"})
    chart, baseline = tmp_path / "bench.png", tmp_path / "baseline.json"
    argv = ["bench", str(spec), "--standalone", "--reps", "2", "--tokens", "12", "--json"]
    code = cli.main([*argv, "--chart", str(chart), "--baseline", str(baseline)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "bench: no speculation (baseline)" in err  # progress on a log: a line per configuration,
    # and one per measurement: 6 workloads and the canary, twice on each side, counted to the end.
    counted = re.findall(
        r"^bench: \[\s*(\d+)/(\d+)\] (\S+), rep (\d)/2, .*?(?:: [\d.]+ tok/s)? \(([^()]*)\)$", err, re.M
    )
    assert [int(done) for done, *_ in counted] == list(range(1, 29)) and {total for _, total, *_ in counted} == {"28"}
    assert all(re.fullmatch(r"about \d+ (s|min) left", left) for *_, left in counted[:-1]), counted
    assert counted[-1][4].startswith("done in ") and counted[-1][2] == "canary"
    result = json.loads(out)
    assert result["suite"] == "suite-v2" and result["mode"] == "standalone"
    assert result["configs"]["speculative"]["type"] == "draft-simple"
    assert result["configs"]["speculative"]["n_max"] == 8
    assert result["configs"]["no_speculation"] == {"type": "none", "label": "none"}
    rows = {row["name"]: row for row in result["workloads"]}
    assert list(rows) == ["chat", "code", "edit", "prose-en", "prose-zh", "long-qa"]
    for name, row in rows.items():
        speculative, plain = row["speculative"], row["no_speculation"]
        for side in (speculative, plain):
            assert len(side["decode_tps"]["samples"]) == 2, name
            assert side["decode_tps"]["median"] > 0
            assert 1 < side["predicted_tokens"] <= 12, name  # a natural answer, capped at the tokens asked for
            assert side["ttft_ms"]["median"] > 0 and side["prompt_tps"]["median"] > 0
        # Both medians went through the JSON's rounding (3 decimals): compare within what that can move.
        ratio = speculative["decode_tps"]["median"] / plain["decode_tps"]["median"]
        assert row["speedup"] == pytest.approx(ratio, rel=1e-3, abs=1e-4)
        # SmolLM2 drafting for itself, greedy: almost every draft token is accepted.
        assert speculative["acceptance"] > 0.8, name
        assert speculative["mean_accepted_length"] > 1.5, name
        assert plain["acceptance"] is None and plain["mean_accepted_length"] is None
        # Whether speculation changed the answers is said, repetition by repetition; shown when it did.
        outputs = row["outputs"]
        assert outputs["compared"] == 2 and 0 <= outputs["matched"] <= 2, name
        assert outputs["identical"] == (outputs["matched"] == 2)
        assert ("first_difference" in outputs) != outputs["identical"], name
    # This machine's CPUs, read around every request where RAPL can be read, and said once where it cannot.
    energy = result["energy"]
    assert energy["sources"] in ([], ["rapl"]) and result["cost"] is None  # the demo states no [cost]
    if energy["sources"]:
        assert energy["speculative"]["joules_per_token"] > 0 and rows["chat"]["speculative"]["joules_per_token"] > 0
    else:
        assert set(energy["not_measured"]) == {"rapl"} and energy["speculative"]["joules"] is None
    long_qa = rows["long-qa"]["speculative"]["prompt_tokens"]
    assert 900 < long_qa <= 1280 - 12 - CHAT_MARGIN, long_qa
    assert rows["long-qa"]["no_speculation"]["prompt_tokens"] == long_qa  # the same prompt for both
    assert result["canary"]["predicted_tokens"] == 32
    assert (
        result["canary_no_speculation"]["predicted_tokens"] == 32
        and result["canary_no_speculation"]["acceptance"] is None
    )

    width, height = png_size(chart)
    assert width >= 640 and height >= 300

    written = versions.Baseline.read(baseline)  # what the health daemon reads
    assert written is not None
    assert set(written.decode_tps) == {f"workload:{n}" for n in rows} | {CANARY_BUCKET}
    assert written.decode_tps["workload:chat"] == round(rows["chat"]["speculative"]["decode_tps"]["median"], 3)
    # Beside them, the same buckets without speculation, and the context buckets the daemon sees live.
    plain_rates = json.loads(baseline.read_text())["no_speculation_tps"]
    assert plain_rates["workload:chat"] == round(rows["chat"]["no_speculation"]["decode_tps"]["median"], 3)
    assert plain_rates[CANARY_BUCKET] == round(result["canary_no_speculation"]["decode_tps"]["median"], 3)
    assert plain_rates["ctx<=1K"] > 0 and plain_rates["ctx<=2K"] > 0  # the short prompts, and long-qa
    assert set(written.versions) == {"driver", "cuda", "llama_cpp"}
    from appliance.facts.gpu import Pynvml

    found = versions.detect(Pynvml(), Path("/opt/llm-appliance/engine"))
    assert versions.drift(written.versions, found) == []  # fresh: not stale
    upgraded = versions.Found(found.driver, found.cuda, "version: 9999 (a newer llama.cpp)", found.llama_cpp_python)
    if written.versions["llama_cpp"] is not None:
        assert versions.drift(written.versions, upgraded), "a llama.cpp change must mark the baseline stale"


class Package:
    """A CPU package drawing `watts` in the kernel's powercap layout, wrapping at max_energy_range_uj. Its
    energy_uj is a FIFO: a thread computes the energy drawn up to the moment a reader opens it, so a reading
    is never stale, however long a busy machine keeps the thread waiting (it delays the reader instead)."""

    def __init__(self, root: Path, watts: float, range_uj: int, energy_uj: int) -> None:
        self.zone = root / "intel-rapl:0"
        self.zone.mkdir(parents=True)
        (self.zone / "name").write_text("package-0\n")
        (self.zone / "max_energy_range_uj").write_text(f"{range_uj}\n")
        os.mkfifo(self.zone / "energy_uj")
        self.watts, self.range_uj, self.initial_uj = watts, range_uj, energy_uj
        self.started = time.monotonic()
        self.wraps = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def drawn_uj(self) -> float:
        return self.initial_uj + self.watts * (time.monotonic() - self.started) * 1e6

    def run(self) -> None:
        fifo = self.zone / "energy_uj"
        while True:
            with fifo.open("w") as reading:  # waits for a reader
                if self.stop.is_set():
                    return
                drawn = self.drawn_uj()
                self.wraps = int(drawn // self.range_uj)
                reading.write(f"{int(drawn % self.range_uj)}\n")
            # One value per reading: wait until that reader has gone (with none left, a writer's open fails).
            while True:
                try:
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:  # ENXIO: no reader
                    break
                time.sleep(0.001)

    def close(self) -> None:
        self.stop.set()
        while self.thread.is_alive():  # be the reader it waits for, until it has seen the stop
            os.close(os.open(self.zone / "energy_uj", os.O_RDONLY | os.O_NONBLOCK))
            self.thread.join(0.01)


@pytest.mark.engine
def test_bench_reads_the_energy_around_every_request_and_prices_a_million_tokens(
    example: Callable[..., Path], tmp_path: Path
) -> None:
    cost = '\n[cost]\ncurrency = "EUR"\nprice_per_kwh = 0.30\nhardware_price = 1000.0\nlifetime_hours = 20000\n'
    spec = example("demo-draft.toml", {'labels = { appliance = "demo" }': 'labels = { appliance = "demo" }' + cost})
    # 10 W: the counter wraps 2 s into the run, then every 20 s (longer than any request, as with a real CPU).
    package = Package(tmp_path / "powercap", watts=10.0, range_uj=200_000_000, energy_uj=180_000_000)
    package.thread.start()
    try:
        result = run_bench(
            validate(spec),
            spec,
            standalone=True,
            reps=2,
            tokens=16,
            suite=load_suite().select(["chat"]),
            with_canary=False,
            energy=Energy([RaplMeter(tmp_path / "powercap")]),
        )
    finally:
        package.close()
    assert package.wraps >= 1, "the counter should have wrapped during the run"
    for side, usage in zip(("speculative", "no speculation"), result.usages().values(), strict=True):
        # 10 W over the requests' wall time, read through every wrap. A reading comes when the counter's thread
        # wakes, before each request's clock starts and after it stops: at least the wall time's energy, and on
        # a busy box up to a second more per reading pair; a wrap read wrong would be 200 J (20 s) off.
        assert 10.0 * usage.seconds <= usage.joules <= 10.0 * (usage.seconds + 2 * 1.0), side
        assert 2 < usage.tokens <= 2 * 16, side  # natural answers, at most the tokens asked for
    document = result.to_json()
    assert document["energy"]["sources"] == ["rapl"] and document["energy"]["not_measured"] == {}
    price = document["cost"]["per_million_tokens"]["no_speculation"]
    plain = result.usages()["no speculation"]
    assert plain.joules_per_token is not None and plain.seconds_per_token is not None
    assert price["electricity"] == pytest.approx(plain.joules_per_token * 1e6 / 3.6e6 * 0.30, rel=1e-3)
    assert price["depreciation"] == pytest.approx(1000.0 / (20000 * 3600) * plain.seconds_per_token * 1e6, rel=1e-3)
    table = format_table(result)
    assert re.search(
        r"energy \(rapl, over each whole request\): [0-9.]+ J/token with speculation, [0-9.]+ J/token with no spec",
        table,
    )
    assert re.search(r"  no speculation    [0-9.e-]+ electricity \+ [0-9.e-]+ depreciation = [0-9.e-]+", table), table


@pytest.fixture
def running_appliance(example: Callable[..., Path]) -> Iterator[tuple[Path, ServerApi]]:
    """The demo spec on a free port, its llama-server started from the spec's own plan: 'the running appliance'."""
    port = free_port()
    spec = example("demo-draft.toml", {"port = 8080": f"port = {port}"})
    process = subprocess.Popen(resolved(spec).argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = ServerApi(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if api.health() == 200:
                    break
            except ServerUnreachable:
                pass
            assert process.poll() is None, "the demo server exited"
            time.sleep(0.1)
        yield spec, api
    finally:
        process.terminate()
        process.wait(30)


@pytest.mark.engine
def test_bench_drives_the_running_appliance_and_starts_only_the_baseline(
    running_appliance: tuple[Path, ServerApi], capsys: pytest.CaptureFixture[str]
) -> None:
    spec, api = running_appliance
    before = api.metrics().get("tokens_predicted_total", 0.0)
    code = cli.main(
        ["bench", str(spec), "--workload", "code", "--reps", "1", "--tokens", "8", "--no-chart", "--no-baseline"]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"(the appliance at {api.base_url})" in out
    row = next(line for line in out.splitlines() if line.startswith("code "))
    assert re.search(r"\d+\.\d+x", row), row  # a measured speedup
    assert "canary" in out
    # The with-draft numbers came from the running server: it generated the workload's and the canary's tokens.
    assert api.metrics()["tokens_predicted_total"] >= before + 8 + 32


@pytest.mark.engine
def test_bench_says_so_when_no_appliance_runs(example: Callable[..., Path], capsys: pytest.CaptureFixture[str]) -> None:
    spec = example("demo.toml", {"port = 8080": f"port = {free_port()}"})
    assert cli.main(["bench", str(spec), "--no-chart", "--no-baseline"]) == EXIT_APPLY
    assert "use --standalone" in capsys.readouterr().err


def test_a_baseline_file_without_no_speculation_rates_still_reads(tmp_path: Path) -> None:
    # Written before no_speculation_tps existed: the daemon still reads its decode baselines.
    old = tmp_path / "old.json"
    old.write_text(
        json.dumps(
            {"decode_tps": {"canary": 12.5}, "versions": {"driver": None}, "measured_at": "2026-01-01T00:00:00+00:00"}
        )
    )
    read = versions.Baseline.read(old)
    assert read is not None and read.decode_tps == {"canary": 12.5} and read.no_speculation_tps == {}
    again = tmp_path / "again.json"
    again.write_text(versions.Baseline({"canary": 12.5}, {}, "now", {"canary": 30.0, "ctx<=1K": 25.0}).to_json())
    assert versions.Baseline.read(again) == versions.Baseline(
        {"canary": 12.5}, {}, "now", {"canary": 30.0, "ctx<=1K": 25.0}
    )


def test_no_speculation_rates_are_the_daemons_buckets() -> None:
    from appliance.measure.bench_report import BenchResult, Side

    def result(name: str, prompt: int | None, tokens: int, *rates: float) -> WorkloadResult:
        samples = [Sample(r, 100.0, None, prompt or 0, tokens, 0, 0, None) for r in rates]
        return WorkloadResult(name, name, tokens, prompt, samples=samples)

    plain = {
        "chat": result("chat", 40, 64, 100.0, 110.0, 90.0),  # ctx<=1K
        "code": result("code", 100, 128, 80.0),  # ctx<=1K too: the median of the two
        "long-qa": result("long-qa", 1500, 64, 50.0),  # ctx<=2K
        "silent": result("silent", 10, 8),  # nothing measured: no bucket
    }
    bench = BenchResult(
        Path("demo.toml"),
        "v1",
        "standalone",
        1,
        None,
        Side("draft", NO_SPECULATION, None, {}),
        Side("none", NO_SPECULATION, None, plain),
        None,
        "now",
    )
    assert bench.no_speculation_rates() == {
        "workload:chat": 100.0,
        "workload:code": 80.0,
        "workload:long-qa": 50.0,
        "ctx<=1K": 90.0,
        "ctx<=2K": 50.0,
    }
    bench.canary_no_speculation = result("canary", None, 32, 70.0)
    assert bench.no_speculation_rates()["canary"] == 70.0


def test_write_baseline_writes_the_no_speculation_rates_the_daemon_reads(tmp_path: Path) -> None:
    from appliance.measure.bench_report import write_baseline

    path = tmp_path / "baseline.json"
    write_baseline(path, {"ctx<=1K": 20.0}, {"measured_by": "test"}, {"ctx<=1K": 48.1234, "canary": 50.0})
    read = versions.Baseline.read(path)
    assert read is not None and read.decode_tps == {"ctx<=1K": 20.0}
    assert read.no_speculation_tps == {"ctx<=1K": 48.123, "canary": 50.0}
    write_baseline(path, {"ctx<=1K": 20.0}, {"measured_by": "test"})  # bench before it measured both sides
    again = versions.Baseline.read(path)
    assert again is not None and again.no_speculation_tps == {}
