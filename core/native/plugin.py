"""The torch-native backend as a plugin: the CPU backend and the oracle of every faster one.

Registered through the ``engine.plugins`` entry point like any third-party plugin. Priorities
are low, so a device backend that can serve wins; ``--attention-backend native`` still picks it.
"""

from __future__ import annotations

from importlib import import_module

from ..hookspecs import hookimpl
from ..registry import Descriptor

NATIVE_PRIORITY = 0

MODELS = {
    "LlamaForCausalLM": "engine.core.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "engine.core.models.llama:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "engine.core.models.qwen3_moe:Qwen3MoeForCausalLM",
    "DeepseekV4ForCausalLM": "engine.core.models.deepseek_v4.model:DeepseekV4ForCausalLM",
}


def _load(path: str):
    module, _, attr = path.partition(":")
    return getattr(import_module(module), attr)


def _instance(path: str):
    return lambda ctx: _load(path)(ctx)


def _class(path: str):
    return lambda ctx: _load(path)


@hookimpl
def engine_register_attention_backends() -> list[Descriptor]:
    return [Descriptor("attention", "native", _instance("engine.core.native.attention:NativeAttention"),
                       priority=NATIVE_PRIORITY)]


@hookimpl
def engine_register_v4_attention_backends() -> list[Descriptor]:
    return [Descriptor("v4_attention", "native", _instance("engine.core.native.v4_attention:NativeV4Attention"),
                       priority=NATIVE_PRIORITY)]


@hookimpl
def engine_register_mhc_backends() -> list[Descriptor]:
    return [Descriptor("mhc", "native", _instance("engine.core.native.mhc:NativeMHC"), priority=NATIVE_PRIORITY)]


@hookimpl
def engine_register_moe_backends() -> list[Descriptor]:
    return [Descriptor("moe", "native", _instance("engine.core.native.moe:NativeMoE"), priority=NATIVE_PRIORITY)]


@hookimpl
def engine_register_linear_backends() -> list[Descriptor]:
    return [Descriptor("linear", "native", _instance("engine.core.native.linear:NativeLinear"),
                       priority=NATIVE_PRIORITY)]


@hookimpl
def engine_register_models() -> list[Descriptor]:
    return [Descriptor("model", arch, _class(path)) for arch, path in MODELS.items()]

