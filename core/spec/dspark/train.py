"""Training a DSpark drafter for a checkpoint from text (``engine train-drafter --method dspark``),
as DeepSpec trains one: the target frozen; per window of text its features at the drafter's
layers and its logits at every position; blocks anchored at random positions of each window, each
reading the features before its anchor only (the mask the proposer's blocks see); per block slot
``k`` the drafter's logits ``U_k + B(x_{k-1})`` with the true previous token (teacher forcing).

The loss, DeepSpec's: cross-entropy against the text's tokens, weighted ``exp(-k / 4)`` (later
slots count less: they are reached less often), ``0.1``; the L1 distance between the drafter's and
the target's distributions, the same weights, ``0.9`` (one minus half of it is the probability
that the target keeps the draft); the confidence head's binary cross-entropy against that
probability, ``1.0``.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
import torch.nn.functional as F

from ..train_drafter import FrozenTarget, TrainReport, fit, held_out_acceptance, report
from .model import DSparkDrafter
from .weights import METHOD, build_drafter, save_dspark, shape_for

DECAY = 4.0
CE, L1, CONFIDENCE = 0.1, 0.9, 1.0
REUSE = 4  # drafter steps per batch of the target's outputs, each with anchors drawn afresh (DeepSpec caches them)


def anchored_mask(anchors: torch.Tensor, seq_len: int, block: int) -> torch.Tensor:
    """[N, A * block, seq_len + A * block]: a block's rows see the context before its anchor and
    every row of their own block."""
    n, a = anchors.shape
    rows = torch.arange(a * block, device=anchors.device) // block  # each query's block
    ctx = torch.arange(seq_len, device=anchors.device) < anchors.repeat_interleave(block, 1).unsqueeze(-1)
    own = (rows.unsqueeze(1) == rows.unsqueeze(0)).expand(n, -1, -1)
    return torch.cat([ctx, own], 2)


def block_loss(drafter: DSparkDrafter, tokens: torch.Tensor, features: torch.Tensor, target_logits: torch.Tensor,
               anchors: torch.Tensor) -> torch.Tensor:
    """The loss of blocks at ``anchors`` [N, A] over windows ``tokens`` [N, L] with the target's
    ``features`` [N, L, F] and ``target_logits`` [N, L, V]; anchors leave ``block_size`` tokens after them."""
    s = drafter.shape
    n, length = tokens.shape
    b = s.block_size
    offsets = torch.arange(b, device=tokens.device)
    at = (anchors.unsqueeze(-1) + offsets).flatten(1)  # [N, A * B] each row's position
    ids = torch.where(offsets.repeat(anchors.shape[1]) == 0, tokens.gather(1, at), s.mask_token_id)
    context = drafter.context_kv(features, torch.arange(length, device=tokens.device).expand(n, -1))
    hidden = drafter.backbone(ids, at, context, anchored_mask(anchors, length, b))
    prev = tokens.gather(1, at)  # x_{k-1}: the anchor, then the text's tokens
    labels = tokens.gather(1, at + 1)
    logits = drafter.base_logits(hidden) + drafter.markov(prev)
    aligned = target_logits.gather(1, at.unsqueeze(-1).expand(-1, -1, target_logits.shape[-1]))
    weight = torch.exp(-offsets.float() / DECAY).repeat(anchors.shape[1]).expand(n, -1)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(n, -1)
    l1 = (logits.softmax(-1) - aligned.softmax(-1)).abs().sum(-1)
    kept = (1 - 0.5 * l1).clamp(0, 1).detach()
    conf = F.binary_cross_entropy_with_logits(drafter.confidence_logit(hidden, prev), kept, reduction="none")
    total = weight.sum()
    return (CE * (ce * weight).sum() + L1 * (l1 * weight).sum() + CONFIDENCE * (conf * weight).sum()) / total


def train_dspark(model: str, files: list[str], out: str, steps: int = 300, seq_len: int = 128, batch: int = 4,
                 lr: float = 2e-3, max_tokens: int = 2_000_000, seed: int = 0, eval_file: str | None = None,
                 num_speculative_tokens: int = 5, progress: bool = True, block_size: int = 5,
                 anchors: int = 16, seconds: float | None = None) -> TrainReport:
    target = FrozenTarget(model, files, seq_len, batch, max_tokens, seed, progress)
    shape = shape_for(target.model, block_size=max(block_size, num_speculative_tokens))
    drafter = build_drafter(target.model, shape).train()
    gen = torch.Generator().manual_seed(seed)
    outputs: list = []  # the target's on the current windows, and how many steps they served

    def loss_of() -> torch.Tensor:
        if not outputs or outputs[-1] == REUSE:
            windows = target.windows()
            hidden, features = target.run(windows, shape.target_layer_ids)
            with torch.inference_mode():
                logits = target.model.compute_logits(hidden)
            outputs[:] = [torch.tensor(windows, device=hidden.device), features["layers"].clone().view(batch, seq_len, -1),
                          logits.clone().view(batch, seq_len, -1), 0]
        tokens, features, logits, used = outputs
        outputs[-1] = used + 1
        picks = torch.rand(batch, seq_len - shape.block_size - 1, generator=gen).argsort(1)[:, :anchors] + 1
        return block_loss(drafter, tokens, features, logits, picks.sort(1).values.to(tokens.device))

    losses, seconds = fit(list(drafter.parameters()), loss_of, steps, lr, "training the DSpark drafter", progress,
                           seconds)
    result = report(losses, seconds, target)
    save_dspark(out, model, drafter, asdict(result))
    if eval_file is not None:
        result.acceptance_length = held_out_acceptance(model, METHOD, out, eval_file, num_speculative_tokens, seed)
        result.num_speculative_tokens = num_speculative_tokens
        save_dspark(out, model, drafter, asdict(result))
    return result
