"""The DSpark drafter (DeepSeek's DeepSpec): a block of ``block_size`` drafts in one pass, then a
light sequential head that makes each draft depend on the one before it.

1. The **parallel block drafter**: the block is the anchor (the sequence's last token, whose
   target features are not known yet) followed by ``block_size - 1`` mask tokens, at the positions
   after the context. Its layers' queries attend to the *context*, the target's hidden states
   taken from ``target_layer_ids`` (concatenated, projected by ``fc``), at positions before the
   anchor, and to every position of their own block. The context's keys and values depend on the
   target's features only, never on the block, so a sequence's are computed once per position
   (``context_kv``) and kept. Slot ``k``'s output ``h_k`` predicts the token ``k + 1`` after the
   anchor, through the target's LM head: ``U_k``.
2. The **sequential low-rank Markov head**: ``p_k(v) ∝ exp(U_k(v) + B(x_{k-1}, v))`` with
   ``B = W2 · W1[x_{k-1}]`` (rank ``markov_rank``), ``x_{-1}`` the anchor: drafting runs the
   block once, then ``block_size`` cheap steps, each reading the draft before.
3. The **confidence head** ``c_k = σ(wᵀ[h_k; W1[x_{k-1}]])``: the probability that draft ``k`` is
   kept given those before it were, from which the verify length is chosen (verify_length.py).

The target's token embedding and LM head are the drafter's (passed in, not kept in its tensors).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DSparkShape:
    vocab_size: int
    hidden_size: int  # the target's: the drafter reads its embeddings and feeds its LM head
    feature_size: int  # the width of one position's target features (all chosen layers together)
    target_layer_ids: tuple[int, ...]
    block_size: int = 5
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    markov_rank: int = 64
    mask_token_id: int = 0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def to_json(self) -> dict:
        return {**asdict(self), "target_layer_ids": list(self.target_layer_ids)}

    @classmethod
    def from_json(cls, d: dict) -> DSparkShape:
        return cls(**{**d, "target_layer_ids": tuple(d["target_layer_ids"])})

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (halves rotated) of ``x`` [..., n, heads, dim] at ``positions`` [..., n]."""
    half = x.shape[-1] // 2
    freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = positions.to(torch.float32).unsqueeze(-1) * freq  # [..., n, half]
    cos, sin = angle.cos().unsqueeze(-2), angle.sin().unsqueeze(-2)
    a, b = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1).to(x.dtype)


class BlockLayer(nn.Module):
    """One drafter layer: attention of the block's queries over [context; block], then a SwiGLU MLP."""

    def __init__(self, s: DSparkShape) -> None:
        super().__init__()
        d, h, kvh, hd = s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim
        self.s = s
        self.input_norm = nn.RMSNorm(d, eps=s.rms_norm_eps)
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, kvh * hd, bias=False)
        self.v_proj = nn.Linear(d, kvh * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=s.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=s.rms_norm_eps)
        self.post_norm = nn.RMSNorm(d, eps=s.rms_norm_eps)
        self.gate_up = nn.Linear(d, 2 * s.intermediate_size, bias=False)
        self.down = nn.Linear(s.intermediate_size, d, bias=False)

    def kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, roped) and values [..., n, kv heads, head dim] of inputs ``x`` [..., n, d]."""
        shape = (*x.shape[:-1], self.s.num_kv_heads, self.s.head_dim)
        k = rope(self.k_norm(self.k_proj(x).view(shape)), positions, self.s.rope_theta)
        return k, self.v_proj(x).view(shape)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """``x`` [N, Q, d] the block rows at ``positions`` [N, Q]; ``ctx_k``/``ctx_v`` [N, C, kvh, hd];
        ``mask`` [N, Q, C + Q], True where a query may attend."""
        s = self.s
        h = self.input_norm(x)
        q = rope(self.q_norm(self.q_proj(h).view(*h.shape[:-1], s.num_heads, s.head_dim)), positions, s.rope_theta)
        k, v = self.kv(h, positions)
        k, v = torch.cat([ctx_k, k], 1), torch.cat([ctx_v, v], 1)
        rep = s.num_heads // s.num_kv_heads
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(rep, 1),
                                             v.transpose(1, 2).repeat_interleave(rep, 1), attn_mask=mask.unsqueeze(1))
        x = x + self.o_proj(out.transpose(1, 2).reshape(*x.shape[:-1], -1))
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class BlockDrafter(nn.Module):
    """What every DSpark drafter shares: the block of the anchor and mask tokens, the Markov head
    (``markov_w1``, ``markov_w2``), the confidence head (``confidence``) and greedy drafting. A drafter
    gives ``shape``, ``context_kv`` and ``backbone``, and the target's LM head as ``_target[1]``."""

    shape: DSparkShape
    # its layers are split over the attention's processes as the target's are (every forward a
    # collective they all run), rather than whole on the process that drafts
    split = False

    def block(self, anchors: torch.Tensor, anchor_positions: torch.Tensor,
              context: list[tuple[torch.Tensor, torch.Tensor]], context_valid: torch.Tensor) -> torch.Tensor:
        """One block per sequence: ``anchors`` [N] at ``anchor_positions`` [N] over its context
        (``context_valid`` [N, C]: which context rows are its own); outputs [N, block_size, d]."""
        n, b = anchors.shape[0], self.shape.block_size
        ids = torch.full((n, b), self.shape.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[:, 0] = anchors
        positions = anchor_positions.unsqueeze(1) + torch.arange(b, device=anchors.device)
        inside = torch.ones(n, b, b, dtype=torch.bool, device=anchors.device)
        mask = torch.cat([context_valid.unsqueeze(1).expand(n, b, -1), inside], 2)
        return self.backbone(ids, positions, context, mask)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``U_k``: the block's logits through the target's LM head, before the Markov term."""
        return self._target[1](hidden).float()

    def markov(self, prev: torch.Tensor) -> torch.Tensor:
        """``B(x_{k-1}, ·)`` [..., vocab] of previous tokens ``prev``."""
        return self.markov_w2(self.markov_w1(prev)).float()

    def confidence_logit(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The confidence head's logit [...] from ``h_k`` and ``W1[x_{k-1}]``."""
        w1 = self.markov_w1(prev).to(hidden.dtype)
        return self.confidence(torch.cat([hidden, w1], -1)).squeeze(-1).float()

    def draft(self, hidden: torch.Tensor, anchors: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy drafts [N, k] from block outputs ``hidden`` [N, >= k, d], each after the one before
        (the anchor before the first), and each draft's confidence in [0, 1] [N, k]."""
        base = self.base_logits(hidden[:, :k])
        prev, tokens, conf = anchors, [], []
        for j in range(k):
            conf.append(torch.sigmoid(self.confidence_logit(hidden[:, j], prev)))
            prev = (base[:, j] + self.markov(prev)).argmax(-1)
            tokens.append(prev)
        return torch.stack(tokens, 1), torch.stack(conf, 1)


class DSparkDrafter(BlockDrafter):
    def __init__(self, shape: DSparkShape, embed: Callable[[torch.Tensor], torch.Tensor],
                 lm_head: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        s = self.shape = shape
        if s.num_heads % s.num_kv_heads:
            raise ValueError(f"num_heads {s.num_heads} is not a multiple of num_kv_heads {s.num_kv_heads}")
        self.fc = nn.Linear(s.feature_size, s.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(s.hidden_size, eps=s.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(s) for _ in range(s.num_layers))
        self.norm = nn.RMSNorm(s.hidden_size, eps=s.rms_norm_eps)
        self.markov_w1 = nn.Embedding(s.vocab_size, s.markov_rank)
        self.markov_w2 = nn.Linear(s.markov_rank, s.vocab_size, bias=False)
        self.confidence = nn.Linear(s.hidden_size + s.markov_rank, 1)
        self._target = (embed, lm_head)  # the target's: not the drafter's tensors

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer the keys and values [..., n, kvh, hd] of context positions from the target's
        ``features`` [..., n, feature_size] there."""
        ctx = self.hidden_norm(self.fc(features))
        return [layer.kv(ctx, positions) for layer in self.layers]

    def backbone(self, ids: torch.Tensor, positions: torch.Tensor, context: list[tuple[torch.Tensor, torch.Tensor]],
                 mask: torch.Tensor) -> torch.Tensor:
        """The block rows' outputs [N, Q, d]: ``ids`` [N, Q] (anchors and mask tokens) at
        ``positions``, over ``context`` (context_kv's, [N, C, ...]); ``mask`` [N, Q, C + Q]."""
        x = self._target[0](ids)
        for layer, (k, v) in zip(self.layers, context):
            x = layer(x, positions, k, v, mask)
        return self.norm(x)
