"""DeepSeek-V4 against HF transformers' deepseek_v4 in fp32, with the stable indexer top-k patched in.

HF's indexer breaks top-k ties with ``torch.topk``, which depends on tensor shapes; the reference
here is HF with the engine's rule (stable descending sort, lowest entry index wins among ties).
"""

from __future__ import annotations

import math
import random
from typing import Callable

import pytest
import torch

transformers = pytest.importorskip("transformers")
M = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from engine import LLM, SamplingParams
from engine.core.config import EngineConfig
from engine.core.native.indexer import stable_topk, top_entries
from engine.core.native.mhc import sinkhorn
from engine.core.startup import build
from dsv4_random import random_checkpoint
from greedy_agreement import GreedyAgreement, compare_greedy, top2
from near_ties import indexer_near_ties
from packed_logits import engine_logits, hf_logits, rel_err

PAGE = 16


@pytest.fixture(autouse=True)
def stable_hf_indexer(monkeypatch):
    """Route the topk inside HF's indexer (its only one) through the engine's stable rule."""
    forward = M.DeepseekV4Indexer.forward

    def stable_topk_method(t, k, dim=-1, *args, **kwargs):
        assert dim in (-1, t.dim() - 1)
        idx = stable_topk(t, k)
        return torch.return_types.topk((t.gather(-1, idx), idx))

    def patched(self, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "topk", stable_topk_method)
            return forward(self, *args, **kwargs)

    monkeypatch.setattr(M.DeepseekV4Indexer, "forward", patched)


DRAWS = 4


def check(path, draw: Callable[[], list[list[int]]], split: float | None = None, page_size: int = PAGE) -> None:
    """HF's logits for the prompts ``draw`` makes. A draw that misses them and whose indexer top-k
    met a near tie is drawn again (either pick would be right there); a near tie alone is no reason:
    at these sizes half the draws meet one (1e-6 to 1e-5 apart) and most do not flip."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for _ in range(DRAWS):
        prompts = draw()
        pages = sum(-(-len(p) // page_size) for p in prompts) + 1
        c = build(EngineConfig(model=str(path), dtype="float32", page_size=page_size, num_pages=max(200, pages)),
                  progress=False)
        with indexer_near_ties() as ties:
            logits = engine_logits(c, prompts, page_size, split)
        errors = [(len(p), rel_err(got, hf_logits(hf, p))) for p, got in zip(prompts, logits)]
        worst = max(errors, key=lambda e: e[1])
        if worst[1] < 1e-4:
            return
        assert ties, f"length {worst[0]}, split {split}: relative error {worst[1]:.2e}"
    pytest.fail(f"each of {DRAWS} draws met an indexer near tie that moved the logits")


def prompts_for(rng: random.Random, vocab: int, lengths: list[int]) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def test_sinkhorn_is_doubly_stochastic(seed):
    """It ends on a column normalisation: columns sum to 1, rows nearly (more iterations: closer)."""
    logits = torch.randn(5, 4, 4)
    comb = sinkhorn(logits, iters=20, eps=1e-6)
    assert torch.allclose(comb.sum(-2), torch.ones(5, 4), atol=1e-5)
    assert torch.allclose(comb.sum(-1), torch.ones(5, 4), atol=2e-2)
    assert torch.allclose(sinkhorn(logits, iters=500, eps=1e-6).sum(-1), torch.ones(5, 4), atol=1e-4)


def test_stable_topk_breaks_ties_by_lowest_index(seed):
    scores = torch.randint(0, 3, (64, 40)).float()  # many exact ties
    picks = stable_topk(scores, 7)
    for row, idx in zip(scores, picks):
        order = sorted(range(40), key=lambda j: (-row[j].item(), j))
        assert idx.tolist() == order[:7]
    visible = torch.randint(0, 41, (64,))
    chosen = top_entries(scores, visible, 7)
    assert ((chosen >= 0).sum(-1) == visible.clamp(max=7)).all()
    assert (chosen < visible[:, None]).all()
    for row, v, idx in zip(scores, visible.tolist(), chosen):  # the stable rule among the visible ones
        order = sorted(range(v), key=lambda j: (-row[j].item(), j))
        assert idx[idx >= 0].tolist() == order[:7]


def test_trained_checkpoint_matches_hf(shared_dir, seed):
    rng = random.Random(seed)
    check(shared_dir / "models" / "tiny-dsv4-py", lambda: prompts_for(rng, 4096, [1, rng.randint(2, 40),
                                                                             rng.randint(100, 300), 600]))


CONFIGS = {
    "sliding": (["sliding_attention"], ["moe"], 4, 8, {}),
    "csa": (["compressed_sparse_attention"], ["hash_moe"], 4, 16, {}),
    "hca": (["heavily_compressed_attention"], ["moe"], 2, 32, {"hca_rate": 8}),
    "mixed": (["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
               "compressed_sparse_attention"], ["hash_moe", "hash_moe", "moe", "moe"], 3, 64,
              {"hca_rate": 32, "yarn": True}),
    "mixed-wide-window": (["compressed_sparse_attention", "heavily_compressed_attention"], ["moe", "hash_moe"], 4,
                          128, {"csa_rate": 8}),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_random_config_matches_hf(name, seed, tmp_path):
    layers, mlps, hc, window, extra = CONFIGS[name]
    path = random_checkpoint(tmp_path / name, seed, layers, mlps, hc, window, **extra)
    rng = random.Random(seed)
    check(path, lambda: prompts_for(rng, 128, [1, rng.randint(2, 40), rng.randint(41, 599), 600]))


@pytest.mark.parametrize("page_size", [3, 6, 16, 64])
def test_a_later_chunk_reads_the_cache_exactly(seed, tmp_path, page_size):
    """A step over cached context (windows open across the cut, entries in pages that do not
    align with the rates) gives HF's full-pass logits."""
    layers, mlps, hc, window, extra = CONFIGS["mixed"]
    path = random_checkpoint(tmp_path / "m", seed, layers, mlps, hc, window, **extra)
    rng = random.Random(seed)
    check(path, lambda: prompts_for(rng, 128, [2, rng.randint(3, 60), 301]), split=rng.uniform(0.2, 0.8),
          page_size=page_size)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 0])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_generation_with_prefix_cache_and_chunks_matches_hf(shared_dir, seed, chunk, prefix_caching):
    path = shared_dir / "models" / "tiny-dsv4-py"
    rng = random.Random(seed)
    base = [rng.randrange(4096) for _ in range(21)]  # 5 pages of 4 shared, ending inside an HCA window
    prompts = [base + [rng.randrange(4096) for _ in range(n)] for n in (3, 11)]
    llm = LLM(str(path), dtype="float32", progress=False, page_size=4, chunked_prefill_size=chunk,
              enable_prefix_caching=prefix_caching)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = llm.generate(prompts[:1], params)[0].outputs[0].token_ids  # its pages then serve prefix hits
    outs = llm.generate(prompts, params)
    assert all((o.num_cached_tokens >= 20) == prefix_caching for o in outs)
    got = [o.outputs[0].token_ids for o in outs]
    assert got[0] == first
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    _assert_hf_greedy(hf, prompts, got, params.max_tokens)


def test_mtp_and_published_names_load(shared_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    src = shared_dir / "models" / "tiny-dsv4-py"
    d = tmp_path / "published"
    d.mkdir()
    (d / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    renamed = {{"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
                "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
                "model.hc_head.hc_scale": "hc_head_scale"}.get(k, k.removeprefix("model.")): v
               for k, v in tensors.items()}
    renamed["mtp.0.emb.tok_emb.weight"] = torch.zeros(4, 2)
    save_file(renamed, str(d / "model.safetensors"))
    c = build(EngineConfig(model=str(d), dtype="float32", num_pages=8), progress=False)
    assert torch.equal(c.model.mtp["mtp.0.emb.tok_emb.weight"], torch.zeros(4, 2))
    assert torch.equal(c.model.model.layers[2].ffn.experts.gate_up[3, 128:],
                       tensors["model.layers.2.ffn.experts.3.w3.weight"].float())


def test_perplexity_matches_hf(shared_dir, eval_text):
    """4,096 tokens through prompt_logprobs, prefilled in two chunks (the second reads the first's cache)."""
    path = shared_dir / "models" / "tiny-dsv4-py"
    llm = LLM(str(path), dtype="float32", progress=False, chunked_prefill_size=2048)
    ids = llm.tokenizer.encode(eval_text)[:4096]
    assert len(ids) == 4096
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    nll = -sum(lp[t] for lp, t in zip(out.prompt_logprobs[1:], ids[1:])) / (len(ids) - 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref = float(hf(torch.tensor([ids]), labels=torch.tensor([ids])).loss)
    assert abs(math.exp(nll) - math.exp(ref)) / math.exp(ref) < 1e-4, (math.exp(nll), math.exp(ref))


def test_greedy_under_preemption_matches_hf(shared_dir):
    """Too few pages for the whole batch: sequences are preempted and recomputed, tokens unchanged."""
    path = shared_dir / "models" / "tiny-dsv4-py"
    rng = random.Random(2)
    prompts = [[rng.randrange(4096) for _ in range(n)] for n in (9, 17, 30, 23)]
    llm = LLM(str(path), dtype="float32", progress=False, page_size=4, num_pages=24, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.stats().num_preemptions > 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    _assert_hf_greedy(hf, prompts, got, params.max_tokens)


def _assert_hf_greedy(hf, prompts: list[list[int]], got: list[list[int]], n: int) -> None:
    """Each of ``got`` is HF's ``n``-token greedy continuation of its prompt, as far as HF's margins decide it
    (the engine's logits agree with HF's to 1e-4 of the largest: ``check`` above)."""
    agreement = GreedyAgreement()
    for prompt, tokens in zip(prompts, got, strict=True):
        seq, scores = list(prompt), []
        for _ in range(n):
            scores.append(top2(hf_logits(hf, seq)[-1]))
            seq.append(max(scores[-1], key=scores[-1].get))
        agreement += compare_greedy(seq[len(prompt):], scores, tokens, bound=1e-3)
    agreement.assert_most_sure()


def test_window_pages_stay_bounded_and_are_all_given_back(shared_dir, seed):
    """Few window pages for four long prompts in chunks: each running sequence holds only the
    pages within reach of its end, a shortage preempts, tokens still equal HF's, and once every
    request is done or aborted and the prefix cache is dropped, no page or window page is held."""
    path = shared_dir / "models" / "tiny-dsv4-py"
    rng = random.Random(seed)
    prompts = [[rng.randrange(4096) for _ in range(rng.randint(90, 200))] for _ in range(4)]
    llm = LLM(str(path), dtype="float32", progress=False, page_size=4, chunked_prefill_size=16, window_pages=30)
    engine, kv, ps = llm.engine, llm.engine.kv_manager, 4
    bound = -(-(kv.window_reach + ps) // ps) + -(-16 // ps) + 1
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    engine.add_request("aborted", prompts[0][:50], params)
    outs, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 5:
            engine.abort_request("aborted")
        for seq in engine.scheduler.running:
            held = kv.state(seq)
            a, b = held.window
            assert b - a <= bound and b == len(held.pages), (held.window, len(held.pages))
    assert engine.stats().num_preemptions > 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    _assert_hf_greedy(hf, prompts, [outs[str(i)] for i in range(len(prompts))], params.max_tokens)
    kv.reset_prefix_cache()
    kv.check_consistency()
    assert kv.stats().num_used == 0 and kv.stats().num_window_used == 0


def test_a_prefix_hit_ends_where_every_window_is_kept(shared_dir, seed):
    """A hit on a whole cached prompt restores all its components; a hit on part of a prompt whose
    windows were let go is honestly shorter (here: none), and both still decode as HF does."""
    path = shared_dir / "models" / "tiny-dsv4-py"
    rng = random.Random(seed)
    base = [rng.randrange(4096) for _ in range(150)]
    llm = LLM(str(path), dtype="float32", progress=False, page_size=4, chunked_prefill_size=32)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([base], params)
    longer = base + [rng.randrange(4096) for _ in range(5)]
    # its first 100 tokens are cached, but the windows within reach (63) of any end there were let
    # go as the first prompt's prefill moved on: the cache keeps them only near 148 and 152
    partial = base[:100] + [rng.randrange(4096) for _ in range(7)]
    hit, miss = llm.generate([longer], params)[0], llm.generate([partial], params)[0]
    assert hit.num_cached_tokens == 148 and miss.num_cached_tokens == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    _assert_hf_greedy(hf, [longer, partial], [hit.outputs[0].token_ids, miss.outputs[0].token_ids], params.max_tokens)
