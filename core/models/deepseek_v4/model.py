"""DeepseekV4ForCausalLM: token embedding spread over hc_mult residual streams, per layer an mHC-wrapped
attention sublayer and MoE sublayer, and the final mHC head, norm and LM head.

Each step computes only its new tokens: the attention finds what earlier tokens left behind (the
window's KV, the compressors' open windows and entries, the indexer's keys) in the KV pages,
laid out as cache.py describes.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from typing import Any, Iterable, NamedTuple

import torch
from torch import nn

from ...config import ModelConfig
from ...distributed.layers import ParallelLMHead, VocabParallelEmbedding
from ...families.mhc import MixWeights
from ...forward import ForwardBatch
from ...kv.storage import KVCache, KVLayerSpec
from ...native.quant import FP8, e8m0_exponents
from ...native.rope import RotaryEmbedding, rope_from_hf
from ..base import Backends, CausalLM
from ..experts import FP8_BLOCK, ExpertStack
from ..layers import Linear, RMSNorm, empty_param
from ..weights import Target, checkpoint_part, load_into
from .attention import CSA, CSA2, HCA, SLIDING, Attention, GroupedLinear, StepShare
from . import moe
from .cache import LayerCache, cache_layout, window_reach
from .checkpoint import SCALE, V41_BLOCK, Quantized, check_quantization_config, fp8_block, paired
from .moe import SparseMoE
from .engram import Engram, EngramLayout, NgramHistory, Rows
from .engram_host import HostEngram
from .replay import ReplayPlan, decoder_split
from .topology import CSA2_RATIOS, csa2_roles

logger = logging.getLogger(__name__)

_EXPERT = re.compile(r"(.*\.ffn)\.(experts\.(\d+)|shared_experts)\.(w[123])\.weight$")
_PROJECTIONS = {"w1": "gate", "w3": "up", "w2": "down"}
_SCHEMES = {"fp8": "fp8_block", "fp4": "fp4"}  # checkpoint kind -> the scheme a layer keeps it in
_PUBLISHED = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
              "hc_head_scale": "model.hc_head.hc_scale"}


class Streams(NamedTuple):
    """The residual streams [T, n, D] between two sublayers, and the output of the sublayer before
    with its post and comb, not yet mixed into them (None before the first sublayer): the next
    boundary mixes it in, so that the mHC backend may fuse that post with the next collapse."""

    streams: torch.Tensor
    block_out: torch.Tensor | None = None
    post: torch.Tensor | None = None
    comb: torch.Tensor | None = None


class DecoderLayer(nn.Module):
    def __init__(self, hf: dict, layer_id: int, cache: LayerCache, backends: Backends,
                 ropes: dict[str, RotaryEmbedding], *, dtype: torch.dtype, device, fold_shared: bool,
                 engram: EngramLayout | None = None, host_engram: HostEngram | None = None) -> None:
        super().__init__()
        hidden, eps = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6)
        self.engram = None
        if engram is not None and layer_id in engram.layers:
            self.engram = Engram(hf, engram, layer_id, backends, dtype=dtype, device=device, host=host_engram)
        self.attn = Attention(hf, layer_id, cache, backends, ropes, dtype=dtype, device=device)
        self.ffn = SparseMoE(hf, hf["mlp_layer_types"][layer_id] == "hash_moe", backends, dtype=dtype,
                             device=device, fold_shared=fold_shared)
        self.attn_norm = RMSNorm(hidden, eps, dtype=torch.float32, device=device, ops=backends.norm)
        self.ffn_norm = RMSNorm(hidden, eps, dtype=torch.float32, device=device, ops=backends.norm)
        n = hf.get("hc_mult", 4)
        for name in ("attn", "ffn"):
            mixes = (2 + n) * n
            self.register_parameter(f"hc_{name}_fn", empty_param(mixes, n * hidden, dtype=torch.float32,
                                                                 device=device))
            self.register_parameter(f"hc_{name}_base", empty_param(mixes, dtype=torch.float32, device=device))
            self.register_parameter(f"hc_{name}_scale", empty_param(3, dtype=torch.float32, device=device))
        self.eps, self.hc_eps, self.iters = eps, hf.get("hc_eps", 1e-6), hf.get("hc_sinkhorn_iters", 20)
        self.mhc = backends.mhc

    def _mix(self, name: str) -> MixWeights:
        return MixWeights(getattr(self, f"hc_{name}_fn"), getattr(self, f"hc_{name}_base"),
                          getattr(self, f"hc_{name}_scale"), self.eps, self.hc_eps, self.iters)

    def enter_attention(self, state: Streams) -> tuple[torch.Tensor, Streams]:
        """The attention sublayer's input from the streams the layer before left (no Engram before it)."""
        return self._enter(state, "attn", self.attn_norm)

    def _enter(self, state: Streams, name: str, norm: RMSNorm) -> tuple[torch.Tensor, Streams]:
        """A sublayer boundary: the output left pending mixed into the streams, then the sublayer's
        collapse through its input norm -> (the sublayer's input, the streams it leaves pending)."""
        w = self._mix(name)
        if state.block_out is None:
            x, post, comb = self.mhc.pre_norm(state.streams, w, norm.weight, norm.eps, norm.ops)
            return x, Streams(state.streams, None, post, comb)
        streams, x, post, comb = self.mhc.post_pre_norm(state.block_out, state.streams, state.post, state.comb, w,
                                                        norm.weight, norm.eps, norm.ops)
        return x, Streams(streams, None, post, comb)

    def forward(self, state: Streams, batch: ForwardBatch, kv: KVCache, meta: Any, share: StepShare) -> Streams:
        if self.engram is not None:  # into the residual streams, before the attention's pre
            streams = state.streams
            if state.block_out is not None:
                streams = self.mhc.post(state.block_out, state.streams, state.post, state.comb)
            state = Streams(self.engram(streams, share.ngram_ids))
        x, state = self._enter(state, "attn", self.attn_norm)
        state = state._replace(block_out=self.attn(x, batch, kv, meta, share))
        x, state = self._enter(state, "ffn", self.ffn_norm)
        return state._replace(block_out=self.ffn(x, batch.input_ids))


class HyperHead(nn.Module):
    def __init__(self, hf: dict, backends: Backends, device) -> None:
        super().__init__()
        n = hf.get("hc_mult", 4)
        self.hc_fn = empty_param(n, n * hf["hidden_size"], dtype=torch.float32, device=device)
        self.hc_base = empty_param(n, dtype=torch.float32, device=device)
        self.hc_scale = empty_param(1, dtype=torch.float32, device=device)
        self.eps, self.hc_eps = hf.get("rms_norm_eps", 1e-6), hf.get("hc_eps", 1e-6)
        self.mhc = backends.mhc

    def forward(self, state: Streams, norm: RMSNorm) -> torch.Tensor:
        """The last sublayer's output mixed in, the collapse, and the final norm."""
        w = MixWeights(self.hc_fn, self.hc_base, self.hc_scale, self.eps, self.hc_eps)
        return self.mhc.post_head_norm(state.block_out, state.streams, state.post, state.comb, w, norm.weight,
                                       norm.eps, norm.ops)


class Decoder(nn.Module):
    def __init__(self, hf: dict, caches: list[LayerCache], backends: Backends, *, dtype: torch.dtype,
                 device, fold_shared: bool, engram: EngramLayout | None = None, ngram_cache: int | None = None,
                 host_engram: HostEngram | None = None, replay_split: int | None = None) -> None:
        """``replay_split``: the first decoder layer, where a prefill replays the decoder (replay.py)."""
        super().__init__()
        self.replay_split, self.window = replay_split, hf["sliding_window"]
        ropes = {kind: rope_from_hf(hf, kind, device=device) for kind in ("main", "compress")}
        self.embed_tokens = VocabParallelEmbedding(hf["vocab_size"], hf["hidden_size"], backends.tp, dtype=dtype,
                                                   device=device)
        self.layers = nn.ModuleList(DecoderLayer(hf, i, cache, backends, ropes, dtype=dtype, device=device,
                                                 fold_shared=fold_shared, engram=engram, host_engram=host_engram)
                                    for i, cache in enumerate(caches))
        self.ngrams = None if ngram_cache is None else NgramHistory(engram, ngram_cache, device)
        for layer in self.layers:  # a CSA2 layer reads its KV source's entries and index keys
            if (role := layer.attn.role) is not None:
                layer.attn.source = (self.layers[role.kv_source].attn,)
        self.hc_head = HyperHead(hf, backends, device)
        self.norm = RMSNorm(hf["hidden_size"], hf.get("rms_norm_eps", 1e-6), dtype=torch.float32, device=device,
                            ops=backends.norm)
        self.hc_mult = hf.get("hc_mult", 4)
        self.attention = backends.v4_attention

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        # the embedding's row as every stream, a view (stride 0 across the streams): the first
        # sublayer's pre reads it so, and the post after it writes the streams out
        state = Streams(x.unsqueeze(1).expand(-1, self.hc_mult, -1))
        meta = self.attention.prepare(batch, kv)
        share = StepShare(ngram_ids=None if self.ngrams is None else self.ngrams(batch, kv))
        plan = None if self.replay_split is None else ReplayPlan.of(batch, self.replay_split, self.window)
        kept = []
        for i, layer in enumerate(self.layers):
            if plan is not None and i == plan.split:  # the decoder over the prompt's last window only
                (state, batch, meta), share = plan.enter(state, layer, kv, self.attention), StepShare()
                if not batch.num_tokens:  # a chunk before the window: the encoder's part was all
                    return plan.restore(state.streams[:, 0])
            state = layer(state, batch, kv, meta, share)
            if i in batch.feature_layers:  # the layer's residual streams, side by side
                kept.append(self.hc_head.mhc.post(state.block_out, state.streams, state.post, state.comb).flatten(1))
        if kept:
            batch.features["layers"] = torch.cat(kept, -1)
        if batch.features is not None:  # what the next-n layer (nextn.py) drafts from
            batch.features["streams"] = self.hc_head.mhc.post(state.block_out, state.streams, state.post, state.comb)
        hidden = self.hc_head(state, self.norm)
        return hidden if plan is None else plan.restore(hidden)


class DeepseekV4ForCausalLM(CausalLM):
    blocks = (("mHC pre/post mixing, Sinkhorn, HC head", "mhc"),
              ("attention: window store, compressors, indexer top-k, window + entries, sinks", "v4_attention"),
              ("q/kv/compressor/indexer/output projections, LM head", "linear"),
              ("RMSNorms (fp32 weights, HF's rounding order), the per-head q norm", "norm"),
              ("routed + shared experts (sqrtsoftplus and hash routing, swiglu clamp)", "moe"))
    def __init__(self, config: ModelConfig, backends: Backends, device: torch.device | str = "cpu") -> None:
        super().__init__(config, backends)
        hf, dtype = _normalised(config.hf), config.dtype
        check_quantization_config(hf)
        types, roles = hf["layer_types"][:hf["num_hidden_layers"]], hf["csa2_roles"]
        rates = [0 if t == SLIDING else role.ratio if role is not None else hf["compress_rates"][t]
                 for t, role in zip(types, roles)]
        overlaps = [t == CSA for t in types]
        # quantized checkpoint weights stay as stored where a layer and its backend run the format;
        # served so (DeepSeek's published FP8 layout), the indexer's keys are E4M3 as DeepSeek keeps
        # them, and the routed (FP4) and shared (FP8) experts cannot share a launch
        self.resident = config.quantization != "none"
        published = self.resident and bool(hf.get("quantization_config"))
        self.cache_specs, caches = cache_layout(hf["head_dim"], rates, overlaps, hf.get("index_head_dim", 128),
                                                fp8_index_keys=published, roles=roles)
        self.reach = window_reach(hf["sliding_window"], rates, overlaps)
        engram, ngram_cache, self.host_engram = None, None, None
        if hf.get("engram_layer_ids"):
            engram = EngramLayout.from_config(hf, config.path)
            if config.engram_placement == "host":  # the tables in host memory, the rows found from the ids there
                self.host_engram = HostEngram(engram, device)
                self.token_history = engram.order - 1
            else:  # the tokens' compressed ids kept per token, in a windowed cache component near the end
                ngram_cache = len(self.cache_specs)
                self.cache_specs.append(KVLayerSpec(1, 1, 0, windowed=True, k_dtype=torch.int32))
                self.reach = max(self.reach, engram.order - 1)
        fold = moe.FOLD_SHARED and not published
        split = None
        if config.swa_bounded_replay:
            split = decoder_split(hf, backends.v4_attention)
            self.replay_tail = hf["sliding_window"]
            logger.info("SWA bounded replay: layers %d.. are the decoder, run over the last %d tokens of a prefill",
                        split, self.replay_tail)
        self.model = Decoder(hf, caches, backends, dtype=dtype, device=device, fold_shared=fold, engram=engram,
                             ngram_cache=ngram_cache, host_engram=self.host_engram, replay_split=split)
        self.head = ParallelLMHead(hf["hidden_size"], config.vocab_size, backends.linear, backends.tp, dtype=dtype,
                                   device=device)
        self.mtp: dict[str, torch.Tensor] = {}  # next-n prediction weights, kept for speculative decoding

    def kv_layer_specs(self) -> list[KVLayerSpec]:
        return list(self.cache_specs)

    def window_reach(self) -> int:
        return self.reach

    def prepare(self, batch: ForwardBatch) -> None:
        return None  # the V4 attention family prepares inside the step

    def breakable_refusals(self) -> list[str]:
        reasons = super().breakable_refusals()
        if self.model.ngrams is not None:
            reasons.append("its Engram layers read each step's n-gram ids from the KV pages outside the attention")
        if self.replay_tail:
            reasons.append("its SWA bounded replay picks each prefill's decoder rows on the host")
        return reasons

    def stage(self, input_ids: list[int], query_lens: list[int], history: list[list[int]]) -> None:
        self.host_engram.stage(input_ids, query_lens, history)

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        return self.model(batch, kv)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)  # fp32

    def layer_feature_size(self) -> int:
        return self.model.hc_mult * self.config.hf["hidden_size"]  # every residual stream

    def resolve(self, name: str) -> Target | None:
        """Checkpoint name (as HF writes it, or in the published layout without ``model.``) -> parameter;
        a scale (``.scale`` or ``.weight_scale_inv``) goes beside its weight, where a kept one has it."""
        if m := SCALE.match(name):
            weight = self.resolve(m[1] + ".weight")
            return None if weight is None else self._scale_target(weight)
        name = _PUBLISHED.get(name, name)
        if name.startswith("layers."):
            name = "model." + name
        if m := _EXPERT.match(name):
            ffn = self.get_submodule(m[1])
            stack, expert = ("experts", int(m[3])) if m[3] is not None else ffn.shared_slot()
            return getattr(ffn, stack).target(f"{m[1]}.{stack}", _PROJECTIONS[m[4]], expert)
        return Target(name)

    def checkpoint_part(self, name: str) -> tuple[int, int, int] | bool | None:
        if name.startswith(("mtp.", "model.mtp.")):
            return None  # kept whole for the next-n layer (nextn.py)
        return checkpoint_part(self, self.resolve, name)

    def _scale_target(self, weight: Target) -> Target:
        owner = self.get_submodule(weight.param.rpartition(".")[0])
        rows = weight.rows if weight.rows is None or not isinstance(owner, ExpertStack) else owner.scale_rows(weight.rows)
        return Target(weight.param + "_scale", rows=rows, expert=weight.expert, part=weight.part)

    def _keep(self, q: Quantized, refusals: set[str]) -> bool:
        """Switch the layer that ``q`` loads into to q's format, if that layer and its backend run it;
        a backend that runs the scheme but not q's blocks adds its reason to ``refusals``."""
        if q.name.startswith(("mtp.", "model.mtp.")):
            return False
        try:
            owner = self.get_submodule(self.resolve(q.name).param.rpartition(".")[0])
        except AttributeError:
            return False  # not a parameter of this model: load_into names it
        scheme = _SCHEMES[q.kind]
        if isinstance(owner, Rows) and q.kind == "fp8" and q.block == (1, Rows.GROUP):
            owner.keep_fp8(tuple(q.scale.shape))  # an Engram table: rows dequantized as gathered
            return True
        if isinstance(owner, Linear) and scheme == "fp8_block" and scheme in owner.backend.schemes:
            rows, cols = q.block
            if rows != cols or rows not in owner.backend.fp8_blocks:
                refusals.add(f"the {owner.backend.name} linear backend multiplies FP8 in square blocks of "
                             f"{list(owner.backend.fp8_blocks)}, not {rows} x {cols}")
                return False
            owner.keep_quantized(scheme, FP8, tuple(q.scale.shape))
            return True
        if isinstance(owner, GroupedLinear) and q.kind == "fp8" and q.block == (V41_BLOCK, V41_BLOCK):
            # V4.1's wo_a as stored (every linear backend's grouped product takes FP8 blocks); V4's
            # 128-blocks go on as before: dequantized, re-encoded to MXFP8 where the attention emits it
            if owner.splits_blocks(V41_BLOCK):
                refusals.add(f"wo_a's {owner.weight.shape[0]} rows a tensor-parallel rank do not fill whole "
                             f"{V41_BLOCK}-row blocks")
                return False
            owner.keep_fp8_block(tuple(q.scale.shape))
            return True
        moe_backend = self.backends.moe
        if not isinstance(owner, ExpertStack) or scheme not in moe_backend.schemes:
            return False
        if q.kind == "fp8":  # the shared expert (routed ones are FP4 in the published layouts)
            rows, cols = q.block
            if rows != cols or rows not in moe_backend.fp8_blocks:
                refusals.add(f"the {moe_backend.name} MoE backend multiplies FP8 experts in square blocks of "
                             f"{list(moe_backend.fp8_blocks)}, not {rows} x {cols}")
                return False
        block = q.block[0] if q.kind == "fp8" else FP8_BLOCK
        if owner.can_keep(scheme, moe_backend.schemes, block):
            owner.keep_quantized(scheme, block)
            return True
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        kept, dequantized, refusals = Counter(), Counter(), set()

        def main_weights():
            for item in paired(weights, fp8_block(self.config.hf)):
                if isinstance(item, Quantized):
                    if self.resident and self._keep(item, refusals):
                        kept[item.kind] += 1
                        if item.kind == "fp4":
                            yield item.name, item.data.view(torch.uint8)
                            yield item.scale_name, e8m0_exponents(item.scale)
                        else:
                            yield item.name, item.data
                            yield item.scale_name, item.float_scale()
                        continue
                    dequantized[item.kind] += 1
                    item = (item.name, item.dequantize(self.config.dtype))
                name, tensor = item
                if name.startswith(("mtp.", "model.mtp.")):
                    self.mtp[name] = tensor.clone()
                else:
                    yield name, tensor

        with torch.no_grad():
            load_into(self, main_weights(), self.resolve)
            for layer in self.model.layers:
                layer.attn.weights_loaded()
        if kept or dequantized:
            logger.info("DeepSeek-V4 quantized weights: kept as stored %s, dequantized at load %s%s", dict(kept),
                        dict(dequantized), " (--quantization none)" if not self.resident else
                        f" (where no layer or backend runs the format{''.join('; ' + r for r in sorted(refusals))})")


def _normalised(hf: dict) -> dict:
    """config.json with the fields older V4 configs spell differently filled in, as HF does."""
    hf = dict(hf)
    n = hf["num_hidden_layers"]
    rates = dict(hf.get("compress_rates") or {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
    hf["compress_rates"] = rates
    by_ratio = {0: SLIDING, rates[CSA]: CSA, rates[HCA]: HCA, **{r: CSA2 for r in CSA2_RATIOS}}
    if "layer_types" not in hf or hf["layer_types"] is None:
        if "compress_ratios" not in hf:
            raise ValueError("DeepSeek-V4 config.json names neither layer_types nor compress_ratios")
        ratios = list(hf["compress_ratios"][:n])
        if len(ratios) < n:
            raise ValueError(f"compress_ratios has {len(ratios)} entries for {n} layers (num_hidden_layers)")
        for layer, r in enumerate(ratios):
            if r not in by_ratio:
                raise ValueError(f"compress_ratios[{layer}] is {r!r}: DeepSeek-V4 layers compress at ratio "
                                 f"{', '.join(map(str, sorted(by_ratio)))} (0: sliding window only)")
        hf["layer_types"] = [by_ratio[r] for r in ratios]
    else:
        ratios = [0 if t == SLIDING else rates.get(t, 0) for t in hf["layer_types"][:n]]
    hf["csa2_roles"] = csa2_roles(hf, ratios)
    if not hf.get("mlp_layer_types"):
        hashed = hf.get("num_hash_layers", 3)
        hf["mlp_layer_types"] = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if not all(isinstance(rope.get(k), dict) for k in ("main", "compress")):
        partial = hf.get("partial_rotary_factor") or hf.get("qk_rope_head_dim", 64) / hf["head_dim"]
        compress = {**rope, "rope_theta": hf.get("compress_rope_theta", 160000.0), "partial_rotary_factor": partial}
        compress.setdefault("rope_type", "default")
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)  # V4 does not scale cos/sin by YaRN's mscale
        hf["rope_parameters"] = {"main": {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0),
                                          "partial_rotary_factor": partial}, "compress": compress}
    return hf
