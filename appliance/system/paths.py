"""Where the appliance lives on a machine (FHS and systemd conventions), in one place."""

from __future__ import annotations

from pathlib import Path

PREFIX = Path("/opt/llm-appliance")
VENV = PREFIX / "venv"
CLI = VENV / "bin" / "llm-appliance"
ENGINE_DIR = PREFIX / "engine"
# The router's own virtualenv (LiteLLM's proxy, pinned with hashes): apart from the appliance's, whose packages
# it would otherwise constrain.
ROUTER_VENV = PREFIX / "router"

ETC = Path("/etc/llm-appliance")
RENDERED = ETC / "rendered"
RULESET = RENDERED / "llm-appliance.nft"
ROUTER_DIR = RENDERED / "router"  # the router's config and the /ready gate it loads
# Root's, like everything in it but state/: the service user (what a compromised llama-server has) can change
# nothing that root writes or later trusts.
LIB = Path("/var/lib/llm-appliance")
STATE = LIB / "state"  # the service user's: the units' StateDirectory=, the restart history
MODELS = LIB / "models"  # root's; the service user reads them
BASELINE = LIB / "baseline.json"  # bench and tune (root) write it; the health daemon reads it
SHIPPED_RECORD = LIB / "shipped-specs.json"  # which /etc/llm-appliance/*.toml are still as shipped
SERVICE_USER = "llm-appliance"
# The router holds the upstream's key: a user of its own, so that a compromised llama-server cannot read it.
ROUTER_USER = "llm-appliance-router"
NFT_TABLE = "llm_appliance"
SERVER_UNIT = "llm-appliance-server.service"
HEALTH_UNIT = "llm-appliance-health.service"
RESTART_UNIT = "llm-appliance-restart.service"
RESTART_TIMER = "llm-appliance-restart.timer"
ROUTER_UNIT = "llm-appliance-router.service"


def engine_binary(engine_dir: Path) -> Path:
    """Where an engine tree keeps its llama-server."""
    return engine_dir / "bin" / "llama-server"
