# generated from /etc/llm-appliance/demo-fallback.toml by llm-appliance 0.1.0; edit the spec and run `llm-appliance apply`, not this file
"""The router's clients' door (LiteLLM's custom_auth, named in config.yaml beside this file): a client may ask
the chat and completion routes for the local alias, and nothing else. Not the upstream's model group by name
(a private request would go straight to the cloud), not LiteLLM's own steering parameters (request fallbacks,
mock fallbacks, a model list or an api_base of its own), not an admin route. The admin (master) key is not a
client's: `llm-appliance router` makes a fresh one at each start and gives it to no one.

`llm-appliance router` sets LLM_APPLIANCE_CLIENT_KEYS (the keys of server.api_key_file, one a line; empty:
clients send none, as the server asks none) and LLM_APPLIANCE_ALIAS from router.json."""

import hmac
import os

from fastapi import HTTPException, Request
from litellm.proxy._types import UserAPIKeyAuth
from litellm.proxy.common_utils.http_parsing_utils import _read_request_body
from litellm.types.utils import all_litellm_params

ALIAS = os.environ["LLM_APPLIANCE_ALIAS"]
KEYS = tuple(key for key in os.environ.get("LLM_APPLIANCE_CLIENT_KEYS", "").split("\n") if key)
ROUTES = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions"})
# LiteLLM reads these from a request body as its own orders; a client gives none of them.
STEERING = frozenset(all_litellm_params) | {"user_config", "specific_deployment", "deployment_id"}


def _steering(name: str) -> bool:
    return name in STEERING or "fallback" in name or name.startswith("mock_")


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    route = request.url.path
    if route not in ROUTES:
        raise HTTPException(status_code=403, detail=f"{route}: clients may call {', '.join(sorted(ROUTES))} only")
    if KEYS and not any(hmac.compare_digest((api_key or "").encode(), key.encode()) for key in KEYS):
        raise HTTPException(status_code=401, detail="send one of the server's API keys (Authorization: Bearer KEY)")
    body = await _read_request_body(request)
    model = body.get("model")
    if model != ALIAS:
        raise HTTPException(status_code=403, detail=f"model {model!r}: this router serves {ALIAS!r} alone")
    refused = sorted(name for name in body if _steering(name))
    if refused:
        raise HTTPException(status_code=403, detail=f"{', '.join(refused)}: the router's own settings, not a client's")
    return UserAPIKeyAuth(models=[ALIAS])
# generated from /etc/llm-appliance/demo-fallback.toml by llm-appliance 0.1.0; edit the spec and run `llm-appliance apply`, not this file
