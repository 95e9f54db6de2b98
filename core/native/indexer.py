"""DeepSeek-V4's lightning indexer: which compressed entries each CSA query attends to.

A query scores entry s as sum_h w_h * ReLU(q_h . k_s) / sqrt(d). ReLU makes exact ties (often at 0)
common, so the top-k is a stable descending sort: among equal scores the lowest entry index wins.
This makes the choice independent of tensor shapes, hence a prefix's choices equal the full
sequence's and cached decoding equals recomputation. DeepSeek-V4.1 adds a first level: a candidate
source keeps, per query, the blocks of entries with the best scores, and later indexers take their
top-k inside them.
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


def top_entries(scores: torch.Tensor, visible: torch.Tensor, top_k: int,
                allowed: torch.Tensor | None = None) -> torch.Tensor:
    """scores [S, N], visible [S] (entries 0..visible-1 are causal) -> int32 [S, min(top_k, N)]: the
    top_k best visible entries of each query by ``stable_topk``, -1 where fewer are visible.
    ``allowed`` [S, N] bool (the candidate filter's blocks): only those entries count."""
    n = scores.shape[-1]
    out = torch.arange(n, device=scores.device) >= visible.unsqueeze(-1)
    if allowed is not None:
        out |= ~allowed
    picks = stable_topk(scores.masked_fill(out, float("-inf")), min(top_k, n))
    return torch.where(out.gather(-1, picks), -1, picks).to(torch.int32)


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """DeepSeek-V4.1's candidate filter, level one: scores [S, N], visible [S] -> int32 [S, num_blocks],
    the blocks of ``block_size`` entries whose best visible score is highest, the block of each
    query's newest visible entry always kept, ties to the lowest block, -1 where fewer blocks hold
    a visible entry."""
    n = scores.shape[-1]
    blocks = -(-n // block_size)
    if not blocks:
        return torch.full((scores.shape[0], num_blocks), -1, dtype=torch.int32, device=scores.device)
    future = torch.arange(n, device=scores.device) >= visible.unsqueeze(-1)
    padded = torch.full((scores.shape[0], blocks * block_size), float("-inf"), device=scores.device)
    padded[:, :n] = scores.float().masked_fill(future, float("-inf"))
    best = padded.view(-1, blocks, block_size).amax(-1)
    newest = ((visible - 1) // block_size).unsqueeze(-1)
    best = best.masked_fill((torch.arange(blocks, device=scores.device) == newest) & (visible > 0).unsqueeze(-1),
                            float("inf"))
    top = stable_topk(best, min(num_blocks, blocks))
    chosen = torch.where(best.gather(-1, top) > float("-inf"), top, -1).to(torch.int32)
    return torch.nn.functional.pad(chosen, (0, num_blocks - chosen.shape[-1]), value=-1)


def in_blocks(blocks: torch.Tensor, num_entries: int, block_size: int) -> torch.Tensor:
    """blocks [S, B] int (-1: none) -> bool [S, num_entries]: the entries those blocks hold."""
    per_block = torch.zeros(blocks.shape[0], -(-num_entries // block_size) + 1, dtype=torch.bool,
                            device=blocks.device)
    per_block.scatter_(1, torch.where(blocks < 0, per_block.shape[1] - 1, blocks.long()), True)
    return per_block[:, torch.arange(num_entries, device=blocks.device) // block_size]
