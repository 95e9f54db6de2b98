"""Random-weight checkpoints in the HF layout, written deterministically and without downloads.

They give the engine a default model and benchmarks full-size shapes (Llama-3.1-8B, Qwen3-0.6B,
Qwen3-30B-A3B) that load in HF transformers exactly like the published checkpoints.
"""

from .default_model import default_model_dir, ensure_default_model
from .layout import parameter_count, tensor_shapes
from .presets import PRESETS
from .tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, TOKENIZER_SIZE, build_tokenizer
from .writer import GENERATOR_VERSION, resolve_preset, write_checkpoint

__all__ = [
    "CHAT_TEMPLATE", "GENERATOR_VERSION", "PRESETS", "SPECIAL_TOKENS", "TOKENIZER_SIZE", "build_tokenizer",
    "default_model_dir", "ensure_default_model", "parameter_count", "resolve_preset", "tensor_shapes",
    "write_checkpoint",
]
