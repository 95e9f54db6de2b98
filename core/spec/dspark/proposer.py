"""The DSpark proposer (``speculative_config {"method": "dspark", "model": DIR}``): a drafter that
``engine train-drafter --method dspark`` trained for the target (model.py), or with no ``model``
the DSpark stages a DeepSeek-V4.1 checkpoint carries as its ``mtp.*`` tensors (stages.py), drafts a
block per decode in one pass, each draft then following the one before through its Markov head, with a
confidence per draft that the verify length is chosen from (verify_length.py).

The target hands back the hidden states of the drafter's chosen layers for every token it computes
(``feature_layers``; prefill chunks, decodes, verify rows: ``observe``). Each position's context
keys and values are computed from them once and kept per sequence, by position: positions the
target computes again (after rejected drafts, whose rows it handed back too) overwrite theirs. A
block reads the positions before its anchor, the sequence's last token, whose own features come
with the next verification. A prefix hit gives the target's features from the hit's end on only:
the block reads what there is. An n > 1 sibling forks its parent's context of the prompt (``fork``).

Under prefill/decode disaggregation (core/disagg/) the decode engine computes only a prompt's last
token, so the prefill engine, started with the same ``speculative_config``, sends the context rows
of every position before it with the KV (``carried``): the drafter's keys and values, not the
target's features they are computed from, as they are smaller (the trained drafter's 512 elements
a position against 3072 features) and exactly the rows a colocated engine computes. A prompt the
prefill engine took partly from its prefix cache has no context before the hit, and none is sent:
the decode engine drafts from the positions it computes.

Under tensor parallelism the target's features are whole on every rank after its all-reduces, and
the scheduling rank alone drafts, with whole copies of the target's embedding and LM head
(weights.py): a trained drafter's own layers have no collectives. Under data-parallel attention each
rank drafts its own requests; the stages' MoE (stages.py) spans every rank, as the target's MoE
layers do, so the ranks first agree whether the step runs a block, and a rank with none to draft
(``idle``) runs the stages with no tokens.
"""

from __future__ import annotations

import logging

import torch

from ...distributed.moe import idle_forward
from ...families.spec import DraftRequest, Drafts, SpecProposer
from ..config import SpecConfigError
from .stages import build_stages, has_dspark, stage_reasons
from .weights import METHOD, build_drafter, read_drafter

logger = logging.getLogger(__name__)


def dspark_reasons(ctx) -> list[str]:
    """Why the drafter ``speculative_config.model``, or without one the checkpoint's own DSpark
    stages, cannot draft for the target."""
    from ..drafter import drafter_reasons

    spec, target = ctx.engine_config.speculative_config, ctx.model_config
    own = target is not None and spec is not None and spec.model is None and has_dspark(target.hf)
    if spec is None or (spec.model is None and not own):
        return ["speculative_config.model: DSpark needs a drafter directory (engine train-drafter --method dspark "
                "writes one) or a checkpoint with DSpark stages (DeepSeek-V4.1's dspark_* config.json keys and "
                "mtp.* tensors), which this one has not"]
    if target is None:
        return []
    if own and ctx.engine_config.attention_tp_size > 1:
        return ["DSpark stages with attention split over processes (tensor parallelism) are not built (their "
                "attention's collectives would need every rank to draft in lockstep); under data-parallel "
                "attention each rank's attention must be whole"]
    if own:
        return stage_reasons(target.hf, target.path, spec.num_speculative_tokens)
    if reasons := drafter_reasons(spec.model, METHOD, target.path):
        return reasons
    shape, _ = read_drafter(spec.model)
    if spec.num_speculative_tokens > shape.block_size:
        return [f"speculative_config.num_speculative_tokens: {spec.num_speculative_tokens} is more than the "
                f"drafter's block of {shape.block_size}"]
    return []


class _Context:
    """One sequence's context keys and values, every drafter layer's, for positions ``start``..``end``."""

    def __init__(self, start: int, rows: torch.Tensor) -> None:
        self.start, self.end = start, start
        self.rows = rows  # [layers, 2, capacity, kv heads, head dim]

    def put(self, start: int, kv: torch.Tensor) -> None:
        """Positions ``start``.. (``kv`` [layers, 2, n, ...]); those after them dropped."""
        at, n = start - self.start, kv.shape[2]
        if at + n > self.rows.shape[2]:
            grown = self.rows.new_empty(*self.rows.shape[:2], 2 * (at + n), *self.rows.shape[3:])
            grown[:, :, :at] = self.rows[:, :, :at]
            self.rows = grown
        self.rows[:, :, at:at + n] = kv
        self.end = start + n


class DSparkProposer(SpecProposer):
    name = METHOD
    feature = "layers"
    load_aware = True

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        spec, target = ctx.engine_config.speculative_config, ctx.target
        try:
            if spec.model is None:  # the checkpoint's own stages
                self.drafter = build_stages(target)
                target.mtp.clear()  # the drafter holds them now
            else:
                shape, tensors = read_drafter(spec.model)
                self.drafter = build_drafter(target, shape, tensors, ctx.model_config.dtype).eval()
        except Exception as exc:
            where = f"the DSpark drafter {spec.model}" if spec.model else "the checkpoint's DSpark stages (mtp.*)"
            raise SpecConfigError("model", f"{where} does not load: {type(exc).__name__}: {exc}") from exc
        shape = self.drafter.shape
        self.feature_layers = shape.target_layer_ids
        self.device = next(self.drafter.parameters()).device
        self._contexts: dict[int, _Context] = {}
        if ctx.engine_config.disaggregation is not None:  # the whole prompt's context rows move
            one = self._context_kv(torch.zeros(1, shape.feature_size, device=self.device), 0)
            self.carried, self._row = ctx.engine_config.max_model_len, one[:, :, 0].shape
            self.carried_row, self.carried_dtype = one.numel(), one.dtype
        group = target.backends.moe_group  # under DP attention the stages' MoE meets the other ranks'
        exchanges = any(hasattr(m, "placement") for m in self.drafter.modules())
        self.lockstep = group if exchanges and target.backends.dp_attention and group.size > 1 else None
        logger.info("DSpark: a block of %d from target layers %s, %d drafts a step at most", shape.block_size,
                    list(shape.target_layer_ids), spec.num_speculative_tokens)

    @torch.inference_mode()
    def observe(self, seq_id: int, start: int, features: torch.Tensor) -> None:
        kv = self._context_kv(features, start)
        c = self._contexts.get(seq_id)
        if c is None or not c.start <= start <= c.end:
            c = self._contexts[seq_id] = _Context(start, kv.new_empty(*kv.shape[:2], 2 * kv.shape[2], *kv.shape[3:]))
        c.put(start, kv)

    @torch.inference_mode()
    def fork(self, parent_id: int, child_id: int) -> None:
        """The child's context is the parent's of the prompt (copied: their later positions differ)."""
        if (c := self._contexts.get(parent_id)) is not None:
            child = self._contexts[child_id] = _Context(c.start, c.rows.clone())
            child.end = c.end

    def carried_features(self, seq_id: int, start: int, end: int) -> torch.Tensor | None:
        c = self._contexts.get(seq_id)
        if c is None or c.start > start or c.end < end:
            return None
        rows = c.rows[:, :, start - c.start:end - c.start]  # [layers, 2, n, kv heads, head dim]
        return rows.permute(2, 0, 1, 3, 4).reshape(end - start, -1).to(self.carried_dtype)

    @torch.inference_mode()
    def carry_in(self, seq_id: int, token_ids: list[int], start: int, features: torch.Tensor) -> None:
        n = features.shape[0]
        kv = features.to(self.device).view(n, *self._row).permute(1, 2, 0, 3, 4)
        c = self._contexts[seq_id] = _Context(start, kv.new_empty(*kv.shape[:2], 2 * n + 2, *kv.shape[3:]))
        c.put(start, kv)

    @torch.inference_mode()
    def _context_kv(self, features: torch.Tensor, start: int) -> torch.Tensor:
        """The context rows [layers, 2, n, kv heads, head dim] of positions ``start``.. from their features."""
        positions = torch.arange(start, start + features.shape[0], device=self.device)
        return torch.stack([torch.stack(pair) for pair in self.drafter.context_kv(features, positions)])

    def release(self, seq_id: int) -> None:
        self._contexts.pop(seq_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], features=None) -> Drafts:
        rows = []  # (request, its context) of those whose positions before the anchor the target gave
        for r in requests:
            c = self._contexts.get(r.seq_id)
            if c is not None and c.start < len(r.token_ids) - 1 <= c.end:
                rows.append((r, c))
        drafts: dict[int, tuple[list[int], list[float]]] = {r.seq_id: ([], []) for r in requests}
        runs = self._runs_block(bool(rows))
        if rows:
            for (r, _), ids, conf in zip(rows, *self._draft(rows)):
                drafts[r.seq_id] = (ids[:r.k], conf[:r.k])
        elif runs:  # the other ranks' blocks: this rank's part of their MoE exchanges
            idle_forward(self.drafter)
        return Drafts([drafts[r.seq_id][0] for r in requests], confidence=[drafts[r.seq_id][1] for r in requests])

    def idle(self) -> None:
        if self._runs_block(False):
            idle_forward(self.drafter)

    def _runs_block(self, drafting: bool) -> bool:
        """Whether this step runs the block: where this rank drafts, under data-parallel attention
        with a drafter whose MoE spans the ranks where any rank does."""
        if self.lockstep is None:
            return drafting
        return bool(self.lockstep.all_reduce(torch.tensor([int(drafting)], device=self.device), "max").item())

    def _draft(self, rows: list[tuple[DraftRequest, _Context]]) -> tuple[list[list[int]], list[list[float]]]:
        """One block per row over its context rows before the anchor, padded to the longest."""
        lengths = [len(r.token_ids) - 1 - c.start for r, c in rows]
        width = max(lengths)
        first = rows[0][1].rows
        ctx = first.new_zeros(first.shape[0], 2, len(rows), width, *first.shape[3:])
        for i, ((_, c), n) in enumerate(zip(rows, lengths)):
            ctx[:, :, i, :n] = c.rows[:, :, :n]
        valid = torch.arange(width, device=self.device) < torch.tensor(lengths, device=self.device).unsqueeze(1)
        anchors = torch.tensor([r.token_ids[-1] for r, _ in rows], device=self.device)
        at = torch.tensor([len(r.token_ids) - 1 for r, _ in rows], device=self.device)
        hidden = self.drafter.block(anchors, at, [(layer[0], layer[1]) for layer in ctx], valid)
        tokens, conf = self.drafter.draft(hidden, anchors, max(r.k for r, _ in rows))
        return tokens.tolist(), conf.float().tolist()
