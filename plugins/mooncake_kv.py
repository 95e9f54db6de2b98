"""The ``mooncake`` KV transport (``--disaggregation-transfer-backend mooncake``): pages moved by
Mooncake's Transfer Engine.

The Transfer Engine (``pip install 'engine[mooncake]'``) moves bytes between registered memory of
two engines over TCP on any machine, and over RDMA where the hardware has it. The control plane and
the staging are core/native/kv_staged.py's: the prefill engine registers its staged pages with its
Transfer Engine and answers with the engine's session address (``hostname:rpc port``, Mooncake's
P2P handshake finds the rest); the decode engine reads the pages with one synchronous Mooncake
read into a registered buffer of its own. Configured by the settings the ``mooncake`` storage tier
reads (plugins/mooncake_settings.py: ``plugin_options["mooncake"]`` or the MOONCAKE_* environment):
``local_hostname`` (the name peers reach this engine by), ``metadata_server`` ("P2PHANDSHAKE"),
``protocol`` ("tcp"; "rdma" with ``device_name``). Refused, with the reason, where the package is
missing or its engine does not load. Registered by the ``mooncake`` plugin (plugins/mooncake.py
imports its hook).
"""

from __future__ import annotations

import importlib
import importlib.util

from ..core.hookspecs import hookimpl
from ..core.native.kv_staged import StagedTransport
from ..core.registry import Descriptor
from .mooncake_settings import mooncake_settings


def mooncake_kv_reasons(ctx) -> list[str]:
    if importlib.util.find_spec("mooncake") is None:
        return ["the mooncake package is not installed (pip install 'engine[mooncake]')"]
    try:
        importlib.import_module("mooncake.engine")  # its shared libraries load (libibverbs at least)
    except ImportError as exc:
        return [f"Mooncake's Transfer Engine does not load here: {exc}"]
    return []


class MooncakeTransport(StagedTransport):
    name, library = "mooncake", "Mooncake"
    max_metadata = 1024  # a session address

    def __init__(self, ctx) -> None:
        from mooncake.engine import TransferEngine

        s = mooncake_settings(ctx)
        self.engine = TransferEngine()
        code = self.engine.initialize(s["local_hostname"], s["metadata_server"], s["protocol"], s["device_name"])
        if code:
            raise RuntimeError(f"Mooncake's Transfer Engine did not start (code {code}): protocol {s['protocol']} "
                               f"on {s['local_hostname']}, metadata server {s['metadata_server']}")
        self.session = f"{s['local_hostname']}:{self.engine.get_rpc_port()}".encode()
        super().__init__(ctx)

    def _register(self, buffer) -> int:
        address = buffer.data_ptr()
        code = self.engine.register_memory(address, buffer.numel())
        if code:
            raise RuntimeError(f"Mooncake refused to register {buffer.numel()} bytes (code {code})")
        return address

    def _expose(self, staged) -> tuple[bytes, int]:
        return self.session, self._register(staged)

    def _withdraw(self, exposed: int) -> None:
        self.engine.unregister_memory(exposed)

    def _read(self, metadata: bytes, address: int, buffer, total: int) -> None:
        """One synchronous Mooncake read of ``total`` bytes at ``address`` of the session ``metadata``."""
        local = self._register(buffer)
        try:
            code = self.engine.transfer_sync_read(metadata.decode(), local, address, total)
            if code:
                raise ConnectionError(f"the Mooncake read of {total} bytes from {metadata.decode()} failed "
                                      f"(code {code})")
        finally:
            self.engine.unregister_memory(local)


@hookimpl
def engine_register_kv_transports() -> list[Descriptor]:
    return [Descriptor("kv_transport", "mooncake", MooncakeTransport, check=mooncake_kv_reasons)]
