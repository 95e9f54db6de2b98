"""Prefill/decode disaggregation settings of one engine (``engine serve --disaggregation-mode``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

MODES = ("prefill", "decode")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class DisaggConfig:
    mode: str  # "prefill" or "decode"
    transfer_backend: str = "tcp"  # a KV transport's name (`engine plugins`)
    bootstrap_port: int = 8998  # prefill: where decode engines fetch pages
    bootstrap_host: str = "127.0.0.1"  # prefill: the address that port binds
    # decode: the bootstrap hosts a request may name (the engine connects there on a client's word)
    allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS
    secret: str = ""  # shared by the prefill and decode engines: authenticates every transfer
    # seconds published pages wait to be fetched (then dropped), and a fetch waits for its room to be published
    timeout: float = 300.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"disaggregation mode must be one of {MODES}, got {self.mode!r}")
        if not 0 <= self.bootstrap_port < 2**16:
            raise ValueError(f"bootstrap_port must be in [0, 65535], got {self.bootstrap_port}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")
        object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))

    @classmethod
    def of(cls, value: DisaggConfig | dict[str, Any]) -> DisaggConfig:
        """From itself or its fields as a mapping (the JSON an engine process is started with)."""
        if isinstance(value, cls):
            return value
        known = {f.name for f in fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"unknown disaggregation settings: {sorted(unknown)}")
        return cls(**value)
