"""Mooncake's distributed store as a storage tier (L3). The plugin registers Mooncake's KV
transport too (mooncake_kv.py).

Records (core/tiers/record.py: header and bytes, checked against the key they are found under)
are put and got by content key in a Mooncake store (``pip install 'engine[mooncake]'``, or
``mooncake-transfer-engine`` on a CUDA host;
a ``mooncake_master`` running), configured by mooncake_settings.py's settings (the master's address
among them). The store evicts by its own policy, so the tier deletes only a bad record
(``reject``); a read the store fails is a counted miss. Refused, with the reason, where the package
is missing or no master is named.
"""

from __future__ import annotations

import importlib.util
import logging

from ..core.families.cache_tier import CacheTier, TierPage
from ..core.hookspecs import hookimpl
from ..core.registry import Descriptor
from ..core.tiers.record import decode, encode
from .mooncake_kv import engine_register_kv_transports  # noqa: F401  (the mooncake KV transport: one plugin)
from .mooncake_settings import mooncake_settings

logger = logging.getLogger(__name__)

def mooncake_reasons(ctx) -> list[str]:
    reasons = []
    if importlib.util.find_spec("mooncake") is None:
        reasons.append("the mooncake store is not installed (pip install 'engine[mooncake]', or "
                       "mooncake-transfer-engine on a CUDA host)")
    if not mooncake_settings(ctx)["master_server_address"]:
        reasons.append('no Mooncake master: plugin_options {"mooncake": {"master_server_address": "HOST:PORT"}} '
                       "or MOONCAKE_MASTER")
    return reasons


class MooncakeTier(CacheTier):
    name = "mooncake"

    def __init__(self, ctx) -> None:
        from mooncake.store import MooncakeDistributedStore

        super().__init__(ctx)
        s = mooncake_settings(ctx)
        self.store = MooncakeDistributedStore()
        code = self.store.setup(s["local_hostname"], s["metadata_server"], int(s["global_segment_size"]),
                                int(s["local_buffer_size"]), s["protocol"], s["device_name"],
                                s["master_server_address"])
        if code:
            raise RuntimeError(f"Mooncake store setup failed with code {code} (master {s['master_server_address']})")

    def put(self, pages: list[TierPage]) -> list[bool]:
        done = []
        for p in pages:
            try:
                done.append(self.store.is_exist(p.key) == 1 or self.store.put(p.key, b"".join(encode(p))) == 0)
            except Exception as exc:  # an unreachable store: logged and counted by the caller, serving goes on
                self.last_error = f"put of {p.key}: {exc}"
                done.append(False)
        return done

    def get(self, keys: list[str]) -> list[TierPage | None]:
        out: list[TierPage | None] = []
        for k in keys:
            try:
                raw = self.store.get(k)
            except Exception as exc:  # an unreachable store: a counted miss, serving goes on
                self._read_failed(f"get of {k}: {exc}")
                raw = None
            if not raw:
                out.append(None)
                continue
            try:
                out.append(decode(k, bytearray(raw)))  # the one copy: the store hands back bytes
            except ValueError as exc:
                self.rejected += 1
                logger.warning("hierarchical cache: Mooncake's %s is not a record of its key (%s); a miss, removed",
                               k, exc)
                self.reject(k)
                out.append(None)
        return out

    def contains(self, keys: list[str]) -> int:
        for i, k in enumerate(keys):
            try:
                held = self.store.is_exist(k) == 1
            except Exception as exc:
                self._read_failed(f"is_exist of {k}: {exc}")
                held = False
            if not held:
                return i
        return len(keys)

    def reject(self, key: str) -> None:
        try:
            self.store.remove(key)
        except Exception as exc:
            self.last_error = f"remove of {key}: {exc}"


@hookimpl
def engine_register_cache_tiers() -> list[Descriptor]:
    return [Descriptor("cache_tier", "mooncake", lambda ctx: MooncakeTier(ctx), check=mooncake_reasons)]
