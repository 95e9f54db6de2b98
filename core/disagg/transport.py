"""The KV transport a prefill or decode engine uses, chosen through the kv_transport family."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..families.kv_transport import KVTransport
from ..registry import SelectionContext

if TYPE_CHECKING:
    from ..engine import EngineCore


def create_transport(engine: EngineCore) -> KVTransport:
    """The transport ``--disaggregation-transfer-backend`` names, or a clear error listing them all."""
    c = engine.components
    ctx = SelectionContext(platform=c.platform, model_config=c.model_config, engine_config=engine.config)
    return c.plugins.select("kv_transport", ctx, engine.config.disaggregation.transfer_backend).create(ctx)
