"""The draft-model proposer end to end: tiny-qwen3-py drafting for tiny-dsv4-py (and for itself)
gives greedy output identical to decoding without speculation over chunked prefill, prefix hits,
n=2, preemption and aborts; drafting for itself nearly every draft is kept; every page of both KV
caches comes back; a draft that cannot serve is refused at start-up with the reason."""

from __future__ import annotations

import json
import random

import pytest

from engine import LLM, SamplingParams
from engine.core.spec.config import SpecConfigError
from test_spec_decode import PAGE, assert_cached_real, assert_clean, completions, greedy, repetitive, run_with_aborts, text_ids


def make(path, draft=None, k=3, **kw) -> LLM:
    opts = dict(dtype="float32", page_size=PAGE, num_pages=400, chunked_prefill_size=16, max_num_seqs=8,
                progress=False)
    spec = {"method": "draft_model", "num_speculative_tokens": k, "model": str(draft)} if draft else None
    return LLM(str(path), speculative_config=spec, **{**opts, **kw})


@pytest.fixture(scope="module")
def models(shared_dir):
    return shared_dir / "models" / "tiny-dsv4-py", shared_dir / "models" / "tiny-qwen3-py"


@pytest.fixture(scope="module")
def dsv4_pair(models):
    """(tiny-dsv4-py without speculation or prefix cache: the reference; with tiny-qwen3-py drafting)"""
    target, draft = models
    return make(target, enable_prefix_caching=False), make(target, draft)


def draft_kv(llm: LLM):
    return llm.engine.speculator.proposer.kv


class DraftsFreed:
    """Records the tokens whose KV each draft sequence held when it gave its pages back (what the
    draft's prefix cache may keep of it)."""

    def __init__(self, llm: LLM) -> None:
        self.kv, self.held = draft_kv(llm), []

    def __enter__(self) -> DraftsFreed:
        free = self.kv.free

        def spied(seq, cache=True):
            self.held.append(list(seq.tokens[:self.kv.state(seq).num_tokens]))
            return free(seq, cache)
        self.kv.free = spied
        return self

    def __exit__(self, *exc) -> None:
        del self.kv.free

    def assert_real(self, sequences: list[list[int]]) -> None:
        assert self.held and all(any(s[:len(h)] == h for s in sequences) for h in self.held)


def assert_both_clean(llm: LLM, sequences: list[list[int]], keys=lambda s: s) -> None:
    """The target's pages back (assert_clean), and the draft's: it holds no sequence, every page not
    free is its prefix cache's, which holds real tokens only (no rejected draft), and all come back
    when that is reset. ``keys``: a sequence as the draft's cache keys it."""
    assert_clean(llm, sequences)
    kv = draft_kv(llm)
    kv.check_consistency()
    assert not llm.engine.speculator.proposer._seqs
    stats = kv.stats()
    assert stats.num_used == stats.num_cached
    assert_cached_real(kv, [keys(s) for s in sequences])
    kv.reset_prefix_cache()
    assert kv.stats().num_free == kv.stats().num_usable


def test_greedy_equals_decoding_without_drafts_over_chunks_prefix_hits_and_n2(dsv4_pair, eval_text, seed):
    plain, spec = dsv4_pair
    prompts = [repetitive(plain, eval_text) for _ in range(2)] + [text_ids(plain, eval_text, 30) for _ in range(2)]
    params = [greedy(random.randint(12, 30), n=random.choice([1, 2])) for _ in prompts]
    params[0] = greedy(24, n=2)
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert completions(got) == completions(want)
    counters = spec.engine.speculator.counters
    assert counters.num_accepted_tokens > 0 and counters.num_drafts > 0
    hits_before = draft_kv(spec).stats().prefix_hits
    again = spec.generate(prompts, params)  # every prompt now hits both prefix caches
    assert all(o.num_cached_tokens > 0 for o in again) and draft_kv(spec).stats().prefix_hits > hits_before
    assert completions(again) == completions(want)
    assert_both_clean(spec, [o.prompt_token_ids + c.token_ids for o in want for c in o.outputs])


def test_a_model_drafting_for_itself_has_nearly_every_draft_kept(models, eval_text, seed):
    _, qwen = models
    spec = make(qwen, qwen, k=4)
    prompts = [text_ids(spec, eval_text, 24) for _ in range(3)]
    params = greedy(20)
    got = spec.generate(prompts, params)
    c = spec.engine.speculator.counters
    assert c.num_draft_tokens >= 30 and c.acceptance_rate >= 0.95, c
    assert completions(got) == completions(make(qwen, enable_prefix_caching=False).generate(prompts, params))


def test_greedy_equals_decoding_without_drafts_under_preemption(models, dsv4_pair, eval_text, seed):
    target, draft = models
    plain, _ = dsv4_pair
    spec = make(target, draft, num_pages=36, max_num_batched_tokens=64)
    prompts = [repetitive(plain, eval_text) for _ in range(4)]
    params = greedy(24)
    with DraftsFreed(spec) as freed:
        got = spec.generate(prompts, params)
    assert spec.engine.stats().num_preemptions > 0 and spec.engine.speculator.counters.num_accepted_tokens > 0
    want = plain.generate(prompts, params)
    assert completions(got) == completions(want)
    sequences = [o.prompt_token_ids + c.token_ids for o in want for c in o.outputs]
    freed.assert_real(sequences)  # a preempted sequence's drafts among them
    assert_both_clean(spec, sequences)


def test_aborts_and_sampling_beside_greedy_leave_the_others_unchanged_and_every_page_back(dsv4_pair, eval_text, seed):
    plain, spec = dsv4_pair
    spec.engine.kv_manager.reset_prefix_cache()  # what earlier tests left
    draft_kv(spec).reset_prefix_cache()
    prompts = [repetitive(plain, eval_text) for _ in range(4)]
    params = greedy(24)
    abort_after = {i: random.randint(2, 16) for i in random.sample(range(4), 2)}
    with DraftsFreed(spec) as freed:
        got = run_with_aborts(spec, prompts, params, abort_after)
    want = completions(plain.generate(prompts, params))
    freed.assert_real([p + w[0][0] for p, w in zip(prompts, want)])  # drafts the target had not kept rolled back
    for i in range(4):
        tokens, reason = got[f"r{i}"][0][:2]
        if i in abort_after:
            assert reason == "abort" and tokens == want[i][0][0][:len(tokens)] and len(tokens) >= abort_after[i]
        else:
            assert got[f"r{i}"] == want[i]
    assert_both_clean(spec, [p + w[0][0] for p, w in zip(prompts, want)])
    # a sampled request drafted for beside greedy ones: the greedy ones unchanged, its own repeatable by seed
    sampled = SamplingParams(temperature=0.8, seed=seed, max_tokens=16)
    mixed = spec.generate(prompts[:3], [params, sampled, params])
    assert completions([mixed[0], mixed[2]]) == [want[0], want[2]]
    alone = spec.generate([prompts[1]], sampled)
    assert completions(alone) == completions([mixed[1]])
    assert spec.engine.speculator.counters.num_accepted_tokens > 0
    spec.engine.kv_manager.reset_prefix_cache()  # aborted requests' prefixes are in it too
    draft_kv(spec).reset_prefix_cache()
    assert_both_clean(spec, [])


def test_a_sequence_let_go_right_after_drafting_leaves_none_of_its_drafts_cached(dsv4_pair, eval_text, seed):
    """As a preempted one is (the scheduler asks for drafts, then preempts for pages): the draft's
    prefix cache keeps the target's tokens only, its pages all back."""
    from engine.core.families.spec import DraftRequest

    _, spec = dsv4_pair
    proposer = spec.engine.speculator.proposer
    draft_kv(spec).reset_prefix_cache()  # what earlier tests left
    tokens = text_ids(spec, eval_text, random.randint(9, 30))
    with DraftsFreed(spec) as freed:
        drafts = proposer.propose([DraftRequest(10**6, tokens, 3)])
        proposer.release(10**6)
    assert len(drafts.token_ids[0]) == 3 and freed.held == [tokens]
    assert_cached_real(draft_kv(spec), [tokens])


def test_a_second_turn_keeps_the_targets_whole_prefix_hit_and_is_drafted_for(dsv4_pair, eval_text, seed):
    """The draft computes its KV from tokens alone: a turn whose target prefix hit reaches past the
    draft's cache (here emptied) is not cut short, and the draft catches up over the hit itself."""
    plain, spec = dsv4_pair
    spec.engine.kv_manager.reset_prefix_cache()  # what earlier tests left
    first = repetitive(plain, eval_text)
    turn1 = spec.generate([first], greedy(random.randint(8, 16)))[0].outputs[0].token_ids
    draft_kv(spec).reset_prefix_cache()
    second = first + turn1 + text_ids(plain, eval_text, random.randint(5, 12))
    target_hit = spec.engine.kv_manager.radix.match(second[:-1], record=False).num_tokens
    counters = spec.engine.speculator.counters
    before = counters.num_draft_tokens
    got = spec.generate([second], greedy(16))
    assert got[0].num_cached_tokens == target_hit > 0 and counters.num_draft_tokens > before
    assert completions(got) == completions(plain.generate([second], greedy(16)))
    assert_both_clean(spec, [second + got[0].outputs[0].token_ids])


def copy_model(src, dst, config=None, tokenizer=None):
    """A model directory beside ``src``'s weights with its config or tokenizer changed."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    for name, change in (("config.json", config), ("tokenizer.json", tokenizer)):
        if change is not None:
            data = json.loads((src / name).read_text())
            change(data)
            (dst / name).unlink()
            (dst / name).write_text(json.dumps(data))
    return dst


def swap_two_tokens(tok):
    vocab = tok["model"]["vocab"]
    a, b = random.sample([t for t, i in vocab.items() if i > 100], 2)
    vocab[a], vocab[b] = vocab[b], vocab[a]


def test_a_draft_that_cannot_serve_is_refused_at_start_up_with_the_reason(models, tmp_path, seed):
    target, qwen = models
    bad_weights = copy_model(qwen, tmp_path / "bad-weights")
    (bad_weights / "model.safetensors").unlink()
    (bad_weights / "model.safetensors").write_bytes(b"not a checkpoint")
    cases = [
        (copy_model(qwen, tmp_path / "vocab", config=lambda c: c.update(vocab_size=8192)),
         "the draft's vocabulary has 8192 ids, the target's 4096"),
        (copy_model(qwen, tmp_path / "tokenizer", tokenizer=swap_two_tokens),
         "the draft's tokenizer is not the target's"),
        (copy_model(qwen, tmp_path / "short", config=lambda c: c.update(max_position_embeddings=512)),
         "the draft holds 512 positions, fewer than max_model_len 4096"),
        (tmp_path / "missing", "does not exist"),
        (None, "a draft model needs its checkpoint directory"),
    ]
    for draft, reason in cases:
        spec = {"method": "draft_model", "num_speculative_tokens": 2, **({"model": str(draft)} if draft else {})}
        with pytest.raises(SpecConfigError, match="speculative_config.method: 'draft_model' cannot run here") as err:
            LLM(str(target), speculative_config=spec, progress=False, num_pages=64)
        assert reason in str(err.value)
    with pytest.raises(SpecConfigError, match=r"speculative_config\.model: the draft model .* does not load"):
        make(target, bad_weights)
    with pytest.raises(SpecConfigError, match=r"speculative_config\.num_speculative_tokens"):
        make(target, qwen, k=17)


@pytest.mark.gpu
def test_on_cuda_greedy_equals_decoding_without_drafts(models, eval_text, seed):
    """fp32 (in bf16 a verify row and a decode reach the same logits through different kernels):
    the target's graphs and CUDA backends beside the eager draft."""
    target, draft = models
    plain, spec = make(target, device="cuda", enable_prefix_caching=False), make(target, draft, device="cuda")
    prompts = [repetitive(plain, eval_text) for _ in range(3)] + [text_ids(plain, eval_text, 30)]
    params = greedy(24, n=2)
    want = plain.generate(prompts, params)
    assert completions(spec.generate(prompts, params)) == completions(want)
    assert spec.engine.speculator.counters.num_accepted_tokens > 0
    assert_both_clean(spec, [o.prompt_token_ids + c.token_ids for o in want for c in o.outputs])
