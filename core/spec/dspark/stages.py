"""DeepSeek-V4.1's own DSpark drafter: its checkpoint's ``mtp.*`` tensors are DSpark stages, not
next-n layers, and ``speculative_config {"method": "dspark"}`` with no ``model`` drafts with them.

The layout, as the public ports of DeepSeek's DSpark checkpoints read it (the DeepSeek-V4-Flash-DSpark
loaders in SGLang and an MLX port; DeepSpec's ``deepspec/modeling/dspark`` for the computation):

* ``num_nextn_predict_layers`` stages ``mtp.{i}``, each a V4 decoder block under a V4 layer's names
  (mHC around the attention and the MoE, ``attn.wq_a`` ... ``attn.attn_sink``, ``ffn.gate``,
  ``ffn.experts.{e}``, ``ffn.shared_experts``), its MoE of ``dspark_n_routed_experts`` routed
  experts, ``dspark_num_experts_per_tok`` a token, routed by a learned gate with its bias;
* on the first, ``main_proj`` [hidden, len(dspark_target_layer_ids) * hidden] and ``main_norm``:
  DeepSpec's ``fc`` and ``hidden_norm``, fusing the target's features, each layer's residual streams
  averaged (the official inference keeps ``h.mean(dim=2)`` after each of those layers);
* on the last, the mHC head (``hc_head_*``), ``norm``, ``markov_head.markov_w1`` / ``markov_w2``
  (rank ``dspark_markov_rank``) and ``confidence_head.proj`` (no bias).

The block (the anchor, then ``dspark_noise_token_id``) runs the stages in turn; in each, the
block's queries attend over the context and the whole block (model.py), with V4's attention
arithmetic: the low-rank query with its per-head RMSNorm, one K = V head through ``wkv`` and the
KV norm, RoPE on the trailing channels (undone on the output), the sinks, the grouped output
projection. What is the engine's reading, not a published description: the context's keys come
from the fused features through each stage's ``wkv`` and KV norm with no mHC or input norm before
(as DeepSpec's drafter projects ``fc``'s output straight to keys), and the context's positions are
the target's.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ...families.attention import AttentionLayer
from ...loader import checkpoint_files
from ...models.deepseek_v4 import moe
from ...models.deepseek_v4.cache import cache_layout
from ...models.deepseek_v4.model import DecoderLayer, HyperHead, _normalised
from ...models.deepseek_v4.nextn import MTP_NAME, drafting_layer
from ...models.layers import RMSNorm
from ...models.weights import Target, load_into
from ...native.attention import attend
from ...native.mhc import hc_head, hc_post, hc_pre
from ...native.norm import rms_norm, unweighted_rms_norm
from ...native.rope import rope_from_hf
from ...native.tail_rope import rotate_tail
from .model import BlockDrafter, DSparkShape

FIELDS = ("dspark_block_size", "dspark_target_layer_ids", "dspark_markov_rank", "dspark_n_routed_experts",
          "dspark_num_experts_per_tok", "dspark_noise_token_id")
_FIRST = {"main_proj.weight": "main_proj.weight", "main_norm.weight": "main_norm.weight"}
_LAST = {"norm.weight": "norm.weight", "hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base",
         "hc_head_scale": "hc_head.hc_scale", "markov_head.markov_w1.weight": "markov_w1.weight",
         "markov_head.markov_w2.weight": "markov_w2.weight", "confidence_head.proj.weight": "confidence.weight"}
_EXPERTS = re.compile(r"^ffn\.experts\.(\d+)\.w1\.weight$")


def has_dspark(hf: dict) -> bool:
    """Whether config.json describes DSpark stages (V4.1's ``dspark_*`` keys)."""
    return "dspark_block_size" in hf


def _stage_tensors(path: str | Path) -> dict[str, tuple[int, ...]]:
    """The checkpoint's ``mtp.*`` tensor shapes, from the safetensors headers."""
    shapes = {}
    for f in checkpoint_files(path):
        with safe_open(str(f), "pt") as handle:
            shapes.update({k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys() if MTP_NAME.match(k)})
    return shapes


def stage_reasons(hf: dict, path: str | Path, k: int) -> list[str]:
    """Why the checkpoint in ``path`` cannot draft ``k`` tokens with its own DSpark stages; each
    reason names the config.json field it breaks."""
    missing = [f for f in FIELDS if f not in hf]
    if missing:
        return [f"config.json has DSpark stages but no {', '.join(missing)}"]
    layers, stages = hf["num_hidden_layers"], hf.get("num_nextn_predict_layers") or 0
    taps, block = hf["dspark_target_layer_ids"], hf["dspark_block_size"]
    if not isinstance(taps, list) or not taps or any(not isinstance(t, int) or not 0 <= t < layers for t in taps):
        return [f"dspark_target_layer_ids: {taps!r} must be target layers in [0, {layers})"]
    if not isinstance(block, int) or block < 2:
        return [f"dspark_block_size: {block!r} must be an integer >= 2 (the anchor and a draft)"]
    if k > block:
        return [f"speculative_config.num_speculative_tokens: {k} is more than the checkpoint's block of {block} "
                f"(dspark_block_size)"]
    shapes = _stage_tensors(path)
    if not shapes:
        return [f"the checkpoint in {path} has no mtp.* tensors: it has no DSpark stages to draft with"]
    found = sorted({int(MTP_NAME.match(n)[1]) for n in shapes})
    if found != list(range(stages)):
        return [f"num_nextn_predict_layers: {stages}, but the checkpoint's mtp.* tensors are stages {found}"]
    d, last = hf["hidden_size"], f"mtp.{stages - 1}."
    want = {"mtp.0.main_proj.weight": ((d, len(taps) * d), "dspark_target_layer_ids"),
            last + "markov_head.markov_w1.weight": ((hf["vocab_size"], hf["dspark_markov_rank"]),
                                                    "dspark_markov_rank")}
    for name, (shape, field) in want.items():
        if shapes.get(name) != shape:
            return [f"{field}: {hf[field]} makes {name} {shape}, but the checkpoint's is {shapes.get(name)}"]
    experts = 1 + max((int(m[1]) for n in shapes if (m := _EXPERTS.match(MTP_NAME.match(n)[2]))), default=-1)
    if experts != hf["dspark_n_routed_experts"]:
        return [f"dspark_n_routed_experts: {hf['dspark_n_routed_experts']}, but the checkpoint's stages have "
                f"{experts} routed experts"]
    return []


class Stage(DecoderLayer):
    """One DSpark stage: a V4 block whose attention reads the context's keys beside the block's."""

    def __init__(self, hf: dict, layer_id: int, target) -> None:
        backends, dtype, device = target.backends, target.config.dtype, target.head.weight.device
        _, caches = cache_layout(hf["head_dim"], [0], [False], hf.get("index_head_dim", 128))
        hf = {**drafting_layer(hf, layer_id), "n_routed_experts": hf["dspark_n_routed_experts"],
              "num_experts_per_tok": hf["dspark_num_experts_per_tok"]}
        ropes = {kind: rope_from_hf(hf, kind, device=device) for kind in ("main", "compress")}
        super().__init__(hf, layer_id, caches[0], backends, ropes, dtype=dtype, device=device,
                         fold_shared=moe.FOLD_SHARED)

    def kv(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The one K = V head [T, head dim] of inputs ``x`` [T, D] at ``positions``: normed, rotated."""
        a = self.attn
        return rotate_tail(rms_norm(a.wkv(x), a.norm.weight, a.eps), a.rope.cos[positions], a.rope.sin[positions])

    def _attention(self, x: torch.Tensor, positions: torch.Tensor, ctx: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
        """``x`` [N * Q, D] the block rows at ``positions``; ``ctx`` [N, C, head dim]; ``mask`` [N, Q, C + Q]."""
        a, (n, q_len) = self.attn, mask.shape[:2]
        cos, sin = a.rope.cos[positions][:, None], a.rope.sin[positions][:, None]
        q = a.wq_b(a.q_norm(a.wq_a(x))).view(-1, a.num_heads, a.head_dim)
        q = rotate_tail(unweighted_rms_norm(q, a.eps), cos, sin)
        kv = torch.cat([ctx, self.kv(x, positions).view(n, q_len, -1)], 1).float()[:, None]  # [N, 1, C + Q, hd]
        spec = AttentionLayer(layer_id=0, num_heads=a.num_heads, num_kv_heads=1, head_dim=a.head_dim,
                              scale=a.head_dim ** -0.5, sinks=a.attn_sink)
        out = attend(q.float().view(n, q_len, 1, a.num_heads, -1).permute(0, 2, 3, 1, 4), kv, kv,
                     mask[:, None, None], spec)  # [N, 1, H, Q, hd]
        out = rotate_tail(out[:, 0].transpose(1, 2).reshape(q.shape).to(x.dtype), cos, -sin)
        return a.wo_a(out.reshape(x.shape[0], a.groups, -1), a.wo_b)

    def _mixed(self, name: str, streams: torch.Tensor, norm: RMSNorm, sublayer) -> torch.Tensor:
        """One mHC-wrapped sublayer over ``streams`` [T, n, D]."""
        w = self._mix(name)
        x, post, comb = hc_pre(streams, w.fn, w.base, w.scale, w.norm_eps, w.hc_eps, w.sinkhorn_iters)
        return hc_post(sublayer(norm(x)), streams, post, comb)

    def forward(self, streams: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, ctx: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        streams = self._mixed("attn", streams, self.attn_norm, lambda x: self._attention(x, positions, ctx, mask))
        return self._mixed("ffn", streams, self.ffn_norm, lambda x: self.ffn(x, ids))


class StageDrafter(BlockDrafter):
    split = True  # the target's kind of layers, the target's embedding and LM head

    def __init__(self, target) -> None:
        super().__init__()
        hf = _normalised(target.config.hf)
        d, eps, dtype, device = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6), target.config.dtype, \
            target.head.weight.device
        taps, count = tuple(hf["dspark_target_layer_ids"]), hf["num_nextn_predict_layers"]
        a = target.model.layers[0].attn
        self.shape = DSparkShape(vocab_size=hf["vocab_size"], hidden_size=d,
                                 feature_size=len(taps) * target.layer_feature_size(), target_layer_ids=taps,
                                 block_size=hf["dspark_block_size"], num_layers=count, num_heads=a.num_heads,
                                 num_kv_heads=1, head_dim=a.head_dim, intermediate_size=hf["moe_intermediate_size"],
                                 markov_rank=hf["dspark_markov_rank"], mask_token_id=hf["dspark_noise_token_id"],
                                 rms_norm_eps=eps)
        self.main_proj = nn.Linear(len(taps) * d, d, bias=False, dtype=dtype, device=device)
        self.main_norm = RMSNorm(d, eps, dtype=torch.float32, device=device)
        self.stages = nn.ModuleList(Stage(hf, hf["num_hidden_layers"], target) for _ in range(count))
        self.hc_head = HyperHead(hf, target.backends, device)
        self.norm = RMSNorm(d, eps, dtype=torch.float32, device=device)
        self.markov_w1 = nn.Embedding(hf["vocab_size"], hf["dspark_markov_rank"], dtype=dtype, device=device)
        self.markov_w2 = nn.Linear(hf["dspark_markov_rank"], hf["vocab_size"], bias=False, dtype=dtype,
                                   device=device)
        self.confidence = nn.Linear(d + hf["dspark_markov_rank"], 1, bias=False, dtype=dtype, device=device)
        self.hc_mult, self.taps = hf.get("hc_mult", 4), len(taps)
        self.config = target.config  # the width and dtype of a forward with no tokens (idle_forward)
        self._target = (target.model.embed_tokens, target.compute_logits, target)  # the target's, not the drafter's

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per stage the context's K = V head [n, 1, hd] (twice: the proposer keeps keys and values)
        from the target's ``features`` [n, taps * hc_mult * D], each layer's streams averaged."""
        n = features.shape[0]
        mean = features.view(n, self.taps, self.hc_mult, -1).mean(2).flatten(1)
        ctx = self.main_norm(self.main_proj(mean.to(self.main_proj.weight.dtype)))
        return [(k, k) for k in (stage.kv(ctx, positions)[:, None] for stage in self.stages)]

    def backbone(self, ids: torch.Tensor, positions: torch.Tensor, context: list[tuple[torch.Tensor, torch.Tensor]],
                 mask: torch.Tensor) -> torch.Tensor:
        n, q_len = ids.shape
        flat_ids, flat_pos = ids.flatten(), positions.flatten()
        streams = self._target[0](flat_ids).unsqueeze(1).expand(-1, self.hc_mult, -1)
        for stage, (k, _) in zip(self.stages, context):
            streams = stage(streams, flat_ids, flat_pos, k[:, :, 0], mask)
        h = self.hc_head
        x = hc_head(streams, h.hc_fn, h.hc_base, h.hc_scale, h.eps, h.hc_eps)
        return self.norm(x).view(n, q_len, -1).to(streams.dtype)

    @contextmanager
    def _names(self):
        """Checkpoint name -> Target in the drafter, through the target's resolver (it finds the
        stages' expert stacks while the drafter is the target's ``dspark``)."""
        target, last = self._target[2], len(self.stages) - 1
        target.add_module("dspark", self)

        def resolve(name: str) -> Target | None:
            m = MTP_NAME.match(name)
            stage, rest = int(m[1]), m[2]
            if stage == 0 and rest in _FIRST:
                return Target(_FIRST[rest])
            if stage == last and rest in _LAST:
                return Target(_LAST[rest])
            t = target.resolve(f"dspark.stages.{stage}.{rest}")
            return None if t is None else replace(t, param=t.param.removeprefix("dspark."))
        try:
            yield resolve
        finally:
            del target._modules["dspark"]

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        with self._names() as resolve:
            load_into(self, tensors.items(), resolve)

    def checkpoint_names(self) -> dict[str, str]:
        """Each parameter's checkpoint name (an expert stack's: its stacked name under ``mtp.{i}``,
        publish.unstacked_experts splits it), as :meth:`load` reads them."""
        last, names = len(self.stages) - 1, {}
        for param, _ in self.named_parameters():
            if param.startswith("stages."):
                names[param] = "mtp." + param.removeprefix("stages.")
            else:
                first = {v: k for k, v in _FIRST.items()}.get(param)
                names[param] = f"mtp.0.{first}" if first else f"mtp.{last}." + {v: k for k, v in _LAST.items()}[param]
        return names


def build_stages(target, tensors: dict[str, torch.Tensor] | None = None) -> StageDrafter:
    """The target's DSpark stages, loaded from the ``mtp.*`` tensors it kept aside (or ``tensors``)."""
    drafter = StageDrafter(target)
    with torch.no_grad():
        drafter.load(target.mtp if tensors is None else tensors)
    return drafter.eval()
