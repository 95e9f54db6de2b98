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
with the next verification. Whole pages of final positions are also kept by token prefix
(prefix_rows.py; under the hierarchical cache they go below the device with the target's pages and
come back with a hit there, tier_rows.py), so a prefix hit starts from the rows of the hit
(``admit``: the target's hit is cut back to where they end, within the scheduler's recompute bound; a longer hit gives the target's
features from its end on only, and the block reads what there is). An n > 1 sibling forks its
parent's context of the prompt (``fork``).

Under prefill/decode disaggregation (core/disagg/) the decode engine computes only a prompt's last
token, so the prefill engine, started with the same ``speculative_config``, sends the context rows
of every position before it with the KV (``carried``): the drafter's keys and values, not the
target's features they are computed from, as they are smaller (the trained drafter's 512 elements
a position against 3072 features) and exactly the rows a colocated engine computes. A prompt the
prefill engine took partly from its prefix cache sends the rows kept for the hit with the rest;
only a hit past the kept rows by more than the recompute bound sends none (the decode engine then
drafts from the positions it computes).

Under tensor parallelism the target's features are whole on every rank after its all-reduces, and
the scheduling rank alone keeps the context rows. A trained drafter's own layers have no
collectives: that rank alone drafts, with whole copies of the target's embedding and LM head
(weights.py). The stages hold the target's slices (stages.py), so every process of the attention
group runs each block (core/spec/drafting_group.py): the scheduling one sends the others its host
data (``DraftBlock``) and broadcasts the block's context rows, which only it keeps. Under
data-parallel attention each rank drafts its own requests; the stages' MoE spans every rank, as the
target's MoE layers do, so the ranks first agree whether the step runs a block, and a rank with none
to draft (``idle``) runs the stages with no tokens, its attention group with it.
"""

from __future__ import annotations

import logging

import torch

from ...distributed.messages import Draft, DraftBlock, DraftCount
from ...distributed.moe import idle_forward
from ...families.spec import DraftRequest, Drafts, SpecProposer
from ..config import SpecConfigError
from ..drafting_group import DraftingGroup
from .prefix_rows import PrefixRows
from .stages import build_stages, has_dspark, stage_reasons
from .tier_rows import TierRows, drafter_identity
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
        one = self._context_kv(torch.zeros(1, shape.feature_size, device=self.device), 0)
        self._row, self._row_dtype = one[:, :, 0].shape, one.dtype  # a position's rows [layers, 2, kv heads, hd]
        if ctx.engine_config.disaggregation is not None:  # the whole prompt's context rows move
            self.carried, self.carried_row, self.carried_dtype = ctx.engine_config.max_model_len, one.numel(), one.dtype
        self.group = DraftingGroup(target, self.drafter, self.device, self.drafter.split)  # whom its blocks meet
        config = ctx.engine_config
        per_seq = -(-(config.max_model_len or ctx.model_config.max_model_len) // config.page_size)
        self.prefixes = PrefixRows(config.page_size, config.max_num_seqs * per_seq if config.enable_prefix_caching
                                   else 0)
        logger.info("DSpark: a block of %d from target layers %s, %d drafts a step at most", shape.block_size,
                    list(shape.target_layer_ids), spec.num_speculative_tokens)

    @torch.inference_mode()
    def observe(self, seq_id: int, start: int, features: torch.Tensor) -> None:
        kv = self._context_kv(features, start)
        c = self._contexts.get(seq_id)
        if c is None or not c.start <= start <= c.end:
            c = self._contexts[seq_id] = _Context(start, kv.new_empty(*kv.shape[:2], 2 * kv.shape[2], *kv.shape[3:]))
        c.put(start, kv)

    def settled(self, seq_id: int, token_ids: list[int], end: int) -> None:
        if (c := self._contexts.get(seq_id)) is not None:
            self.prefixes.keep(seq_id, token_ids, min(end, c.end), c.start, c.rows)

    def admit(self, seq_id: int, token_ids: list[int]) -> int:
        """The context of the longest prefix of ``token_ids`` whose rows are kept: a hit drafts as
        computing it would, where the target's hit ends there too."""
        rows = self.prefixes.lookup(seq_id, token_ids)
        if rows is None:
            return 0
        self._contexts[seq_id] = c = _Context(0, rows.new_empty(*rows.shape[:2], 2 * rows.shape[2], *rows.shape[3:]))
        c.put(0, rows)
        return c.end

    def reset_prefix_cache(self) -> None:
        self.prefixes.clear()

    def page_rows(self) -> TierRows:
        return TierRows(self.prefixes, self._row, self._row_dtype, self.device,
                        drafter_identity(METHOD, self.drafter, self._row_dtype))

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
        self.prefixes.forget(seq_id)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], features=None) -> Drafts:
        rows = []  # (request, its context) of those whose positions before the anchor the target gave
        for r in requests:
            c = self._contexts.get(r.seq_id)
            if c is not None and c.start < len(r.token_ids) - 1 <= c.end:
                rows.append((r, c))
        drafts: dict[int, tuple[list[int], list[float]]] = {r.seq_id: ([], []) for r in requests}
        runs = self.group.count(int(bool(rows)))  # whether this step runs a block, here or on any rank
        if rows:
            for (r, _), ids, conf in zip(rows, *self._draft(rows)):
                drafts[r.seq_id] = (ids[:r.k], conf[:r.k])
        elif runs:  # the other ranks' blocks: this rank's part of their MoE exchanges
            self.group.idle()
        return Drafts([drafts[r.seq_id][0] for r in requests], confidence=[drafts[r.seq_id][1] for r in requests])

    def idle(self) -> None:
        if self.group.count(0):
            self.group.idle()

    def lead(self, peers) -> None:
        self.group.lead(peers)  # where the stages are split: a trained drafter drafts here alone

    @torch.inference_mode()
    def follow(self, message: Draft | DraftBlock | DraftCount) -> None:
        if isinstance(message, DraftCount):
            self.group.count(0)
        elif isinstance(message, Draft):
            idle_forward(self.drafter)
        else:
            self._block(message)

    def _draft(self, rows: list[tuple[DraftRequest, _Context]]) -> tuple[list[list[int]], list[list[float]]]:
        """One block per row over its context rows before the anchor, padded to the longest."""
        block = DraftBlock([r.token_ids[-1] for r, _ in rows], [len(r.token_ids) - 1 for r, _ in rows],
                           [len(r.token_ids) - 1 - c.start for r, c in rows], max(r.k for r, _ in rows))
        first = rows[0][1].rows
        ctx = first.new_zeros(first.shape[0], 2, len(rows), max(block.context_lens), *first.shape[3:])
        for i, ((_, c), n) in enumerate(zip(rows, block.context_lens)):
            ctx[:, :, i, :n] = c.rows[:, :, :n]
        self.group.send(block)
        return self._block(block, ctx)

    def _block(self, block: DraftBlock, ctx: torch.Tensor | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """The drafts and confidences of ``block`` over the context rows ``ctx`` [layers, 2, N, C, kv
        heads, hd] (the leader's, broadcast to the others of the attention group, which hold none)."""
        n, width = len(block.anchors), max(block.context_lens)
        layers, _, *head = self._row
        ctx = self.group.broadcast(ctx, (layers, 2, n, width, *head), self._row_dtype)
        lengths = torch.tensor(block.context_lens, device=self.device)
        valid = torch.arange(width, device=self.device) < lengths.unsqueeze(1)
        anchors = torch.tensor(block.anchors, device=self.device)
        at = torch.tensor(block.positions, device=self.device)
        hidden = self.drafter.block(anchors, at, [(layer[0], layer[1]) for layer in ctx], valid)
        tokens, conf = self.drafter.draft(hidden, anchors, block.k)
        return tokens.tolist(), conf.float().tolist()
