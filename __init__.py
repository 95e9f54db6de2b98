"""engine: a multi-vendor LLM inference and serving engine.

``from engine import LLM, SamplingParams`` is the offline API, shaped like vLLM's. The names are
resolved lazily so that importing a submodule (a plugin, the CLI) does not pull in the engine.
"""

from importlib import import_module

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]

_EXPORTS = {
    "LLM": "engine.core.llm",
    "SamplingParams": "engine.core.sampling_params",
    "RequestOutput": "engine.core.outputs",
    "CompletionOutput": "engine.core.outputs",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
