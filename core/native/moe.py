"""MoE in plain torch: routing as HF computes it, and experts run one group of tokens at a time.

Quantized experts are dequantized one used expert at a time, on every call: the plain definition
of what the fused kernels compute from the stored format.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..families.linear import FP8_BLOCKS, fp8_block_edge
from ..families.moe import ExpertWeights, MoEBackend, RoutingConfig
from .quant import dequantize_fp4, dequantize_fp8_block

SCORINGS = {
    "softmax": lambda logits: logits.softmax(dim=-1),
    "sigmoid": torch.sigmoid,
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),  # DeepSeek-V4
}
ACTIVATIONS = {"silu": F.silu}
DEQUANTIZE = {"fp8_block": lambda data, scale, dtype: dequantize_fp8_block(
                  data, scale, fp8_block_edge(tuple(data.shape), tuple(scale.shape)), dtype),
              "fp4": dequantize_fp4}


def expert_matrices(w: ExpertWeights, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``expert``'s (gate_up [2I, H], down [H, I]) in ``dtype``, dequantized from w's scheme."""
    if w.scheme == "dense":
        return w.gate_up[expert].to(dtype), w.down[expert].to(dtype)
    if w.scheme not in DEQUANTIZE:
        raise ValueError(f"expert scheme {w.scheme!r} is not supported; supported: {NativeMoE.schemes}")
    if w.gate_up_scale is None or w.down_scale is None:
        raise ValueError(f"{w.scheme!r} experts need gate_up_scale and down_scale")
    dequantize = DEQUANTIZE[w.scheme]
    return (dequantize(w.gate_up[expert], w.gate_up_scale[expert], dtype),
            dequantize(w.down[expert], w.down_scale[expert], dtype))


def _keep_best_groups(choice: torch.Tensor, cfg: RoutingConfig) -> torch.Tensor:
    """Mask (-inf) every expert outside the ``topk_groups`` best of ``num_groups`` groups.

    A group scores the sum of its two best biased scores when a correction bias is present
    (DeepSeek-V3), otherwise its best score.
    """
    grouped = choice.view(choice.shape[0], cfg.num_groups, -1)
    if cfg.correction_bias is not None:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.amax(dim=-1)
    best = group_scores.topk(cfg.topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)


def _swiglu(gate_up: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """act(gate) * up; DeepSeek-V4 first clamps gate from above and up on both sides at the limit."""
    gate, up = gate_up.chunk(2, dim=-1)
    if w.swiglu_limit is not None:
        gate = gate.clamp(max=w.swiglu_limit)
        up = up.clamp(min=-w.swiglu_limit, max=w.swiglu_limit)
    try:
        act = ACTIVATIONS[w.activation]
    except KeyError:
        raise ValueError(f"expert activation {w.activation!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    return act(gate) * up


class NativeMoE(MoEBackend):
    name = "native"
    graph_safe = False  # experts() sizes each expert's slice on the host
    schemes = ("dense", *DEQUANTIZE)
    fp8_blocks = FP8_BLOCKS

    def route(self, router_logits: torch.Tensor, cfg: RoutingConfig,
              input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores in fp32; the bias and groups only choose experts, the weights are unbiased scores;
        the shared expert's column (weight 1) comes after the top-k, outside the renormalisation."""
        try:
            scores = SCORINGS[cfg.scoring](router_logits.float())
        except KeyError:
            raise ValueError(f"scoring {cfg.scoring!r} is not supported; supported: {sorted(SCORINGS)}")
        if cfg.hash_table is not None:
            if input_ids is None:
                raise ValueError("hash routing needs the token ids")
            ids = cfg.hash_table[input_ids].long()
        else:
            choice = scores if cfg.correction_bias is None else scores + cfg.correction_bias.float()
            if cfg.num_groups > 1:
                choice = _keep_best_groups(choice, cfg)
            ids = choice.topk(cfg.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if cfg.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # the epsilon guards 0/0
        weights = (weights * cfg.routed_scaling_factor).to(cfg.weight_dtype).float()
        if cfg.shared_expert is not None:  # weight 1 is exact in any weight_dtype
            weights, ids = F.pad(weights, (0, 1), value=1.0), F.pad(ids, (0, 1), value=cfg.shared_expert)
        return weights, ids

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
        """Tokens sorted by expert, each used expert's MLP on its slice in x's dtype, then the top-k
        outputs weighted and summed in fp32 (no scatter-add, so the sum is deterministic). An id -1
        (no expert) sorts first and runs nothing: its column adds nothing."""
        num_tokens, top_k = ids.shape
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        rows = x[order // top_k]
        counts = torch.bincount(flat[flat >= 0], minlength=w.gate_up.shape[0]).tolist()
        sorted_out = torch.zeros_like(rows)
        start = flat.numel() - sum(counts)
        for expert, count in enumerate(counts):
            if count:
                seg = slice(start, start + count)
                gate_up, down = expert_matrices(w, expert, x.dtype)
                h = _swiglu(F.linear(rows[seg], gate_up), w)
                sorted_out[seg] = F.linear(h, down)
                start += count
        out = torch.empty_like(sorted_out)
        out[order] = sorted_out
        combined = (out.view(num_tokens, top_k, -1).float() * weights[..., None].float()).sum(dim=1)
        return combined.to(x.dtype)
