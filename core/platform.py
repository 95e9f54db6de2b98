"""What the process runs on. Exactly one platform plugin claims the machine; CPU is the fallback."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PlatformSpec:
    """The device a process drives, as detected by a platform plugin.

    ``vendor`` is "cpu", "nvidia" or "amd"; ``arch`` is "cpu", "sm_90", "sm_100", "gfx942", ...;
    ``torch_device`` is what tensors are placed on ("cpu" or "cuda", which ROCm torch also uses).
    """

    vendor: str
    arch: str
    device_name: str
    torch_device: str
    total_memory: int = 0
    free_memory: int = 0
    compute_units: int = 0
    capabilities: frozenset[str] = field(default_factory=frozenset)

    def summary(self) -> str:
        mem = f", {self.total_memory / 2**30:.1f} GiB" if self.total_memory else ""
        cu = f", {self.compute_units} compute units" if self.compute_units else ""
        return f"{self.vendor} {self.arch} ({self.device_name}{mem}{cu})"
