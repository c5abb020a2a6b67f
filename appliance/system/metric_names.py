"""The health daemon's Prometheus metrics by name, each stated once: the exporter (health/exporter.py) registers
them, and what reads them refers to them here: the alert rules (render/render.py), the dashboard
(render/dashboard.py), the fleet's rules (fleet/fleet_render.py) and `status` (ops/status.py).

Each constant is the name as it is exposed and queried, the `_total` of a counter and the `_info` of an info
included; the constant's name is the metric's, without the prefix. The names are public: alerts, dashboards and
scripts outside the appliance use them too, so one changes only with a note in the README.
"""

from __future__ import annotations

PREFIX = "llm_appliance"

# The server and its requests.
SERVER_UP = f"{PREFIX}_server_up"
SERVER_UNIT_ACTIVE = f"{PREFIX}_server_unit_active"
REQUESTS_PROCESSING = f"{PREFIX}_requests_processing"
READY = f"{PREFIX}_ready"
DRAINING = f"{PREFIX}_draining"

# Decode rates, by context bucket.
DECODE_TOKENS_PER_SECOND = f"{PREFIX}_decode_tokens_per_second"
DECODE_BASELINE_TOKENS_PER_SECOND = f"{PREFIX}_decode_baseline_tokens_per_second"
DECODE_DECAY_BREACHES = f"{PREFIX}_decode_decay_breaches"
DECODE_NO_SPECULATION_TOKENS_PER_SECOND = f"{PREFIX}_decode_no_speculation_tokens_per_second"

# What else used the machine, and the samples not judged for it.
CONTENTION_SHARE = f"{PREFIX}_contention_share"
CONTENDED = f"{PREFIX}_contended"
DECODE_CONTENDED_SAMPLES_TOTAL = f"{PREFIX}_decode_contended_samples_total"
CANARY_RUNS_TOTAL = f"{PREFIX}_canary_runs_total"

# Speculation.
DRAFT_CONFIGURED = f"{PREFIX}_draft_configured"  # the Python side calls the fact draft_in_use
SPECULATION_CONFIGURED = f"{PREFIX}_speculation_configured"
SPECULATION_ENGAGED = f"{PREFIX}_speculation_engaged"
SPECULATION_ACCEPTANCE_RATIO = f"{PREFIX}_speculation_acceptance_ratio"
SPECULATION_SPEEDUP = f"{PREFIX}_speculation_speedup"
SPECULATION_DRAFTED_TOKENS_TOTAL = f"{PREFIX}_speculation_drafted_tokens_total"
SPECULATION_ACCEPTED_TOKENS_TOTAL = f"{PREFIX}_speculation_accepted_tokens_total"

# GPU memory, by device, and the server's share of it.
GPU_MEMORY_TOTAL_BYTES = f"{PREFIX}_gpu_memory_total_bytes"
GPU_MEMORY_USED_BYTES = f"{PREFIX}_gpu_memory_used_bytes"
GPU_MEMORY_FREE_BYTES = f"{PREFIX}_gpu_memory_free_bytes"
GPU_VISIBLE = f"{PREFIX}_gpu_visible"
GPU_XID_ERRORS_TOTAL = f"{PREFIX}_gpu_xid_errors_total"
SERVER_VRAM_BYTES = f"{PREFIX}_server_vram_bytes"
SERVER_VRAM_BASELINE_BYTES = f"{PREFIX}_server_vram_baseline_bytes"
SERVER_VRAM_CREEP_RATIO = f"{PREFIX}_server_vram_creep_ratio"
SERVER_ON_GPU = f"{PREFIX}_server_on_gpu"

# Versions.
VERSION_INFO = f"{PREFIX}_version_info"
VERSION_MISMATCH = f"{PREFIX}_version_mismatch"
VERSION_DRIFT = f"{PREFIX}_version_drift"
ENGINE_REGRESSION = f"{PREFIX}_engine_regression_ratio"

# Restarts.
RESTARTS_TOTAL = f"{PREFIX}_restarts_total"
LAST_RESTART_TIMESTAMP_SECONDS = f"{PREFIX}_last_restart_timestamp_seconds"
RESTART_BUDGET_EXHAUSTED = f"{PREFIX}_restart_budget_exhausted"
RESTART_PENDING = f"{PREFIX}_restart_pending"
EVICTIONS_TOTAL = f"{PREFIX}_evictions_total"  # [fleet] turns = "eviction": the cluster's answers

# The fleet, as this host's daemon sees it.
FLEET_PEERS_READY = f"{PREFIX}_fleet_peers_ready"
FLEET_DECAY = f"{PREFIX}_fleet_decay"

# Energy, by source.
ENERGY_JOULES_TOTAL = f"{PREFIX}_energy_joules_total"
ENERGY_PER_TOKEN_JOULES = f"{PREFIX}_energy_per_token_joules"

# The daemon itself.
CHECK_DURATION_SECONDS = f"{PREFIX}_check_duration_seconds"
PROBE_ERRORS_TOTAL = f"{PREFIX}_probe_errors_total"

# The router's ([fallback]), LiteLLM's own names: answers by backend, the label model_id "local" or "fallback".
ROUTER_ANSWERS_TOTAL = "litellm_deployment_success_responses_total"
ROUTER_FAILURES_TOTAL = "litellm_deployment_failure_responses_total"
