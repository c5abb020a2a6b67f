"""The llama-server command line in the installed binary's own flag dialect, with `server.extra_args` checked
against it, against what the spec already sets and against what the appliance knows to be safe
(plan/extra_args.py). Pure."""

from __future__ import annotations

from appliance.facts.dialect import SPELLINGS, Dialect
from appliance.plan.extra_args import extra_arg_problems
from appliance.spec.base import LogLevel
from appliance.spec.model import Spec
from appliance.spec.problems import Problem, error, warning
from appliance.spec.speculative import Speculative


class _Argv:
    def __init__(self, binary: str, dialect: Dialect) -> None:
        self.args = [binary]
        self.problems: list[Problem] = []
        self.dialect = dialect

    def flag(self, option: str, field_path: str, *values: str, required: bool = True) -> None:
        spelling = self.dialect.spelling(option)
        if spelling is not None:
            self.args.extend([spelling, *values])
        elif required:
            self.problems.append(
                error(
                    field_path,
                    f"{self.dialect.source} accepts none of {', '.join(SPELLINGS[option])}",
                    "install the llama.cpp this release builds: llm-appliance engine install",
                )
            )


# llama-server's --log-verbosity thresholds (common/log.h LOG_LEVEL_*): a message is printed when its level's
# number is at most the threshold.
LOG_VERBOSITY: dict[LogLevel, int] = {"error": 1, "warning": 2, "info": 3, "trace": 4, "debug": 5}


def build_argv(
    spec: Spec, dialect: Dialect, binary: str, draft_in_use: bool, alias: str, engine_args: tuple[str, ...] = ()
) -> tuple[tuple[str, ...], list[Problem]]:
    """The llama-server command line in the binary's own dialect, grouped: serving, model, draft, then the
    flags of the engine's rung on this machine (`engine_args`, from its proof: never the user's to type).
    `alias` is the model's name in the API, resolved by the plan (the spec's, else the target's own)."""
    argv = _Argv(binary, dialect)
    _serving_flags(argv, spec)
    _model_flags(argv, spec, alias)
    _speculative_flags(argv, spec, draft_in_use)
    argv.args.extend(engine_args)
    problems = argv.problems + extra_arg_problems(spec.server, argv.args, dialect)
    return (*argv.args, *spec.server.extra_args), problems


def _serving_flags(argv: _Argv, spec: Spec) -> None:
    flag, server = argv.flag, spec.server
    flag("host", "server.host", server.host)
    flag("port", "server.port", str(server.port))
    if server.api_key_file is not None:
        flag("api_key_file", "server.api_key_file", str(server.api_key_file))
    flag("metrics", "server")
    flag("slots", "server", required=False)
    _cors_flags(argv, spec)
    flag("offline", "server", required=False)  # no model fetching at run time
    flag("fit", "memory", "off", required=False)  # the memory plan is ours, not an automatic refit
    _log_flags(argv, spec)


def _log_flags(argv: _Argv, spec: Spec) -> None:
    """What llama-server writes to the journal. At its default (info) every request adds about eight lines
    (slot selection, five timing lines, release), so a day of traffic buries its warnings and errors; the
    launcher logs start, ready, speculation, stop and failures itself. Binaries without -lv log at their default."""
    argv.flag("log_verbosity", "server.log_level", str(LOG_VERBOSITY[spec.server.log_level]), required=False)
    # journald stamps every line; llama-server's own stamps count minutes since its start.
    argv.flag("no_log_timestamps", "server.log_level", required=False)


def _cors_flags(argv: _Argv, spec: Spec) -> None:
    """Which web pages a browser lets read the API: llama-server's default reflects every Origin, with
    credentials. It sends --cors-origins verbatim as Access-Control-Allow-Origin, so an empty value grants no
    one. Credentials stay off: the API key is a header a page sets itself, and no cookie is involved."""
    origins = spec.server.cors_origins
    if argv.dialect.spelling("cors_origins") is None and not origins:
        argv.problems.append(
            warning(
                "server.cors_origins",
                f"{argv.dialect.source} has no --cors-origins, so it cannot be told which web pages may read the "
                "API: llama-server's default grants every origin, so any page open in a browser on a client can",
                "install the llama.cpp this release builds (llm-appliance engine install), or set api_key_file",
            )
        )
        return
    argv.flag("cors_origins", "server.cors_origins", ",".join(origins))
    argv.flag("no_cors_credentials", "server.cors_origins", required=False)


def _model_flags(argv: _Argv, spec: Spec, alias: str) -> None:
    flag, server, target = argv.flag, spec.server, spec.models.target
    flag("model", "models.target.path", str(target.path))
    flag("alias", "server.alias", alias)
    flag("ctx_size", "server.ctx_size", str(server.ctx_size))
    flag("parallel", "server.parallel", str(server.parallel))
    if server.threads:
        flag("threads", "server.threads", str(server.threads))
    flag("batch_size", "server.batch_size", str(server.batch_size))
    flag("ubatch_size", "server.ubatch_size", str(server.ubatch_size))
    flag("flash_attn", "server.flash_attn", server.flash_attn)
    if argv.dialect.spelling("load_mode"):
        flag("load_mode", "server.load_mode", server.load_mode)
    elif server.load_mode in ("mlock", "mmap+mlock"):
        flag("mlock", "server.load_mode")
    elif server.load_mode == "none":
        flag("no_mmap", "server.load_mode")
    if target.devices:
        flag("device", "models.target.devices", ",".join(target.devices))
    flag("gpu_layers", "models.target.gpu_layers", str(target.gpu_layers))
    flag("cache_type_k", "models.target.cache_type_k", target.cache_type_k)
    flag("cache_type_v", "models.target.cache_type_v", target.cache_type_v)
    sampling = server.sampling
    flag("temperature", "server.sampling.temperature", f"{sampling.temperature:g}")
    flag("top_p", "server.sampling.top_p", f"{sampling.top_p:g}")
    flag("top_k", "server.sampling.top_k", str(sampling.top_k))
    flag("min_p", "server.sampling.min_p", f"{sampling.min_p:g}")
    flag("repeat_penalty", "server.sampling.repeat_penalty", f"{sampling.repeat_penalty:g}")
    if sampling.seed is not None:
        flag("seed", "server.sampling.seed", str(sampling.seed))


def _speculative_flags(argv: _Argv, spec: Spec, draft_in_use: bool) -> None:
    speculative = spec.speculative
    if not _types_known(argv, speculative):
        return
    drafting = draft_in_use and spec.models.draft is not None
    # A draft-* type without its draft model has nothing to draft with (spec/checks.py warns); the rest need none.
    types = [name for name in speculative.types if drafting or not name.startswith("draft-")]
    if types:
        # Without --spec-type current llama-server loads the draft and never drafts. Binaries older than
        # --spec-type drafted with the draft model alone.
        argv.flag("spec_type", "speculative.type", ",".join(types), required=types != ["draft-simple"])
    if drafting:
        _draft_flags(argv, spec)
    for table, values in speculative.ngram_tables().items():
        if table.replace("_", "-") in types:  # one for a type not used does nothing (spec/checks.py warns)
            for parameter, value in values.model_dump(exclude_none=True).items():
                argv.flag(f"spec_{table}_{parameter}", f"speculative.{table}.{parameter}", str(value))


def _types_known(argv: _Argv, speculative: Speculative) -> bool:
    """Every type is one the binary lists (a binary that lists none is judged by its flags alone)."""
    listed = argv.dialect.spec_types
    unknown = [name for name in speculative.types if listed and name not in listed]
    for name in unknown:
        argv.problems.append(
            error(
                "speculative.type",
                f"{argv.dialect.source} has no speculation type {name!r}; it lists {', '.join(sorted(listed))}",
                'use those names; several as a list, e.g. type = ["draft-simple", "ngram-mod"]',
            )
        )
    return not unknown


def _draft_flags(argv: _Argv, spec: Spec) -> None:
    flag, draft, speculative = argv.flag, spec.models.draft, spec.speculative
    assert draft is not None
    flag("draft_model", "models.draft.path", str(draft.path))
    flag("draft_n_max", "speculative.n_max", str(speculative.n_max))
    flag("draft_n_min", "speculative.n_min", str(speculative.n_min))
    flag("draft_p_min", "speculative.p_min", f"{speculative.p_min:g}")
    if draft.devices:
        flag("draft_device", "models.draft.devices", ",".join(draft.devices))
    flag("draft_gpu_layers", "models.draft.gpu_layers", str(draft.gpu_layers))
    # Binaries older than -ctkd/-ctvd (llama.cpp PR 13782, mid 2025) always gave the draft an f16 cache.
    flag("draft_cache_type_k", "models.draft.cache_type_k", draft.cache_type_k, required=draft.cache_type_k != "f16")
    flag("draft_cache_type_v", "models.draft.cache_type_v", draft.cache_type_v, required=draft.cache_type_v != "f16")
