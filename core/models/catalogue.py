"""The built-in model architectures, registered by the core itself whatever plugins are selected.

Models are written against the family interfaces, not against a backend, so they belong to no
backend plugin: ``ENGINE_PLUGINS=cuda`` still serves every architecture here. Third parties add
theirs through the same hook from their own plugin.
"""

from __future__ import annotations

from ..hookspecs import hookimpl
from ..registry import Descriptor, import_path

ARCHITECTURES = {
    "LlamaForCausalLM": "engine.core.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "engine.core.models.llama:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "engine.core.models.qwen3_moe:Qwen3MoeForCausalLM",
    "DeepseekV4ForCausalLM": "engine.core.models.deepseek_v4.model:DeepseekV4ForCausalLM",
}
"""HF architecture string (``config.json`` ``architectures[0]``) -> its class, imported on selection."""


def _model_class(path: str):
    return lambda ctx: import_path(path)


@hookimpl
def engine_register_models() -> list[Descriptor]:
    return [Descriptor("model", arch, _model_class(path)) for arch, path in ARCHITECTURES.items()]
