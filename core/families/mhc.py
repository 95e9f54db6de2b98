"""mHC family: DeepSeek-V4's manifold-constrained hyper-connections around each sublayer.

n residual streams are collapsed into a sublayer's input (``pre``) and the sublayer's output is
expanded back and mixed into them (``post``); ``head`` collapses them before the final norm. The
native functions (core/native/mhc.py) define the arithmetic; a backend fuses each into a launch or
two instead of dozens of torch ops.

The model meets them at sublayer boundaries: one sublayer's ``post``, then the next one's ``pre``
(or, after the last, ``head``), whose collapse an RMSNorm then normalises (the sublayer's input
norm, or the final norm). The boundary methods take these together, so that a backend may run a
boundary in fewer launches; their defaults compose the methods above, which are all a backend must
implement.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from .norm import NormBackend


@dataclass(frozen=True)
class MixWeights:
    """One sublayer boundary's parameters: ``fn`` [(2 + n) * n, n * D] projects the RMS-normalised
    flattened streams to [pre (n) | post (n) | comb (n * n)]; ``base`` [(2 + n) * n] adds to them and
    ``scale`` [3] scales each part. For the head, ``fn`` is [n, n * D], ``base`` [n], ``scale`` [1]."""

    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor
    norm_eps: float
    hc_eps: float
    sinkhorn_iters: int = 0


class MHCBackend(ABC):
    name: str = "?"
    graph_safe: bool = True

    def __init__(self, ctx: Any) -> None:  # ctx: registry.SelectionContext
        self.ctx = ctx

    @abstractmethod
    def pre(self, streams: torch.Tensor, w: MixWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, D] -> (sublayer input [T, D] in streams' dtype, post [T, n] fp32,
        comb [T, n, n] fp32, doubly stochastic by Sinkhorn-Knopp). A model's first streams come as a
        view of one row a token expanded over the n streams (stride 0), which every method takes."""

    @abstractmethod
    def post(self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
             comb: torch.Tensor) -> torch.Tensor:
        """New streams [T, n, D]: stream i = post[i] * block_out + sum_j comb[j, i] * streams[j]."""

    @abstractmethod
    def head(self, streams: torch.Tensor, w: MixWeights) -> torch.Tensor:
        """The final collapse [T, n, D] -> [T, D] with sigmoid weights."""

    def pre_norm(self, streams: torch.Tensor, w: MixWeights, norm_weight: torch.Tensor, eps: float,
                 ops: NormBackend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``pre`` with its collapse through the RMSNorm ``norm_weight``, rounded as ``ops.rms_norm``
        rounds it: (normalised sublayer input [T, D], post, comb)."""
        x, post, comb = self.pre(streams, w)
        return ops.rms_norm(x, norm_weight, eps), post, comb

    def post_pre_norm(self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                      w: MixWeights, norm_weight: torch.Tensor, eps: float,
                      ops: NormBackend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A boundary between sublayers: ``post`` of the one before, then ``pre_norm`` of the new
        streams with the next one's ``w`` -> (new streams, the next one's input, its post, its comb)."""
        streams = self.post(block_out, streams, post, comb)
        return (streams, *self.pre_norm(streams, w, norm_weight, eps, ops))

    def post_head_norm(self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                       w: MixWeights, norm_weight: torch.Tensor, eps: float, ops: NormBackend) -> torch.Tensor:
        """The last boundary: ``post`` of the last sublayer, then ``head`` through the final RMSNorm."""
        return ops.rms_norm(self.head(self.post(block_out, streams, post, comb), w), norm_weight, eps)
