"""Training DeepSeek-V4's next-n layer for a checkpoint from text (``engine train-drafter --method
mtp``): the target frozen, its residual streams as the layer's input, the layer trained to predict
the token after next, written as a drafter directory (drafter.py) the MTP proposer loads.

Text files are tokenized and cut into windows of ``seq_len`` tokens; each step runs the target over
a batch of windows (no gradients) for its streams, then the layer over the same positions, on a
KV cache of its own made for the step, and takes the cross-entropy of its logits (through the
target's LM head) against the token after next. Where the checkpoint has no next-n layer the
layer starts from the target's last sliding-attention MoE block, random projections and the
target's mHC head. The held-out report runs the engine with the trained layer drafting over
prompts of an evaluation text and reads its mean acceptance length.
"""

from __future__ import annotations

import re
from dataclasses import asdict

import torch

from ..loader import iter_checkpoint
from .train_drafter import PAGE, FrozenTarget, TrainReport, fit, held_out_acceptance, report, step_batch

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.*)$")
_HEAD = re.compile(r"^(?:model\.hc_head\.hc_|hc_head_)(fn|base|scale)$")


def initial_nextn(target, seed: int) -> dict[str, torch.Tensor]:
    """Next-n tensors to start from: the checkpoint's own, else its last sliding-attention MoE
    block, random e_proj/h_proj (std 0.02), unit norms and the target's mHC head."""
    if target.mtp:
        return dict(target.mtp)
    hf = target.config.hf
    from ..models.deepseek_v4.model import _normalised
    from ..models.deepseek_v4.attention import SLIDING

    norm = _normalised(hf)
    candidates = [i for i, (t, m) in enumerate(zip(norm["layer_types"], norm["mlp_layer_types"]))
                  if t == SLIDING and m == "moe"]
    if not candidates:
        raise ValueError("the checkpoint has no sliding-attention MoE layer to start a next-n layer from")
    source = candidates[-1]
    out: dict[str, torch.Tensor] = {}
    for name, tensor in iter_checkpoint(target.config.path, progress=False):
        if (m := _LAYER.match(name)) and int(m[1]) == source:
            out[f"mtp.0.{m[2]}"] = tensor.float().clone()
        elif m := _HEAD.match(name):
            out[f"mtp.0.hc_head_{m[1]}"] = tensor.float().clone()
    g = torch.Generator().manual_seed(seed)
    d = hf["hidden_size"]
    out.update({f"mtp.0.{n}.weight": torch.randn(d, d, generator=g) * 0.02 for n in ("e_proj", "h_proj")})
    out.update({f"mtp.0.{n}.weight": torch.ones(d) for n in ("enorm", "hnorm", "norm")})
    return out


def train_mtp(model: str, files: list[str], out: str, steps: int = 300, seq_len: int = 128, batch: int = 4,
              lr: float = 2e-3, max_tokens: int = 2_000_000, seed: int = 0, eval_file: str | None = None,
              num_speculative_tokens: int = 3, progress: bool = True,
              seconds: float | None = None) -> TrainReport:
    from ..models.deepseek_v4.nextn import NextN, build_nextn
    from ..startup import proposer_kv
    from .drafter import save_drafter

    target = FrozenTarget(model, files, seq_len, batch, max_tokens, seed, progress)
    start = initial_nextn(target.model, seed)
    layer: NextN = build_nextn(target.model, start)
    layer.train()
    # the attention's input (and query) projections run as fused weights whose parts' parameters
    # are views of them: those weights are what trains
    fused = [w.data for proj in (layer.attn.x_proj, layer.attn.q_proj) for w, names, _ in proj.groups
             if len(names) > 1]
    params = [p for p in layer.parameters() if all(p.data_ptr() != f.data_ptr() and not _inside(p, f) for f in fused)]
    params += fused

    def loss_of() -> torch.Tensor:
        windows = target.windows()
        _, features = target.run(windows)
        streams = features["streams"].clone()  # out of inference mode: autograd may keep it
        # the layer at positions 0..L-2 reads x[p + 1] and the streams at p, and predicts x[p + 2]
        cache, kv_manager = proposer_kv(target.config, layer, target.components.device, torch.float32,
                                        seq_len + PAGE, 0)
        b, _ = step_batch(kv_manager, windows, PAGE, target.components.device, shift=1)
        rows = streams.view(batch, seq_len, *streams.shape[1:])[:, :-1].reshape(-1, *streams.shape[1:])
        _, hidden = layer(b, cache, rows)
        logits = target.model.compute_logits(hidden).view(batch, seq_len - 1, -1)[:, :-1]
        want = torch.tensor([w[2:] for w in windows], device=logits.device)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), want.reshape(-1))

    losses, seconds = fit(params, loss_of, steps, lr, "training the next-n layer", progress, seconds)
    result = report(losses, seconds, target)
    tensors = layer.export(list(start))
    save_drafter(out, "mtp", model, tensors, asdict(result))
    if eval_file is not None:
        result.acceptance_length = held_out_acceptance(model, "mtp", out, eval_file, num_speculative_tokens, seed)
        result.num_speculative_tokens = num_speculative_tokens
        save_drafter(out, "mtp", model, tensors, asdict(result))
    return result


def _inside(p: torch.Tensor, whole: torch.Tensor) -> bool:
    """Whether ``p``'s memory lies within ``whole``'s."""
    a, n = whole.data_ptr(), whole.numel() * whole.element_size()
    return a <= p.data_ptr() < a + n
