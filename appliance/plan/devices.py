"""Which devices each model runs on, and whether the draft is in use: the rules every floor above asks."""

from __future__ import annotations

from appliance.facts.gguf import ModelInfo
from appliance.spec.model import Model, Spec


def draft_in_use(spec: Spec) -> bool:
    """A draft model is configured and one of the speculative types drafts with it."""
    return spec.models.draft is not None and bool(spec.speculative.draft_types)


def gpu_devices(model: Model) -> list[str]:
    return [d for d in model.devices if d != "none"] if model.gpu_layers != 0 else []


def draft_devices(spec: Spec) -> list[str]:
    # llama.cpp: the draft follows --device unless --spec-draft-device is given.
    draft = spec.models.draft
    if draft is None:
        return []
    return gpu_devices(draft) if draft.devices else gpu_devices(spec.models.target)


def offloaded_layers(model: Model, info: ModelInfo, devices: list[str]) -> int:
    """How many layers llama.cpp puts on the GPUs the model runs on (`devices`: gpu_devices(target), or
    draft_devices(spec), which a draft without devices of its own takes from the target); n_layer + 1 means
    the output layer too."""
    if not devices:
        return 0
    if model.gpu_layers in ("all", "auto"):
        return info.block_count + 1
    assert isinstance(model.gpu_layers, int)
    return min(model.gpu_layers, info.block_count + 1)


def first_gpu_layer(info: ModelInfo, layers_on_gpu: int) -> int:
    """llama-model.cpp load_tensors: of N offloaded layers the first is the output layer, then the last N-1
    blocks; a block's KV cache and recurrent state follow it (model.dev_layer(il))."""
    return max(0, info.block_count + 1 - layers_on_gpu) if layers_on_gpu > 0 else info.block_count + 1
