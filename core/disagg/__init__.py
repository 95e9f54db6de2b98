"""Prefill/decode disaggregation: prefill and decode on separate engines, the prompt's KV moved
between them by a KV transport (core/families/kv_transport.py), driven by SGLang's gateway."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..engine import EngineCore


def engine_class(config: EngineConfig) -> type[EngineCore]:
    """The engine core for a config: a prefill or decode engine, or the colocated one."""
    mode = config.disaggregation.mode if config.disaggregation is not None else None
    if mode == "prefill":
        from .prefill import PrefillEngine
        return PrefillEngine
    if mode == "decode":
        from .decode import DecodeEngine
        return DecodeEngine
    from ..engine import EngineCore
    return EngineCore
