"""Manifold-constrained hyper-connections (DeepSeek-V4): n residual streams mixed around each block.

Each sublayer computes from its n input streams a collapse weight ``pre`` [n], an expand weight
``post`` [n] and a stream-mixing matrix ``comb`` [n, n] made doubly stochastic by Sinkhorn-Knopp.
All mixing coefficients are fp32, in HF transformers' order of operations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..families.mhc import MHCBackend, MixWeights
from .norm import unweighted_rms_norm


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., n, n] -> doubly stochastic: row softmax, then alternate column and row normalisation,
    ending on a column normalisation (``iters`` column steps in all)."""
    comb = logits.softmax(dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
           hc_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, n, D] -> (block input [T, D] in streams' dtype, post [T, n], comb [T, n, n]).

    ``fn`` [(2 + n) * n, n * D] projects the RMS-normalised flattened streams to the mixes laid out
    as [pre (n) | post (n) | comb (n * n)]; ``base`` adds to them and ``scale`` [3] scales each part.
    """
    n = streams.shape[1]
    flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), norm_eps)
    mixes = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = sinkhorn(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), sinkhorn_iters, hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return collapsed, post, comb


def hc_post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams [T, n, D]: stream i gets post[i] * block_out + sum_j comb[j, i] * streams[j]."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                 streams)


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
            hc_eps: float) -> torch.Tensor:
    """The final collapse [T, n, D] -> [T, D] with sigmoid weights from an [n, n * D] projection."""
    flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class NativeMHC(MHCBackend):
    name = "native"

    def pre(self, streams: torch.Tensor, w: MixWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return hc_pre(streams, w.fn, w.base, w.scale, w.norm_eps, w.hc_eps, w.sinkhorn_iters)

    def post(self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
             comb: torch.Tensor) -> torch.Tensor:
        return hc_post(block_out, streams, post, comb)

    def head(self, streams: torch.Tensor, w: MixWeights) -> torch.Tensor:
        return hc_head(streams, w.fn, w.base, w.scale, w.norm_eps, w.hc_eps)
