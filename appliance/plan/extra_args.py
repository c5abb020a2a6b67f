"""What `server.extra_args` may carry: llama-server flags whose meaning is known and harmless to the appliance
(performance, sampling, chat format, logging to the journal), none of the switches that open the server to its
clients or to the network, and any other only where the spec marks it (`server.extra_args_unchecked`).

An allow-list, not a deny-list: every llama.cpp release adds switches, and a new one (a tool, a proxy, a
downloader) must not pass because nobody has listed it yet. Pure.
"""

from __future__ import annotations

from appliance.facts.dialect import REMOVED, SPELLINGS, SYNTHETIC_PREFIX, Dialect
from appliance.spec.model import Server
from appliance.spec.problems import Problem, error, warning

_TOOL_CALLS = "exec_shell_command, write_file and read_file run as the service user on a client's word"
_TOOLS = f"opens POST /tools to every API client (every local user, where no key is set): {_TOOL_CALLS}"
_DOWNLOAD = (
    "fetches model files from the internet when the server starts: the appliance serves the model files the spec "
    "names (models.*.path), which validate checks, and nothing else"
)
_SECRET = "puts a secret on the command line: in /proc/PID/cmdline, the journal and the snapshot, for every local user"

# Refused whatever the spec says: each opens the server to its clients, the network or the disk.
REFUSED: dict[str, str] = {
    "--tools": _TOOLS,
    "--tools-runtime": f"runs the built-in tools of --tools for API clients: {_TOOL_CALLS}",
    "--agent": "turns on the CORS proxy and every built-in tool: " + _TOOLS,
    "-ag": "turns on the CORS proxy and every built-in tool: " + _TOOLS,
    "--mcp-servers-config": "connects the server to MCP servers whose tools API clients may then call",
    "--mcp-servers-json": "connects the server to MCP servers whose tools API clients may then call",
    "--ui-mcp-proxy": "makes the server an HTTP fetcher for its clients: it dials any URL a client names (SSRF), "
    "past network.egress and network.private",
    "--webui-mcp-proxy": "makes the server an HTTP fetcher for its clients: it dials any URL a client names (SSRF), "
    "past network.egress and network.private",
    "--props": "lets every API client rewrite the server's settings (POST /props)",
    "--slot-save-path": "lets API clients write the prompts' KV cache to disk (POST /slots?action=save): private "
    "prompts outlive their request, and another client may restore them",
    "--log-prompts-dir": "writes every prompt to disk",
    "--log-file": "writes the server's log, prompts among it at verbose levels, beside the journal where its rights "
    "and retention do not hold",
    "--lookup-cache-dynamic": "writes n-grams of what the server generated to disk",
    "-lcd": "writes n-grams of what the server generated to disk",
    "--media-path": "lets API clients have the server read local files (file:// media)",
    "--path": "serves a directory's files to every client",
    "--rpc": "sends the model's work, the prompts' tensors with it, to other machines",
    "--reuse-port": "lets another process bind the API port beside the server and receive its requests and keys",
    "--cors-credentials": "a browser would send a page of the CORS origin its credentials for the API",
    "--video-ffmpeg-dir": "runs ffmpeg and ffprobe from a directory the spec names",
    "--models-dir": "turns llama-server into a router that starts servers for other model files",
    "--models-preset": "turns llama-server into a router that starts servers for other model files",
    "--hf-token": _SECRET,
    "-hft": _SECRET,
    "--api-key": "puts the API key on the command line: in /proc/PID/cmdline, the journal and the snapshot",
    "--api-key-file": "in extra_args hides the key file from the health daemon and the scrape job",
    **dict.fromkeys(
        (
            "--model-url",
            "-mu",
            "--hf-repo",
            "-hf",
            "-hfr",
            "--hf-file",
            "-hff",
            "--docker-repo",
            "-dr",
            "--mmproj-url",
            "-mmu",
            "--spec-draft-hf",
            "-hfd",
            "-hfrd",
            "--hf-repo-draft",
        ),
        _DOWNLOAD,
    ),
}
# The fix of a refused flag, where the spec has a field for what it wanted.
REFUSED_FIX = {
    "--api-key": "set server.api_key_file instead",
    "--api-key-file": "set server.api_key_file instead",
    "--hf-token": "download the model before, and name it in models.target.path",
    "-hft": "download the model before, and name it in models.target.path",
}
# The presets that pick a model on Hugging Face ("note: can download weights from the internet").
DOWNLOAD_SUFFIXES = ("-default", "-spec")

# Known to change only how the server computes, samples, formats chats and logs to the journal, by topic.
_KNOWN_GROUPS = (
    # threads, CPUs, context and KV cache, RoPE, offloading, the model's tensors
    "-tb --threads-batch -C --cpu-mask -Cr --cpu-range --cpu-strict --prio --poll -Cb --cpu-mask-batch -Crb "
    "--cpu-range-batch --cpu-strict-batch --prio-batch --poll-batch -n --predict --n-predict --keep --swa-full "
    "--perf --no-perf -e --escape --no-escape --rope-scaling --rope-scale --rope-freq-base --rope-freq-scale "
    "--yarn-orig-ctx --yarn-ext-factor --yarn-attn-factor --yarn-beta-slow --yarn-beta-fast -kvo --kv-offload "
    "-nkvo --no-kv-offload --repack -nr --no-repack --no-host -dt --defrag-thold -lzm --lazy-mode --numa -ot "
    "--override-tensor -cmoe --cpu-moe -ncmoe --n-cpu-moe -ncffn --n-cpu-ffn -sm --split-mode -ts --tensor-split "
    "-mg --main-gpu -fitt --fit-target -fitc --fit-ctx --check-tensors --override-kv --op-offload --no-op-offload",
    # logging, to the journal
    "-v --verbose --log-verbose --log-colors --log-prefix --no-log-prefix --log-timestamps --no-log-timestamps",
    # sampling and constrained output
    "--samplers --sampler-seq --sampling-seq --ignore-eos --top-nsigma --top-n-sigma --xtc-probability "
    "--xtc-threshold --typical --typical-p --repeat-last-n --presence-penalty --frequency-penalty --dry-multiplier "
    "--dry-base --dry-allowed-length --dry-penalty-last-n --dry-sequence-breaker --adaptive-target --adaptive-decay "
    "--dynatemp-range --dynatemp-exp --mirostat --mirostat-lr --mirostat-ent -l --logit-bias --grammar "
    "--grammar-file -j --json-schema -jf --json-schema-file -bs --backend-sampling",
    # the draft's threads, CPUs and tensors
    "--spec-draft-threads -td --threads-draft --spec-draft-threads-batch -tbd --threads-batch-draft "
    "--spec-draft-cpu-mask -Cd --cpu-mask-draft --spec-draft-cpu-range -Crd --cpu-range-draft "
    "--spec-draft-cpu-strict --cpu-strict-draft --spec-draft-prio --prio-draft --spec-draft-poll --poll-draft "
    "--spec-draft-cpu-mask-batch -Cbd --cpu-mask-batch-draft --spec-draft-cpu-strict-batch --cpu-strict-batch-draft "
    "--spec-draft-prio-batch --prio-batch-draft --spec-draft-poll-batch --poll-batch-draft "
    "--spec-draft-override-tensor -otd --override-tensor-draft --spec-draft-cpu-moe -cmoed --cpu-moe-draft "
    "--spec-draft-n-cpu-moe --spec-draft-ncmoe -ncmoed --n-cpu-moe-draft --spec-draft-p-split --draft-p-split "
    "--spec-draft-backend-sampling --no-spec-draft-backend-sampling",
    # the server's slots, caches, batching, multimodal limits and timeouts
    "-lcs --lookup-cache-static --kv-unified-per-slot -ctxcp --ctx-checkpoints --swa-checkpoints -cms "
    "--checkpoint-min-step -cram --cache-ram -kvu --kv-unified -no-kvu --no-kv-unified --cache-idle-slots "
    "--no-cache-idle-slots --context-shift --no-context-shift -r --reverse-prompt -sp --special --warmup "
    "--no-warmup --spm-infill -cb --cont-batching -nocb --no-cont-batching --no-mmproj --mmproj-offload "
    "--no-mmproj-offload --image-min-tokens --image-max-tokens --mtmd-batch-max-tokens --video-fps "
    "--video-timestamp-interval --tags -to --timeout --sse-ping-interval --threads-http --cache-prompt "
    "--no-cache-prompt --cache-reuse -sps --slot-prompt-similarity",
    # the chat template and reasoning
    "--jinja --no-jinja --reasoning-format -rea --reasoning --reasoning-effort --reasoning-budget "
    "--reasoning-budget-message --reasoning-preserve --no-reasoning-preserve --chat-template --chat-template-file "
    "--chat-template-kwargs --skip-chat-parsing --no-skip-chat-parsing --prefill-assistant --no-prefill-assistant",
    # what only turns something off
    "--no-ui --no-webui -no-ag --no-agent --no-ui-mcp-proxy --no-webui-mcp-proxy",
)
KNOWN = frozenset(flag for group in _KNOWN_GROUPS for flag in group.split())
UNCHECKED_FIELD = "server.extra_args_unchecked"


def refusal(name: str) -> str | None:
    """Why `name` may never be passed, or None."""
    if name in REFUSED:
        return REFUSED[name]
    if name.startswith("--") and name.endswith(DOWNLOAD_SUFFIXES) and name != "--spec-default":
        return _DOWNLOAD
    return None


def extra_arg_problems(server: Server, planned: list[str], dialect: Dialect) -> list[Problem]:
    """Each flag of server.extra_args: not refused, one the binary has, not one the spec sets, and known to be
    harmless or marked in server.extra_args_unchecked."""
    found = []
    planned_options = {SPELLING_OWNER.get(arg) for arg in planned if arg.startswith("-")} - {None}
    for index, arg in enumerate(server.extra_args):
        name = arg.split("=", 1)[0]
        # A value (or a negative number): the flag before it was judged. A value that looks like a flag is
        # judged as one, so no switch hides behind another's value.
        if not name.startswith("-") or _is_number(name):
            continue
        where = f"server.extra_args[{index}]"
        reason = refusal(name)
        if name.startswith(SYNTHETIC_PREFIX):
            found.append(
                error(
                    where,
                    f"{name} is benchmark-only: it fakes acceptance (drafts accepted at a chosen rate), so every "
                    "speed and acceptance measured with it is fiction",
                    "remove it; `llm-appliance bench` measures real acceptance",
                )
            )
        elif reason is not None:
            marked = name in server.extra_args_unchecked
            fix = REFUSED_FIX.get(name, "remove it") + (f" ({UNCHECKED_FIELD} does not accept it)" if marked else "")
            found.append(error(where, f"{name} {reason}", fix))
        elif name in REMOVED and not dialect.accepts(name):
            found.append(
                error(where, f"{name} was removed from llama-server", f"set {REMOVED[name]} in the spec instead")
            )
        elif not dialect.accepts(name):
            found.append(
                error(
                    where,
                    f"{name} is not a flag of {dialect.source}",
                    "check `llama-server --help` of the installed binary",
                )
            )
        elif SPELLING_OWNER.get(name) in planned_options:
            found.append(
                error(
                    where,
                    f"{name} is already set from the spec",
                    f"set it through the spec field for {SPELLING_OWNER[name]} instead",
                )
            )
        elif name not in KNOWN and name not in SPELLING_OWNER and name not in server.extra_args_unchecked:
            found.append(
                error(
                    where,
                    f"llm-appliance does not know what {name} does, so it cannot tell whether it opens the server to "
                    "its clients or the network",
                    f'read `llama-server --help`; if {name} is harmless, mark it: {UNCHECKED_FIELD} = ["{name}"]',
                )
            )
    passed = {arg.split("=", 1)[0] for arg in server.extra_args}
    for index, name in enumerate(server.extra_args_unchecked):
        if name not in passed:
            found.append(
                warning(
                    f"{UNCHECKED_FIELD}[{index}]",
                    f"lists {name}, which server.extra_args does not pass: it does nothing",
                    f"remove it, or add {name} to server.extra_args",
                )
            )
    return found


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


SPELLING_OWNER = {spelling: option for option, spellings in SPELLINGS.items() for spelling in spellings}
