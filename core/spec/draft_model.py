"""The draft-model proposer: a smaller model the engine loads drafts ``k`` tokens for each decode,
one forward of the whole batch per token. It drafts greedily, so its distribution is one-hot on
each draft and verification keeps a draft with the target's probability of it: lossless at any
temperature, and at temperature 0 a draft is kept where it is the target's argmax.

The draft keeps its own KV cache through its own KV manager (prefix cache included): per target
sequence a draft sequence of the tokens whose KV it holds. Before drafting, a sequence catches up:
the tokens the target has and the draft has not computed (the whole prompt the first time, then
the target's own token after the kept drafts) run as one ragged row; then each draft but the last
is fed back for the next. The drafts fed back that the target did not keep are rolled back when
the sequence next catches up (the tokens it then has say which it kept); a sequence the target
lets go (finished, aborted, preempted) gives its draft KV back (``release``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..config import ModelConfig
from ..families.spec import DraftRequest, Drafts, SpecProposer
from ..runner import ModelRunner, StepInputs
from ..tokenizer import Tokenizer
from .config import SpecConfigError

logger = logging.getLogger(__name__)


def draft_reasons(ctx) -> list[str]:
    """Why ``speculative_config.model`` cannot draft for the target: none given, no model there,
    another vocabulary or tokenizer, or a context shorter than the target's."""
    spec = ctx.engine_config.speculative_config
    if spec is None or spec.model is None:
        return ["speculative_config.model: a draft model needs its checkpoint directory"]
    target = ctx.model_config
    try:
        draft = ModelConfig.from_dir(spec.model)
    except (OSError, ValueError) as exc:
        return [f"speculative_config.model: {exc}"]
    if target is None:
        return []
    if draft.vocab_size != target.vocab_size:
        return [f"speculative_config.model: the draft's vocabulary has {draft.vocab_size} ids, the target's "
                f"{target.vocab_size}"]
    if draft.hf.get("max_position_embeddings", 4096) < target.max_model_len:
        return [f"speculative_config.model: the draft holds {draft.hf.get('max_position_embeddings')} positions, "
                f"fewer than max_model_len {target.max_model_len}"]
    try:
        same = _vocab(target.path) == _vocab(draft.path)
    except (OSError, ValueError, KeyError) as exc:
        return [f"speculative_config.model: its tokenizer does not load: {exc}"]
    if not same:
        return ["speculative_config.model: the draft's tokenizer is not the target's (its tokens have other ids)"]
    return []


def _vocab(path: Path) -> tuple[dict[str, int], int | None]:
    tok = Tokenizer.from_dir(path)
    return tok.backend.get_vocab(with_added_tokens=True), tok.eos_token_id


@dataclass(eq=False)
class DraftSeq:
    """A target sequence as the draft's KV manager reads it: its id and the tokens whose KV the
    draft holds (``prompt_token_ids``: those it started with, which its prefix cache may keep)."""

    seq_id: int
    prompt_token_ids: list[int]
    tokens: list[int]
    real: int = 0  # how many of ``tokens`` are the target's (the rest: drafts it fed back)
    imported: int = 0  # its first tokens whose KV it holds unwritten (the next-n layer's, under PD: mtp.py)


class OwnKVProposer(SpecProposer):
    """A proposer that keeps KV of its own through a KV manager (``self.kv``), per target sequence a
    draft sequence: what letting a sequence go and rolling one back mean for it."""

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.kv = None  # the subclass's KV manager
        self._seqs: dict[int, DraftSeq] = {}

    def release(self, seq_id: int) -> None:
        """Give the sequence's draft KV back, its target's tokens to the draft's prefix cache (never
        a draft the target has not kept)."""
        s = self._seqs.pop(seq_id, None)
        if s is not None and self.kv.state(s) is not None:  # (one that matched nothing and ran nothing has none)
            if s.real < len(s.tokens):
                self._rollback(s, s.real)
            # never a window that reaches back to KV it did not write (a hit at its end would read it)
            self.kv.free(s, cache=not s.imported or s.real > s.imported + self.kv.window_reach)

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()
        self.kv.reset_stats()

    def _rollback(self, s: DraftSeq, num_tokens: int) -> None:
        self.kv.rollback(s, num_tokens)
        del s.tokens[num_tokens:]


class DraftModelProposer(OwnKVProposer):
    name = "draft_model"

    def __init__(self, ctx) -> None:
        from ..startup import build  # the draft is built as the target is

        super().__init__(ctx)
        config = ctx.engine_config
        spec = config.speculative_config
        draft_config = replace(config, model=spec.model, speculative_config=None, enable_hierarchical_cache=False,
                               hicache_storage_backend=None, disaggregation=None, tensor_parallel_size=1,
                               data_parallel_size=1, enable_dp_attention=False, expert_parallel=False,
                               enforce_eager=True, warmup=False, window_pages=None)
        try:  # drafts of one step are rolled back together: up to k - 1 fed back, then the catch-up row's end
            c = build(draft_config, progress=False, max_rollback=spec.num_speculative_tokens)
        except Exception as exc:
            raise SpecConfigError("model", f"the draft model {spec.model} does not load: "
                                           f"{type(exc).__name__}: {exc}") from exc
        self.kv = c.kv_manager
        self.runner = ModelRunner(c.model, c.kv, None, c.kv_manager.page_table, config.page_size, c.device)
        logger.info("draft model %s (%s) drafts %d tokens a step", spec.model, c.model_config.architecture,
                    spec.num_speculative_tokens)

    def propose(self, requests: list[DraftRequest], features=None) -> Drafts:
        drafts: dict[int, list[int]] = {r.seq_id: [] for r in requests}
        rows = [r for r in requests if self._catch_up(r)]
        feeds = [r.token_ids[len(self._seqs[r.seq_id].tokens):] for r in rows]
        for r in rows:
            self._seqs[r.seq_id].real = len(r.token_ids)
        while rows:
            ids = self._forward([self._seqs[r.seq_id] for r in rows], feeds)
            for r, t in zip(rows, ids):
                drafts[r.seq_id].append(t)
            more = [i for i, r in enumerate(rows) if len(drafts[r.seq_id]) < r.k]
            rows, feeds = [rows[i] for i in more], [[ids[i]] for i in more]
        return Drafts([drafts[r.seq_id] for r in requests])

    def _catch_up(self, r: DraftRequest) -> bool:
        """Pages for ``r``'s catch-up row and the drafts fed back, the draft holding a prefix of its
        tokens (from its prefix cache the first time; its drafts past the ones the target kept
        rolled back), at least the last token left to run. False where the pages ran short: it then
        holds nothing and drafts nothing this step."""
        tokens = r.token_ids
        s = self._seqs.get(r.seq_id)
        if s is None:
            s = self._seqs[r.seq_id] = DraftSeq(r.seq_id, tokens[:-1], [])
            s.tokens = tokens[:self.kv.match_prefix(s, tokens[:-1])]
            s.real = len(s.tokens)
            self.kv.record_lookup(len(tokens) - 1, s.real)
        same = s.real  # the drafts it fed back are kept as far as the target kept them
        while same < min(len(s.tokens), len(tokens) - 1) and s.tokens[same] == tokens[same]:
            same += 1
        if same < len(s.tokens):
            self._rollback(s, same)
        if self.kv.allocate(s, len(tokens) - same + r.k - 1) is None:
            self.release(r.seq_id)
            return False
        return True

    @torch.inference_mode()
    def _forward(self, seqs: list[DraftSeq], feeds: list[list[int]]) -> list[int]:
        """Each sequence's ``feeds`` run after the tokens it holds, in one batch: the draft's greedy
        token after each."""
        context = [len(s.tokens) for s in seqs]
        query = [len(f) for f in feeds]
        width = -(-max(c + q for c, q in zip(context, query)) // self.kv.page_size)
        tables = self.kv.page_table.gather([self.kv.state(s).row for s in seqs], width)
        ends = torch.tensor(query).cumsum(0).sub(1).tolist()
        inputs = StepInputs([t for f in feeds for t in f], query, context, tables, ends, [],
                            self.kv.take_page_copies())
        ids = self.runner.run(inputs).argmax(dim=-1).tolist()
        for s, f in zip(seqs, feeds):
            s.tokens += f
            self.kv.commit(s, len(s.tokens))
        return ids
