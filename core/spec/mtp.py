"""The MTP proposer: DeepSeek-V4's next-n layer (core/models/deepseek_v4/nextn.py) drafts ``k``
tokens autoregressively, from the target's residual streams and its own. The layer is the
checkpoint's own (``mtp.*`` tensors) or, with ``speculative_config.model``, one trained for it
(``engine train-drafter``, drafter.py).

At position ``p`` the layer reads the target's streams at ``p`` and the token ``x[p + 1]`` and
predicts ``x[p + 2]``. The target hands back its streams for every token it computes (prefill
chunks, decodes, verify rows: ``observe``); before drafting, a sequence catches up over the
positions the target computed since (one ragged row), whose last predicts the first draft; each
draft is then fed back with the layer's own output streams for the next. The layer's KV pages are
its own (a KV manager of its own, prefix cache included): a position's KV depends on the token
after it, so the cache is keyed by pairs of neighbouring tokens. Positions computed from the
layer's own streams are rolled back at the next catch-up and recomputed from the target's (the
target's streams there are known by then). The layer continues only from positions it holds, so a
sequence the scheduler admits starts from the layer's prefix cache first (``admit``), and the
target's prefix hit ends where the layer's does: the target computes the rest again and hands back
its streams there (a second chat turn, whose first turn the layer cached up to its last catch-up,
recomputes at most the pages between that and the target's end).

Under data-parallel attention (core/distributed/dp_attention.py) the layer's MoE spans every
rank, as the target's MoE layers do: each of its forwards is an exchange every rank joins. A rank
drafts its own requests, so the ranks first agree on the step's number of drafting forwards (the
most drafts any rank's request takes, one forward each), and a rank with fewer, or none
(``idle``), runs the rest with no tokens.

Under tensor parallelism (or a data-parallel rank's attention split over its processes) the layer
holds the target's slices, so every process of the attention group runs each drafting forward: the
one that schedules sends the others its host data (``Draft``; ``DraftCount`` to join the ranks'
count) and broadcasts the streams it feeds in, which only it keeps; the layer's KV manager is its
alone, its page ids the others' too (``follow``).

Under prefill/decode disaggregation (core/disagg/) the decode engine computes only a prompt's last
token, so the prefill engine, started with the same ``speculative_config``, sends the target's
streams of the positions before it that the layer's window reaches (``carried``: its reach and one
more, for a published page-aligned end one short) with the KV. The layer is a sliding-attention
layer, its KV only its window (no bytes per page), so the decode engine's layer holds the positions
before those as imported, unwritten (``carry_in``), and its first catch-up over the carried
positions leaves it exactly where computing the whole prompt would: rows that read the unwritten
positions are not the row it drafts from, and no cached end reaches back to them. The prefill
engine keeps only the streams it sends of a prompt, and its prefix hits end
where those are computed again (``admit``, within the scheduler's recompute bound; a longer hit
sends none, and the decode engine goes without drafts for that request).
"""

from __future__ import annotations

import logging

import torch

from ..distributed.messages import Draft, DraftCount
from ..distributed.moe import idle_forward
from ..families.spec import DraftRequest, Drafts
from ..forward import ForwardBatch
from ..runner import StepInputs
from .config import SpecConfigError
from .draft_model import DraftSeq, OwnKVProposer
from .drafting_group import DraftingGroup

logger = logging.getLogger(__name__)

ARCHITECTURE = "DeepseekV4ForCausalLM"


def mtp_reasons(ctx) -> list[str]:
    """Why the target cannot draft with its next-n layers."""
    from ..models.deepseek_v4.nextn import checkpoint_has_nextn

    from .drafter import drafter_reasons
    from .dspark.stages import has_dspark

    spec, target = ctx.engine_config.speculative_config, ctx.model_config
    if target is None:
        return []
    if target.architecture != ARCHITECTURE:
        return [f"MTP runs DeepSeek-V4's next-n layers; {target.architecture} has none"]
    if not target.get("num_nextn_predict_layers"):
        return ["the model's config.json has no next-n layers (num_nextn_predict_layers is 0)"]
    if has_dspark(target.hf) and (spec is None or spec.model is None):
        return ["the checkpoint's mtp.* layers are DSpark stages (config.json has dspark_block_size), not next-n "
                "layers: speculative_config.method 'dspark' drafts with them"]
    if spec is not None and spec.model is not None:  # a next-n layer trained for it (engine train-drafter)
        return drafter_reasons(spec.model, "mtp", target.path)
    if not checkpoint_has_nextn(target.path):
        return [f"the checkpoint in {target.path} has no mtp.* tensors, though num_nextn_predict_layers is "
                f"{target.get('num_nextn_predict_layers')}: it has no next-n layer to draft with"]
    return []


class MTPProposer(OwnKVProposer):
    name = "mtp"
    feature = "streams"

    def __init__(self, ctx) -> None:
        from ..models.deepseek_v4.nextn import build_nextn
        from ..startup import proposer_kv
        from .drafter import load_drafter

        super().__init__(ctx)
        config, target = ctx.engine_config, ctx.target
        spec = config.speculative_config
        k = spec.num_speculative_tokens
        try:
            self.layer = build_nextn(target, load_drafter(spec.model) if spec.model is not None else None)
        except Exception as exc:
            raise SpecConfigError("method", f"the checkpoint's next-n layer does not load: "
                                            f"{type(exc).__name__}: {exc}") from exc
        target.mtp.clear()  # the layer holds them now
        device = target.head.weight.device
        self.device, self.vocab = device, ctx.model_config.vocab_size
        self.cache, self.kv = proposer_kv(config, self.layer, device, ctx.model_config.dtype,
                                          ctx.model_config.max_model_len, k)
        self.target = target
        self.group = DraftingGroup(target, self.layer, device)  # whom its forwards meet
        self._streams = (ctx.model_config.get("hc_mult", 4), ctx.model_config.get("hidden_size"))
        self._features: dict[int, tuple[int, torch.Tensor]] = {}  # seq id -> (first position, streams from it)
        disagg = config.disaggregation
        self._prefill = disagg is not None and disagg.mode == "prefill"
        if disagg is not None:
            self.carried = self.kv.window_reach + 1
            self.carried_row = self._streams[0] * self._streams[1]
            self.carried_dtype = ctx.model_config.dtype
        logger.info("MTP: DeepSeek-V4's next-n layer drafts %d tokens a step", k)

    def observe(self, seq_id: int, start: int, features: torch.Tensor) -> None:
        had = self._features.get(seq_id)
        if had is not None and had[0] <= start <= had[0] + len(had[1]):
            features = torch.cat([had[1][:start - had[0]], features])
            start = had[0]
        keep = self.carried + 1  # a prefill engine sends those before the prompt's last position
        if self._prefill and len(features) > keep:
            start, features = start + len(features) - keep, features[-keep:]
        self._features[seq_id] = (start, features)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child's catch-up starts from the parent's streams of the prompt (its own positions
        after the prompt come with its own steps), and from the layer's KV the parent holds."""
        if (had := self._features.get(parent_id)) is not None:
            self._features[child_id] = had
        p = self._seqs.get(parent_id)
        if p is not None and self.kv.state(p) is not None:
            child = DraftSeq(child_id, p.prompt_token_ids, p.tokens[:p.real], p.real, p.imported)
            if self.kv.fork(p, child, p.real):
                self._seqs[child_id] = child

    def admit(self, seq_id: int, token_ids: list[int]) -> int:
        if self._prefill:  # the layer never runs here: the target computes the carried positions
            return max(0, len(token_ids) - 1 - self.carried)
        return self._start(seq_id, token_ids).real

    def carried_features(self, seq_id: int, start: int, end: int) -> torch.Tensor | None:
        had = self._features.get(seq_id)
        if had is None or had[0] > start or had[0] + len(had[1]) < end:
            return None
        return had[1][start - had[0]:end - had[0]].to(self.carried_dtype)

    def carry_in(self, seq_id: int, token_ids: list[int], start: int, features: torch.Tensor) -> None:
        s = self._start(seq_id, token_ids)
        if s.real < start:  # the layer's cache holds less: the positions before ``start`` held unwritten
            self.kv.free(s, cache=False)
            if self.kv.import_pages(s, s.prompt_token_ids[:start]) is None:
                del self._seqs[seq_id]  # no pages: it goes without drafts
                return
            s.tokens, s.real, s.imported = s.prompt_token_ids[:start], start, start
        self._features[seq_id] = (start, features.view(-1, *self._streams).to(self.device))

    def release(self, seq_id: int) -> None:
        self._features.pop(seq_id, None)
        super().release(seq_id)

    def propose(self, requests: list[DraftRequest], features=None) -> Drafts:
        drafts: dict[int, list[int]] = {r.seq_id: [] for r in requests}
        rows, ids, keys, streams = [], [], [], []
        for r in requests:
            row = self._catch_up(r)
            if row is not None:
                rows.append(r)
                ids.append(row[0])
                keys.append(row[1])
                streams.append(row[2])
        for _ in range(self.group.count(max((r.k for r in rows), default=0))):
            if not rows:  # this rank's drafts are done: the others' forwards go on
                self.group.idle()
                continue
            out, last = self._forward([self._seqs[r.seq_id] for r in rows], ids, keys, torch.cat(streams))
            for r, t in zip(rows, out):
                drafts[r.seq_id].append(t)
            more = [i for i, r in enumerate(rows) if len(drafts[r.seq_id]) < r.k]
            rows = [rows[i] for i in more]
            keys = [[ids[i][-1] * self.vocab + out[i]] for i in more]
            ids = [[out[i]] for i in more]
            streams = [last[i:i + 1] for i in more]
        return Drafts([drafts[r.seq_id] for r in requests])

    def idle(self) -> None:
        for _ in range(self.group.count(0)):
            self.group.idle()

    def lead(self, peers) -> None:
        self.group.lead(peers)

    def follow(self, message: Draft | DraftCount) -> None:
        if isinstance(message, DraftCount):
            self.group.count(0)
        elif message.inputs is None:
            idle_forward(self.layer)
        else:
            for page, window in message.inputs.windows:
                self.cache.stage_window(page, window)
            self._run(message.inputs)

    def _catch_up(self, r: DraftRequest) -> tuple[list[int], list[int], torch.Tensor] | None:
        """The catch-up row of ``r``: the tokens x[p + 1], their pair keys and the target's streams
        at p, for the positions p the layer has not computed from the target's streams; its pages
        (and those of the drafts fed back) allocated. None where it cannot draft this step."""
        tokens, v = r.token_ids, self.vocab
        n = len(tokens)
        s = self._seqs.get(r.seq_id) or self._start(r.seq_id, tokens[:n - 1])
        if len(s.tokens) > s.real:  # positions computed from its own streams
            self._rollback(s, s.real)
        held = s.real
        if held >= n - 1:  # no new token since its last catch-up (a step whose tokens never came, as under
            return None  # preemption): the streams its first draft needs are spent; it drafts once the target moves on
        start, feats = self._features.get(r.seq_id, (n, None))
        if feats is None or start > held or start + len(feats) < n - 1:
            self.release(r.seq_id)
            return None
        if self.kv.allocate(s, n - 1 - held + r.k - 1) is None:
            self.release(r.seq_id)
            return None
        row = feats[held - start:n - 1 - start]
        self._features[r.seq_id] = (n - 1, feats[n - 1 - start:])
        s.real = n - 1
        return tokens[held + 1:], [tokens[p] * v + tokens[p + 1] for p in range(held, n - 1)], row

    def _start(self, seq_id: int, tokens: list[int]) -> DraftSeq:
        """The layer's sequence of the positions whose next token ``tokens`` holds, from the
        longest prefix of them its cache holds."""
        v = self.vocab
        keys = [a * v + b for a, b in zip(tokens, tokens[1:])]
        s = self._seqs[seq_id] = DraftSeq(seq_id, keys, [])
        s.tokens = keys[:self.kv.match_prefix(s, keys)]
        s.real = len(s.tokens)
        self.kv.record_lookup(len(keys), s.real)
        return s

    def _forward(self, seqs: list[DraftSeq], ids: list[list[int]], keys: list[list[int]],
                 streams: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Each sequence's ``ids`` after the positions it holds, with the streams before them, in one
        batch: the layer's greedy token after each sequence's last, and its output streams there."""
        context = [len(s.tokens) for s in seqs]
        query = [len(i) for i in ids]
        width = -(-max(c + q for c, q in zip(context, query)) // self.kv.page_size)
        tables = self.kv.page_table.gather([self.kv.state(s).row for s in seqs], width)
        ends = torch.tensor(query).cumsum(0).sub(1).tolist()
        inputs = StepInputs([t for i in ids for t in i], query, context, tables, ends, [], self.kv.take_page_copies(),
                            self.cache.staged_windows() if self.group.peers is not None else [])
        self.group.send(Draft(inputs))
        tokens, out = self._run(inputs, streams)
        for s, k in zip(seqs, keys):
            s.tokens += k
            self.kv.commit(s, len(s.tokens))
        return tokens, out

    @torch.inference_mode()
    def _run(self, inputs: StepInputs, streams: torch.Tensor | None = None) -> tuple[list[int], torch.Tensor]:
        """One forward of the layer: the greedy tokens and output streams at ``inputs.logits_indices``.
        Under tensor parallelism every process of the attention group runs it, each its heads and
        slices, with the leader's ``streams`` (None on the others) broadcast: they hold none of them."""
        if inputs.page_copies:
            src, dst = zip(*inputs.page_copies)
            self.cache.copy_pages(list(src), list(dst))
        # the layer reads them in its dtype
        streams = self.group.broadcast(streams, (len(inputs.input_ids), *self._streams), self.layer.dtype)
        batch = ForwardBatch.build(inputs.input_ids, inputs.query_lens, inputs.context_lens, inputs.tables,
                                   self.kv.page_size, inputs.logits_indices, device=self.device)
        out, hidden = self.layer(batch, self.cache, streams)
        ends = batch.logits_indices
        return self.target.compute_logits(hidden[ends]).argmax(dim=-1).tolist(), out[ends]
