"""Programmatic dependent launch (PDL): a decode kernel starts while the kernel before it drains.

A batch-1 decode step is a chain of about ten small kernels a layer, and between two of them the
GPU idles while the first one's last blocks finish and the next one's blocks are launched. On
Hopper and later a kernel launched with ``launch_pdl`` may begin as soon as every block of the one
before it has signalled (``griddepcontrol.launch_dependents``); it then blocks in
``griddepcontrol.wait`` until that kernel has finished and its memory is visible. CUDA graphs keep
the relation as a programmatic edge, so replays overlap the same way.

The rule that keeps it correct: a kernel launched this way calls ``wait_for_prior`` before it
reads or writes any memory another kernel touches. Waiting for the kernel before is waiting for
all before it, since that one waited too. The decode-path kernels take part (GEMV, norms,
RoPE + KV store, decode attention, SiLU-and-mul), and the FP8 and MoE ones a decode step of a
quantized or MoE model runs; every other launch is ordered as usual. ``ENGINE_PDL=0`` turns it
off (to measure what it gives).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_OPTIONS: dict[torch.device, dict[str, bool]] = {}


def launch_options(device: torch.device) -> dict[str, bool]:
    """The keywords of a launch on ``device``: the kernel's ``PDL`` constexpr and, where the device
    and triton support it, ``launch_pdl``."""
    options = _OPTIONS.get(device)
    if options is None:
        options = _OPTIONS[device] = {"PDL": True, "launch_pdl": True} if supported(device) else {"PDL": False}
    return options


def supported(device: torch.device) -> bool:
    """CUDA sm_90 or later, a triton that launches with the attribute, and not switched off."""
    if device.type != "cuda" or getattr(torch.version, "hip", None) or os.environ.get("ENGINE_PDL", "1") == "0":
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and torch.cuda.get_device_capability(device)[0] >= 9


def reset() -> None:
    """Forget the per-device answers (after ``ENGINE_PDL`` changes)."""
    _OPTIONS.clear()


@triton.jit
def wait_for_prior(PDL: tl.constexpr):
    """Under PDL: wait until the kernel before has finished, then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
