"""Where the Triton E4M3 quantization differs from torch's on this device: the first few elements.

    python benchmarks/fp8_quant_diag.py
"""

import torch

from engine.backends.triton.fp8_quant import quantize_fp8_token_group
from engine.core.native import quant

for dtype in (torch.float32, torch.bfloat16):
    x = (torch.randn(4096, 4096, device="cuda") * torch.exp(4 * torch.rand(4096, 1, device="cuda") - 2)).to(dtype)
    d, s = quantize_fp8_token_group(x)
    rd, rs = quant.quantize_fp8_token_group(x)
    bad = (d.view(torch.uint8) != rd.view(torch.uint8)).nonzero()
    print(dtype, "scales equal:", torch.equal(s, rs), "mismatches:", len(bad), "of", d.numel())
    for r, c in bad[:8].tolist():
        y = x[r, c].float() / rs[r, c // 128]
        print(f"  x={x[r, c].item()!r} scale={rs[r, c // 128].item()!r} x/scale={y.item()!r} ours={d[r, c].float().item()} "
              f"(0x{d[r, c].view(torch.uint8).item():02x}) torch={rd[r, c].float().item()} (0x{rd[r, c].view(torch.uint8).item():02x})")
