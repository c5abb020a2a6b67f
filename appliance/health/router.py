"""The router unit's entry point (`llm-appliance router`); beside `up` its keeper starts it (router_beside_up.py).

LiteLLM's proxy runs from its own virtualenv (paths.ROUTER_VENV) with the config and the /ready gate that
render wrote (render/render.py ROUTER_FILES). The keys reach it through its environment, read here from their
files: never through its command line, its unit or its config, and nothing logs them. Started by root (`up`'s
keeper), it becomes the router's own user once the keys are read, so the upstream's key is the router's and root's
alone.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from appliance.facts.keys import read_keys
from appliance.plan.router import ROUTER_FILE, Router, RouterFileError
from appliance.runtime.server_api import read_api_key
from appliance.runtime.server_process import die_with_parent
from appliance.system import paths
from appliance.system.users import account, drop_to

log = logging.getLogger("llm-appliance.router")
LITELLM = paths.ROUTER_VENV / "bin" / "litellm"
NO_KEY = "none"  # what LiteLLM's OpenAI provider sends to a server that asks no key (it must send one)


class RouterError(Exception):
    """The router cannot start; the message says why and what to do."""


def router_argv(router: Router, config_dir: Path, litellm: Path = LITELLM) -> list[str]:
    # One worker: the gate's and the cooldowns' state live in the process, and a 2-core box has no CPU to spare.
    host, port = router.endpoint.host, str(router.endpoint.port)
    return [
        str(litellm),
        "--config",
        str(config_dir / "config.yaml"),
        "--host",
        host,
        "--port",
        port,
        "--num_workers",
        "1",
    ]


def router_environment(router: Router, base: dict[str, str] | None = None) -> dict[str, str]:
    """The router's environment: the keys (read here, as the user this process is), the gate's /ready, and
    LiteLLM told to stay offline (its price map is bundled; it sends no telemetry)."""
    try:
        client_keys = read_keys(router.local_key_file) if router.local_key_file else []
    except OSError as exc:
        raise RouterError(f"cannot read server.api_key_file {router.local_key_file}: {exc.strerror}") from None
    local_key = client_keys[0] if client_keys else NO_KEY
    try:
        upstream_key = read_api_key(router.upstream_key_file) or NO_KEY
    except OSError as exc:
        raise RouterError(f"cannot read fallback.api_key_file {router.upstream_key_file}: {exc.strerror}") from None
    environment = dict(os.environ if base is None else base)
    environment.update(
        LLM_APPLIANCE_LOCAL_KEY=local_key,
        # Every key the server takes is a client's key of the router (client_auth.py); the admin key is fresh,
        # and no one's: a client holding the master key would be the proxy's admin, and spend the upstream's key.
        LLM_APPLIANCE_CLIENT_KEYS="\n".join(client_keys),
        LLM_APPLIANCE_ADMIN_KEY="sk-" + secrets.token_urlsafe(32),
        LLM_APPLIANCE_ALIAS=router.alias,
        LLM_APPLIANCE_UPSTREAM_KEY=upstream_key,
        LLM_APPLIANCE_READY_URL=router.ready_url,
        LLM_APPLIANCE_FALLBACK_REASONS=",".join(router.fallback_reasons),
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        LITELLM_TELEMETRY="False",
        NO_DOCS="True",
    )
    return environment


def run_router(config_dir: Path, as_current_user: bool = False) -> int:
    """Exec LiteLLM's proxy on the files render wrote into `config_dir`; it never returns but for an error."""
    try:
        router = Router.read(config_dir / ROUTER_FILE)
    except RouterFileError as exc:
        raise RouterError(str(exc)) from None
    if not LITELLM.is_file():
        raise RouterError(f"{LITELLM} is missing: `llm-appliance router-install` makes the router's virtualenv")
    environment = router_environment(router)
    if os.geteuid() == 0 and not as_current_user:
        who = account(paths.ROUTER_USER)
        if who is None:
            raise RouterError(
                f"the router's user {paths.ROUTER_USER} does not exist: `llm-appliance router-install` makes it"
            )
        drop_to(who)
        environment.update(HOME="/tmp", USER=who.name, LOGNAME=who.name)
    # Started beside `up` by its keeper (router_beside_up.py): gone with the keeper, however that ends. Set after
    # the drop, which clears it; execve keeps it.
    die_with_parent()
    argv = router_argv(router, config_dir)
    log.info("+ %s", " ".join(argv))
    os.execve(argv[0], argv, environment)
    return 1  # pragma: no cover - execve does not return
