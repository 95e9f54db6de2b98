"""AMD device detection: gfx arch, CUs, memory and what the arch can do.

ROCm builds of torch drive AMD GPUs through the ``torch.cuda`` API, so torch answers the arch and
memory; hip-python, when installed, answers the CU count the way the backend's own helpers see it.
"""

from __future__ import annotations

import logging

import torch

from engine.core.platform import PlatformSpec

logger = logging.getLogger(__name__)

CAPABILITIES: dict[str, frozenset[str]] = {
    "gfx942": frozenset({"fp8"}),  # CDNA3 (MI300X, MI325X): FP8 as e4m3fnuz/e5m2fnuz
    "gfx950": frozenset({"fp8", "mxfp8"}),  # CDNA4 (MI355X): OCP FP8 and block-scaled MFMA
}


def arch_name(gcn_arch_name: str) -> str:
    """``"gfx942:sramecc+:xnack-"`` -> ``"gfx942"``: the target features do not change the ISA."""
    return gcn_arch_name.split(":", 1)[0].strip()


def capabilities(arch: str) -> frozenset[str]:
    return CAPABILITIES.get(arch, frozenset())


def hip_cu_count(device: int) -> int | None:
    """The CU count from hip-python; None when it is not installed or cannot answer (torch can)."""
    try:
        from hip import hip
    except ImportError:
        return None
    err, count = hip.hipDeviceGetAttribute(hip.hipDeviceAttribute_t.hipDeviceAttributeMultiprocessorCount, device)
    if err != hip.hipError_t.hipSuccess:
        logger.warning("hip-python CU query failed (%s); using torch.cuda", err)
        return None
    return int(count)


def detect() -> PlatformSpec | None:
    """The current ROCm device, or None unless torch is a ROCm build that sees one."""
    if not torch.version.hip or not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(device)
    free, total = torch.cuda.mem_get_info(device)
    arch = arch_name(props.gcnArchName)
    cus = hip_cu_count(device)
    return PlatformSpec(
        vendor="amd",
        arch=arch,
        device_name=props.name,
        torch_device="cuda",
        total_memory=total,
        free_memory=free,
        compute_units=props.multi_processor_count if cus is None else cus,
        capabilities=capabilities(arch),
    )
