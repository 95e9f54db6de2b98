"""A model class for a new architecture name: a Llama decoder registered as ``DummyForCausalLM``."""

from __future__ import annotations

from engine.core.models.llama import LlamaForCausalLM


class DummyForCausalLM(LlamaForCausalLM):
    pass
