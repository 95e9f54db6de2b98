"""A plugin shipped as its own distribution, registered the way any third party registers one.

It offers two attention backends and one model architecture:
- ``dummy-fast`` outranks every built-in backend but serves only with ``ENGINE_DUMMY_ENABLE=1``;
- ``dummy-refuses`` never serves, so a request for it must fail with its reason;
- ``DummyForCausalLM`` is a new architecture name mapped to a model class.
Implementations are imported inside ``create``, as the hook contract asks.
"""

from __future__ import annotations

import os

from engine.core.hookspecs import hookimpl
from engine.core.registry import Descriptor, SelectionContext

ENABLE_VAR = "ENGINE_DUMMY_ENABLE"
FAST_PRIORITY = 1_000_000
REFUSAL = "dummy-refuses never serves: it exists to test refusals"


def _fast_check(ctx: SelectionContext) -> list[str]:
    if os.environ.get(ENABLE_VAR) == "1":
        return []
    return [f"dummy-fast is disabled: set {ENABLE_VAR}=1 to enable it"]


def _refuse(ctx: SelectionContext) -> list[str]:
    return [REFUSAL]


def _attention(ctx: SelectionContext):
    from .attention import DummyAttention

    return DummyAttention(ctx)


def _model_class(ctx: SelectionContext):
    from .model import DummyForCausalLM

    return DummyForCausalLM


@hookimpl
def engine_register_attention_backends() -> list[Descriptor]:
    return [
        Descriptor("attention", "dummy-fast", _attention, priority=FAST_PRIORITY, check=_fast_check),
        Descriptor("attention", "dummy-refuses", _attention, priority=FAST_PRIORITY, check=_refuse),
    ]


@hookimpl
def engine_register_models() -> list[Descriptor]:
    return [Descriptor("model", "DummyForCausalLM", _model_class)]
