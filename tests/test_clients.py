"""Clients as README points them at the appliance: the real `openai` Python SDK (what an OpenAI-compatible IDE
client sends, too) against the real demo appliance of `llm-appliance up`, with an API key: the model listed and
named by its alias, a streamed chat, a wrong key refused. And the exporter of that same `up`, scraped as
Prometheus scrapes it: no `_created` series, a unit in every help text."""

from __future__ import annotations

import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from conftest import EXAMPLES, INSTALLED_MODELS, KeyFile, start_up
from test_exporter import unit_problems
from test_health_daemon import wait_ready, wait_until
from test_launch import free_port

from appliance.facts.gguf import ModelInfo, read_model
from appliance.plan.plan import served_name
from appliance.plan.validate import validate
from appliance.spec.load import load_spec

pytestmark = pytest.mark.engine

KEY = "sk-appliance-client-5e0a"
ALIAS = "smollm2-135m-instruct"  # the demo spec's server.alias
# The first wait on anything but a model load: a check of the daemon, a request of a few tokens on a busy box.
SECONDS = 60.0


@dataclass(frozen=True)
class Demo:
    base_url: str  # what a client is given: http://HOST:PORT/v1
    exporter_port: int
    output: list[str]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, smollm2: Path, key_file: KeyFile) -> Iterator[Demo]:
    """The demo spec as shipped (its alias included), its model where the tests keep it, free ports, a key."""
    directory = tmp_path_factory.mktemp("clients")
    server_port, exporter_port = free_port(), free_port()
    text = (EXAMPLES / "demo.toml").read_text().replace(INSTALLED_MODELS, str(smollm2.parent))
    text = text.replace("port = 8080", f'port = {server_port}\napi_key_file = "{key_file(KEY)}"')
    text = text.replace("port = 9478", f"port = {exporter_port}")
    spec = directory / "demo.toml"
    spec.write_text(text)
    process, output = start_up(spec, "--state-dir", directory / "state", "--stop-timeout", "5", "--as-current-user")
    try:
        wait_ready(process, output, 1)
        yield Demo(f"http://127.0.0.1:{server_port}/v1", exporter_port, output)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def client(demo: Demo, key: str) -> openai.OpenAI:
    # No retries: a refusal must show as one, not as a slow success.
    return openai.OpenAI(base_url=demo.base_url, api_key=key, max_retries=0, timeout=SECONDS)


def test_the_openai_sdk_streams_a_chat_and_every_answer_names_the_alias(demo: Demo) -> None:
    sdk = client(demo, KEY)
    assert [model.id for model in sdk.models.list()] == [ALIAS]  # not the GGUF's path

    stream = sdk.chat.completions.create(
        model=ALIAS,
        messages=[{"role": "user", "content": "Write a Python function that adds two numbers."}],
        max_tokens=24,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    pieces = [chunk.choices[0].delta.content for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
    assert len(pieces) > 1, chunks  # streamed, not one answer at the end
    assert "".join(pieces).strip()
    assert {chunk.model for chunk in chunks} == {ALIAS}

    # The server names its model itself: a client configured with another name gets the alias back, so the
    # check above is no echo of what was sent.
    answer = sdk.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0
    )
    assert answer.model == ALIAS
    assert answer.choices[0].message.content


def test_a_wrong_key_is_refused(demo: Demo) -> None:
    sdk = client(demo, "sk-not-the-appliance-key")
    with pytest.raises(openai.AuthenticationError) as refused:
        sdk.models.list()
    assert refused.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        sdk.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "hi"}], max_tokens=4)


@pytest.mark.parametrize("accept", ["text/plain", "application/openmetrics-text; version=1.0.0"])
def test_the_running_exporter_serves_no_created_series_and_a_unit_in_every_help(demo: Demo, accept: str) -> None:
    """Prometheus asks for OpenMetrics first; a person's curl gets the text format."""
    url = f"http://127.0.0.1:{demo.exporter_port}/metrics"

    def scrape() -> str:
        request = urllib.request.Request(url, headers={"Accept": accept})
        with urllib.request.urlopen(request, timeout=5) as response:
            return str(response.read().decode())

    # After the daemon's first check: the server's counters and labelled series are in.
    wait_until(lambda: "llm_appliance_server_up 1.0" in scrape(), SECONDS, lambda: "".join(demo.output[-30:]))
    text = scrape()
    assert "_created" not in text
    assert unit_problems(text) == []


def test_the_alias_defaults_to_the_gguf_name_then_the_file_stem(smollm2: Path, tmp_path: Path) -> None:
    spec = tmp_path / "demo.toml"
    text = (EXAMPLES / "demo.toml").read_text().replace(INSTALLED_MODELS, str(smollm2.parent))
    spec.write_text(text.replace(f'alias = "{ALIAS}"', ""))
    planned = validate(spec).plan
    assert planned.alias == read_model(smollm2).metadata["general.name"] == "Smollm2 135M 8k Lc100K Mix1 Ep2"
    assert planned.argv[planned.argv.index("--alias") + 1] == planned.alias

    bare = load_spec(spec).spec
    # llama-server splits --alias at commas: a general.name with one, or none at all, gives the file's stem.
    for metadata in ({"general.name": "Qwen3, 27B"}, {"general.name": "  "}, {}):
        assert served_name(bare, ModelInfo(Path("/m/qwen3-27b-Q4_K_M.gguf"), 0, metadata, {}, ())) == "qwen3-27b-Q4_K_M"
    assert served_name(bare, ModelInfo(Path("/m/a,b.gguf"), 0, {}, {}, ())) == "a_b"
