"""DeepSeek-V4's lightning indexer: which compressed entries each CSA query attends to.

A query scores entry s as sum_h w_h * ReLU(q_h . k_s) / sqrt(d). ReLU makes exact ties (often at 0)
common, so the top-k is a stable descending sort: among equal scores the lowest entry index wins.
This makes the choice independent of tensor shapes, hence a prefix's choices equal the full
sequence's and cached decoding equals recomputation.
"""

from __future__ import annotations

import torch

from .quant import dequantize_fp8_token_group, quantize_fp8_token_group


def index_scores(q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor) -> torch.Tensor:
    """q [S, H, d] (rotated), keys [N, d], head_weights [S, H] (already scaled) -> fp32 scores [S, N]."""
    scores = torch.relu(torch.matmul(q.float(), keys.float().transpose(-1, -2))) * q.shape[-1] ** -0.5
    return (scores * head_weights.float().unsqueeze(-1)).sum(dim=1)


def quantize_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [N, d] -> (E4M3 [N, d], fp32 scale [N]): FP8 index keys as DeepSeek keeps them, one
    scale per key (its amax / 448)."""
    data, scale = quantize_fp8_token_group(keys, group=keys.shape[-1])
    return data, scale[:, 0]


def fp8_index_scores(q: torch.Tensor, keys: torch.Tensor, key_scales: torch.Tensor,
                     head_weights: torch.Tensor) -> torch.Tensor:
    """``index_scores`` over E4M3 keys [N, d] with their fp32 scales [N]: dequantized, then scored."""
    dequantized = dequantize_fp8_token_group(keys, key_scales[:, None], group=keys.shape[-1])
    return index_scores(q, dequantized, head_weights)


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores along the last axis; ties go to the lowest index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def top_entries(scores: torch.Tensor, visible: torch.Tensor, top_k: int) -> torch.Tensor:
    """scores [S, N], visible [S] (entries 0..visible-1 are causal) -> int32 [S, min(top_k, N)]: the
    top_k best visible entries of each query by ``stable_topk``, -1 where fewer are visible."""
    n = scores.shape[-1]
    future = torch.arange(n, device=scores.device) >= visible.unsqueeze(-1)
    picks = stable_topk(scores.masked_fill(future, float("-inf")), min(top_k, n))
    return torch.where(picks < visible.unsqueeze(-1), picks, -1).to(torch.int32)
