"""The MTP proposer end to end on tiny-dsv4-py with a next-n layer beside its checkpoint (random
projections around a copy of one of its decoder blocks: its drafts are poor, and verification
keeps the output the target's): greedy output identical to decoding without speculation over
chunked prefill, prefix hits, n=2, preemption and aborts, every page of both KV caches back; a
checkpoint without mtp.* tensors, a model without next-n layers and a drafter directory refused at
start-up with the reason."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.core.scheduler import RECOMPUTE_FOR_DRAFTS_PAGES
from engine.core.spec.config import SpecConfigError
from test_draft_model import DraftsFreed, assert_both_clean, draft_kv
from test_spec_decode import PAGE, completions, greedy, repetitive, run_with_aborts, text_ids


def write_nextn(src, dst, seed: int) -> None:
    """``src``'s checkpoint linked into ``dst`` with an mtp.safetensors beside it: layer 5's block
    (a sliding-attention MoE layer), random e_proj/h_proj, unit norms and the target's mHC head."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    g = torch.Generator().manual_seed(seed)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        out = {"mtp.0." + k.removeprefix("model.layers.5."): f.get_tensor(k) for k in f.keys()
               if k.startswith("model.layers.5.")}
        out.update({f"mtp.0.hc_head_{p}": f.get_tensor(f"model.hc_head.hc_{p}") for p in ("fn", "base", "scale")})
    d = out["mtp.0.attn_norm.weight"].shape[0]
    out.update({f"mtp.0.{n}.weight": torch.randn(d, d, generator=g) * 0.05 for n in ("e_proj", "h_proj")})
    out.update({f"mtp.0.{n}.weight": torch.ones(d) for n in ("enorm", "hnorm", "norm")})
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "mtp.safetensors"))


def make(path, spec: bool, **kw) -> LLM:
    opts = dict(dtype="float32", page_size=PAGE, num_pages=400, chunked_prefill_size=16, max_num_seqs=8,
                progress=False, speculative_config={"method": "mtp", "num_speculative_tokens": 3} if spec else None)
    return LLM(str(path), **{**opts, **kw})


@pytest.fixture(scope="module")
def with_nextn(shared_dir, tmp_path_factory, run_seed):
    path = tmp_path_factory.mktemp("mtp") / "tiny-dsv4-py-mtp"
    write_nextn(shared_dir / "models" / "tiny-dsv4-py", path, run_seed)
    return path


@pytest.fixture(scope="module")
def pair(with_nextn):
    return make(with_nextn, False, enable_prefix_caching=False), make(with_nextn, True)


def pairs(tokens: list[int]) -> list[int]:
    """A sequence as the next-n layer's cache keys it: each position by its token and the next."""
    return [a * 4096 + b for a, b in zip(tokens, tokens[1:])]


def drafted(llm: LLM) -> int:
    return llm.engine.speculator.counters.num_draft_tokens


def test_greedy_equals_decoding_without_drafts_over_chunks_prefix_hits_and_n2(pair, eval_text, seed):
    plain, spec = pair
    prompts = [repetitive(plain, eval_text) for _ in range(2)] + [text_ids(plain, eval_text, 30) for _ in range(2)]
    params = [greedy(random.randint(12, 30), n=random.choice([1, 2])) for _ in prompts]
    want = plain.generate(prompts, params)
    before = drafted(spec)
    assert completions(spec.generate(prompts, params)) == completions(want)
    assert drafted(spec) > before
    before = drafted(spec)
    again = spec.generate(prompts, params)  # every prompt now hits both prefix caches, and is drafted for
    assert all(o.num_cached_tokens > 0 for o in again) and drafted(spec) > before
    assert completions(again) == completions(want)
    assert_both_clean(spec, [o.prompt_token_ids + c.token_ids for o in want for c in o.outputs], pairs)
    assert not spec.engine.speculator.proposer._features  # no streams held for sequences gone


def test_greedy_equals_decoding_without_drafts_under_preemption_and_aborts(pair, with_nextn, eval_text, seed):
    plain, _ = pair
    spec = make(with_nextn, True, num_pages=36, max_num_batched_tokens=64)
    prompts = [repetitive(plain, eval_text) for _ in range(4)]
    params = greedy(24)
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert spec.engine.stats().num_preemptions > 0 and drafted(spec) > 0
    assert completions(got) == completions(want)
    abort_after = {i: random.randint(2, 16) for i in random.sample(range(4), 2)}
    with DraftsFreed(spec):
        ended = run_with_aborts(spec, prompts, params, abort_after)
    for i in range(4):
        tokens, reason = ended[f"r{i}"][0][:2]
        assert tokens == want[i].outputs[0].token_ids[:len(tokens)]
        assert reason == ("abort" if i in abort_after else "length")
    spec.engine.kv_manager.reset_prefix_cache()
    draft_kv(spec).reset_prefix_cache()
    assert_both_clean(spec, [])


class Drafting:
    """Records which sequences (request id, index) got drafts in some step."""

    def __init__(self, llm: LLM) -> None:
        self.speculator, self.seqs = llm.engine.speculator, set()

    def __enter__(self) -> Drafting:
        propose = self.speculator.propose

        def spied(seqs, budget):
            drafts = propose(seqs, budget)
            self.seqs.update((s.request_id, s.index) for s in seqs if drafts.get(s.seq_id))
            return drafts
        self.speculator.propose = spied
        return self

    def __exit__(self, *exc) -> None:
        del self.speculator.propose


def test_every_sibling_of_n_up_to_3_is_drafted_for(pair, eval_text, seed):
    """The siblings fork from the first sequence's prompt: each gets the prompt's streams with its
    KV and drafts from its first decode on; greedy output is the target's, and a seeded request's
    is the same alone and beside others (sampling needs the drafts to be kept by the target's draws)."""
    plain, spec = pair
    spec.engine.kv_manager.reset_prefix_cache()  # what earlier tests left
    draft_kv(spec).reset_prefix_cache()
    prompts = [repetitive(plain, eval_text) for _ in range(3)]
    params = [greedy(random.randint(12, 20), n=n) for n in (2, 3, 3)]
    with Drafting(spec) as drafting:
        got = spec.generate(prompts, params)
    assert completions(got) == completions(plain.generate(prompts, params))
    assert drafting.seqs == {(o.request_id, c.index) for o in got for c in o.outputs}
    sampled = SamplingParams(temperature=0.8, seed=seed, max_tokens=16, n=3, ignore_eos=True)
    with Drafting(spec) as drafting:
        alone = spec.generate(prompts[:1], sampled)
    assert drafting.seqs == {(alone[0].request_id, i) for i in range(3)}
    assert completions(spec.generate([prompts[1], prompts[0]], [params[1], sampled])[1:]) == completions(alone)
    assert_both_clean(spec, [o.prompt_token_ids + c.token_ids for o in [*got, *alone] for c in o.outputs], pairs)


def test_a_second_turn_past_the_layers_cache_is_drafted_for_recomputing_only_what_the_layer_lacks(
        pair, eval_text, seed):
    """A chat's second turn: the first turn's prompt and output, then new text. The target cached
    the first turn to its last computed token, the layer to its last catch-up, pages short of it:
    the target's hit ends where the layer's does, and the turn is drafted for, its output the target's."""
    plain, spec = pair
    spec.engine.kv_manager.reset_prefix_cache()  # what earlier tests left
    draft_kv(spec).reset_prefix_cache()
    first = repetitive(plain, eval_text)
    n = random.randint(12, 20)
    n += (1 - len(first) - n) % PAGE  # the target computes all but the last token: whole pages of them
    turn1 = spec.generate([first], greedy(n))[0].outputs[0].token_ids
    second = first + turn1 + text_ids(plain, eval_text, random.randint(5, 12))
    target_hit = spec.engine.kv_manager.radix.match(second[:-1], record=False).num_tokens
    layer_hit = draft_kv(spec).radix.match(pairs(second), record=False).num_tokens
    assert target_hit == len(first) + n - 1 > layer_hit  # the layer lacks the first turn's last pages
    before = drafted(spec)
    got = spec.generate([second], greedy(16))
    assert drafted(spec) > before
    assert got[0].num_cached_tokens == layer_hit  # recomputed: the pages the layer lacks, no more
    assert completions(got) == completions(plain.generate([second], greedy(16)))
    assert_both_clean(spec, [second + got[0].outputs[0].token_ids], pairs)


def test_a_hit_the_layer_lacks_by_many_pages_is_kept_whole(pair, eval_text, seed):
    """The layer's cache emptied after the first turn (as by eviction, or a hit from host memory):
    cutting the target's hit back to the layer's would recompute the whole first turn, so the
    target keeps its hit, the turn goes without drafts, and its output is still the target's."""
    plain, spec = pair
    spec.engine.kv_manager.reset_prefix_cache()  # what earlier tests left
    first = repetitive(plain, eval_text)
    turn1 = spec.generate([first], greedy(12))[0].outputs[0].token_ids
    draft_kv(spec).reset_prefix_cache()
    second = first + turn1 + text_ids(plain, eval_text, random.randint(5, 12))
    target_hit = spec.engine.kv_manager.radix.match(second[:-1], record=False).num_tokens
    assert target_hit > RECOMPUTE_FOR_DRAFTS_PAGES * PAGE
    got = spec.generate([second], greedy(8))
    assert got[0].num_cached_tokens == target_hit
    assert completions(got) == completions(plain.generate([second], greedy(8)))
    assert_both_clean(spec, [second + got[0].outputs[0].token_ids], pairs)


def test_the_warm_up_leaves_the_layers_prefix_cache_empty(with_nextn):
    spec = make(with_nextn, True, warmup=True, max_num_seqs=2, max_num_batched_tokens=32)
    kv = draft_kv(spec).stats()
    assert spec.engine.warmup.steps > 0 and not spec.engine.speculator.proposer._seqs
    assert kv.num_cached == 0 and kv.num_free == kv.num_usable and kv.prefix_queries == 0


def test_a_target_that_cannot_draft_with_mtp_is_refused_at_start_up_with_the_reason(shared_dir, with_nextn):
    models = shared_dir / "models"
    cases = [(models / "tiny-dsv4-py", {}, "has no mtp.* tensors, though num_nextn_predict_layers is 1"),
             (models / "tiny-qwen3-py", {}, "MTP runs DeepSeek-V4's next-n layers; Qwen3ForCausalLM has none"),
             (with_nextn, {"model": str(models / "tiny-qwen3-py")}, "is not a drafter directory")]
    for path, extra, reason in cases:
        with pytest.raises(SpecConfigError, match="speculative_config.method: 'mtp' cannot run here") as err:
            LLM(str(path), speculative_config={"method": "mtp", "num_speculative_tokens": 2, **extra},
                progress=False, num_pages=64)
        assert reason in str(err.value)
