"""DeepSeek-V4's next-n (MTP) layer: predicts the token after next from a token's embedding and
the target's residual streams at the position before it, as DeepSeek's MTP modules do.

``e_proj(enorm(embed(x[p + 1]))) + h_proj(hnorm(streams[p]))``, the embedding's projection added
to each of the ``hc_mult`` streams, runs through one decoder block (mHC-wrapped attention and MoE,
a sublayer pair like the target's), then the layer's own mHC head and norm, and the target's LM
head (shared, as is the embedding). Its output streams feed the next position when it drafts
autoregressively. The block attends over its own KV (the sliding window: the layer is a
sliding-attention layer), kept apart from the target's (core/spec/mtp.py).

Checkpoint names: ``mtp.{i}.`` (or ``model.mtp.{i}.``) followed by a decoder layer's names
(``attn.*``, ``ffn.*``, ``attn_norm``, ``hc_attn_*`` ...) and ``e_proj``, ``h_proj``, ``enorm``,
``hnorm``, ``norm``, ``hc_head_fn``/``_base``/``_scale``; shared ``emb``/``head`` tensors are read
from the target. The target keeps them aside when it loads (``DeepseekV4ForCausalLM.mtp``).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from ...forward import ForwardBatch
from ...kv.storage import KVCache, KVLayerSpec
from ...loader import checkpoint_files
from ...native.rope import rope_from_hf
from ..layers import Linear, RMSNorm
from ..weights import load_into, read_back
from . import moe
from .attention import SLIDING, StepShare
from .cache import cache_layout, window_reach
from .model import DecoderLayer, DeepseekV4ForCausalLM, HyperHead, Streams, _normalised

MTP_NAME = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.*)$")
_HEAD = {"hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
_SHARED = ("emb.", "embed.", "head.", "shared_head.")  # the target's embedding and LM head


def checkpoint_has_nextn(path: str | Path) -> bool:
    """Whether the checkpoint holds any ``mtp.*`` tensor (read from the safetensors headers)."""
    for f in checkpoint_files(path):
        with safe_open(str(f), "pt") as handle:
            if any(MTP_NAME.match(k) for k in handle.keys()):
                return True
    return False


def drafting_layer(hf: dict, layer_id: int) -> dict:
    """``hf`` with layer ``layer_id``, past the target's, a sliding-attention MoE layer: a drafter's
    layer (this next-n layer, a DSpark stage) built as a decoder layer."""
    return {**hf, "layer_types": hf["layer_types"][:layer_id] + [SLIDING],
            "mlp_layer_types": hf["mlp_layer_types"][:layer_id] + ["moe"],
            "csa2_roles": hf["csa2_roles"][:layer_id] + [None]}


class NextN(DecoderLayer):
    def __init__(self, hf: dict, layer_id: int, target: DeepseekV4ForCausalLM) -> None:
        backends, dtype, device = target.backends, target.config.dtype, target.head.weight.device
        hidden, eps = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6)
        specs, caches = cache_layout(hf["head_dim"], [0], [False], hf.get("index_head_dim", 128))
        hf = drafting_layer(hf, layer_id)
        ropes = {kind: rope_from_hf(hf, kind, device=device) for kind in ("main", "compress")}
        super().__init__(hf, layer_id, caches[0], backends, ropes, dtype=dtype, device=device,
                         fold_shared=moe.FOLD_SHARED)
        self.specs = specs
        self.reach = window_reach(hf["sliding_window"], [0], [False])
        self.enorm = RMSNorm(hidden, eps, dtype=torch.float32, device=device, ops=backends.norm)
        self.hnorm = RMSNorm(hidden, eps, dtype=torch.float32, device=device, ops=backends.norm)
        self.e_proj = Linear(hidden, hidden, backends.linear, dtype=dtype, device=device)
        self.h_proj = Linear(hidden, hidden, backends.linear, dtype=dtype, device=device)
        self.norm = RMSNorm(hidden, eps, dtype=torch.float32, device=device, ops=backends.norm)
        self.hc_head = HyperHead(hf, backends, device)
        self.target = (target,)  # not a submodule: its weights are the target's
        self.dtype = dtype

    @property
    def config(self):
        """The target's model config: the layer runs at its hidden size and dtype."""
        return self.target[0].config

    def kv_layer_specs(self) -> list[KVLayerSpec]:
        return list(self.specs)

    def window_reach(self) -> int:
        return self.reach

    def forward(self, batch: ForwardBatch, kv: KVCache, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch``: the tokens x[p + 1] at positions p; ``streams`` [T, n, D] the streams at p ->
        (the layer's output streams [T, n, D], its normed hidden [T, D] for the LM head)."""
        target = self.target[0]
        e = self.e_proj(self.enorm(target.model.embed_tokens(batch.input_ids)))
        t, n, d = streams.shape
        h = self.h_proj(self.hnorm(streams.reshape(t * n, d).to(self.dtype))).view(t, n, d)
        state = Streams((h + e.unsqueeze(1)).contiguous())
        meta = self.attn.backend.prepare(batch, kv)
        state = super().forward(state, batch, kv, meta, StepShare())
        out = self.mhc.post(state.block_out, state.streams, state.post, state.comb)
        return out, self.hc_head(state, self.norm)

    @contextmanager
    def _names(self):
        """Checkpoint name -> Target in this layer (None: a shared tensor), through the target's
        resolver, which finds the layer's expert stacks while it is the target's ``nextn``."""
        target = self.target[0]
        target.add_module("nextn", self)

        def resolve(name: str):
            rest = MTP_NAME.match(name)[2]
            if rest.startswith(_SHARED):
                return None
            t = target.resolve("nextn." + _HEAD.get(rest, rest))  # None: an expert another rank holds
            return None if t is None else replace(t, param=t.param.removeprefix("nextn."))
        try:
            yield resolve
        finally:
            del target._modules["nextn"]

    def load(self, tensors: dict[str, torch.Tensor], index: int = 0) -> None:
        """Fill the layer from ``mtp.{index}.*`` tensors."""
        with self._names() as resolve:
            load_into(self, [(k, v) for k, v in tensors.items() if int(MTP_NAME.match(k)[1]) == index], resolve)
        self.attn.weights_loaded()

    def export(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The layer's weights under the checkpoint names ``names`` (as :meth:`load` read them)."""
        out = {}
        with self._names() as resolve:
            for name in names:
                if (t := resolve(name)) is None:
                    continue
                out[name] = read_back(self, t).clone()
        return out


def build_nextn(target: DeepseekV4ForCausalLM, tensors: dict[str, torch.Tensor] | None = None) -> NextN:
    """The target's first next-n layer, loaded from ``tensors`` (a drafter's, drafter.py) or the
    ones the target kept aside from its own checkpoint."""
    hf = _normalised(target.config.hf)
    layer = NextN(hf, hf["num_hidden_layers"], target)
    with torch.no_grad():
        layer.load(target.mtp if tensors is None else tensors)
    return layer.eval()
