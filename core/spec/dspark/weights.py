"""A DSpark drafter for a loaded target: its shape (chosen for the target, or read from a drafter
directory's drafter.json), built around the target's embedding and LM head, its tensors loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from ...distributed.layers import ParallelLMHead
from ..drafter import DRAFTER_CONFIG, load_drafter, save_drafter
from .model import DSparkDrafter, DSparkShape

METHOD = "dspark"


def feature_layers_for(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """``count`` target layers spread from the second to the last (DSpark reads early, middle and
    late features; fewer where the target has fewer layers)."""
    if num_layers <= count:
        return tuple(range(num_layers))
    first, last = 1, num_layers - 1
    return tuple(sorted({round(first + i * (last - first) / (count - 1)) for i in range(count)}))


def shape_for(target, block_size: int = 5, **kw) -> DSparkShape:
    """A drafter shape for ``target``: its width and vocabulary, its pad token as the mask token."""
    hf = target.config.hf
    layers = kw.pop("target_layer_ids", None) or feature_layers_for(hf["num_hidden_layers"])
    mask = hf.get("pad_token_id")
    return DSparkShape(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                       feature_size=len(layers) * target.layer_feature_size(), target_layer_ids=tuple(layers),
                       block_size=block_size, mask_token_id=mask if mask is not None else hf["vocab_size"] - 1, **kw)


def build_drafter(target, shape: DSparkShape, tensors: dict[str, torch.Tensor] | None = None,
                  dtype: torch.dtype | None = None) -> DSparkDrafter:
    """The drafter around ``target``'s embedding and LM head, on its device; ``tensors``: trained
    weights (else a fresh initialisation)."""
    device = next(target.parameters()).device
    drafter = DSparkDrafter(shape, *_vocab(target))
    if tensors is not None:
        drafter.load_state_dict(tensors)
    return drafter.to(device=device, dtype=dtype or torch.float32)


def _vocab(target) -> tuple[Callable, Callable]:
    """The target's embedding and LM head as the drafter calls them. Under tensor parallelism the
    drafter runs on the scheduling rank alone, whose collectives the other ranks would never join:
    whole copies, gathered here while every rank builds its proposer."""
    embed = target.model.embed_tokens
    if embed.group.size == 1:
        return embed, target.compute_logits
    head = next(m for m in target.modules() if isinstance(m, ParallelLMHead))
    return embed.whole(), head.whole()


def read_drafter(drafter_dir: str | Path) -> tuple[DSparkShape, dict[str, torch.Tensor]]:
    meta = json.loads((Path(drafter_dir) / DRAFTER_CONFIG).read_text())
    return DSparkShape.from_json(meta["shape"]), load_drafter(drafter_dir)


def save_dspark(out_dir: str | Path, target_dir: str | Path, drafter: DSparkDrafter, report: dict) -> Path:
    """Write ``drafter`` as a drafter directory for the checkpoint in ``target_dir``."""
    return save_drafter(out_dir, METHOD, target_dir, drafter.state_dict(), {"shape": drafter.shape.to_json(), **report})
