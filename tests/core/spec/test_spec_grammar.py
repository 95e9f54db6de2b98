"""Structured outputs with speculative decoding: constrained requests get drafts (n-gram on
tiny-qwen3-py and tiny-dsv4-py, tiny-qwen3-py drafting for tiny-dsv4-py), and their greedy
output is token-identical to the same requests without speculation, beside unconstrained ones,
with drafts both kept and rejected; the output holds to its grammar; after every step a
sequence's matcher is in the state of a fresh one fed its output alone; every page comes back."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.structured.bitmask import allow_all
from engine.core.structured.params import StructuredOutputsParams as S
from random_schemas import random_schema
from test_draft_model import assert_both_clean, make as make_drafting
from test_mtp import make as make_mtp, pairs, write_nextn
from test_spec_decode import MODELS, assert_clean, completions, make, repetitive

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

MAX_TOKENS = 96
SAMPLED_BATCHES = 4  # batches drawn at most until sampled drafts were both kept and rejected


@pytest.fixture(scope="module", params=MODELS)
def pair(request, shared_dir):
    """(without speculation and without a prefix cache: the reference; with n-gram speculation), as
    test_spec_decode's"""
    path = shared_dir / "models" / request.param
    return make(path, False, enable_prefix_caching=False), make(path, True)


@pytest.fixture(scope="module")
def drafting_pair(shared_dir):
    """(tiny-dsv4-py alone: the reference; with tiny-qwen3-py drafting for it)"""
    target, draft = shared_dir / "models" / "tiny-dsv4-py", shared_dir / "models" / "tiny-qwen3-py"
    return make_drafting(target, enable_prefix_caching=False), make_drafting(target, draft)


@pytest.fixture(scope="module")
def mtp_pair(shared_dir, tmp_path_factory, run_seed):
    """(tiny-dsv4-py with a random next-n layer, alone: the reference; with it drafting)"""
    path = tmp_path_factory.mktemp("mtp") / "tiny-dsv4-py-mtp"
    write_nextn(shared_dir / "models" / "tiny-dsv4-py", path, run_seed)
    return make_mtp(path, False, enable_prefix_caching=False), make_mtp(path, True)


def batch(llm: LLM, text: str, rng: random.Random) -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy requests under a JSON schema, a choice of words from their prompt and regexes, and one
    without a grammar; prompts that repeat a passage, so n-gram drafts are proposed, many kept (a
    model that copies continues the passage where its grammar lets it) and some rejected."""
    prompts = [repetitive(llm, text) for _ in range(6)]
    words = sorted({w for w in re.findall(r"[a-z_]{3,12}", llm.tokenizer.decode(prompts[1]))})
    choices = rng.sample(words, min(len(words), 3)) or ["return"]
    grammars = [S(json=random_schema(rng)), S(choice=choices), S(regex=r"[ -~]{8,50}"),
                S(regex=r"[^\n]{10,40}\n[ -~]{0,30}"), S(regex=r"[a-z_ ]{4,40}\(([a-z_]{1,8}, ){0,3}[a-z_]{1,8}\)"),
                None]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS if g else 40, structured_outputs=g,
                             ignore_eos=g is None) for g in grammars]
    return prompts, params


def holds(params: SamplingParams, text: str) -> bool:
    """Whether a finished output matches its grammar."""
    g = params.structured_outputs
    if g.json is not None:
        jsonschema.validate(json.loads(text), json.loads(g.json))
        return True
    if g.choice is not None:
        return text in g.choice
    return re.fullmatch(g.regex, text) is not None


def drafted(llm: LLM) -> tuple[int, int]:
    """(draft tokens kept, rejected) so far."""
    c = llm.engine.speculator.counters
    return c.num_accepted_tokens, c.num_draft_tokens - c.num_accepted_tokens


class GrammarDrafts:
    """Counts the drafts of constrained sequences that the target kept and rejected."""

    def __init__(self, llm: LLM) -> None:
        self.speculator, self.kept, self.rejected = llm.engine.speculator, 0, 0

    def __enter__(self) -> GrammarDrafts:
        verify = self.speculator.verify

        def spied(rows, logits):
            verified = verify(rows, logits)
            resolve = verified.resolve

            def counted(scheduler):
                seqs, kept = resolve(scheduler)
                for s in verified.rows:
                    if s.seq.grammar is not None:
                        n = seqs.count(s.seq) - 1
                        self.kept, self.rejected = self.kept + n, self.rejected + len(s.drafts) - n
                return seqs, kept
            verified.resolve = counted
            return verified
        self.speculator.verify = spied
        return self

    def __exit__(self, *exc) -> None:
        del self.speculator.verify


def check_equal_and_valid(plain: LLM, spec: LLM, prompts, params, kept_too: bool = True) -> list[list[int]]:
    """``spec``'s greedy outputs are ``plain``'s, and each finished constrained one holds to its grammar;
    with drafts of constrained sequences rejected, and (``kept_too``) kept. The sequences, for assert_clean."""
    want = plain.generate(prompts, params)
    spec.engine.kv_manager.reset_prefix_cache()  # what earlier tests left
    before = drafted(spec)
    with GrammarDrafts(spec) as constrained:
        got = spec.generate(prompts, params)
    kept, rejected = (a - b for a, b in zip(drafted(spec), before))
    assert kept >= constrained.kept >= kept_too and rejected >= constrained.rejected > 0
    assert completions(got) == completions(want)
    for p, o in zip(params, got):
        c = o.outputs[0]
        if p.structured_outputs is not None and c.finish_reason == "stop":
            assert holds(p, c.text), (p.structured_outputs, c.text)
    assert any(o.outputs[0].finish_reason == "stop" for o in got)
    return [o.prompt_token_ids + c.token_ids for o in got for c in o.outputs]


def test_ngram_greedy_constrained_output_equals_decoding_without_drafts(pair, eval_text, seed):
    plain, spec = pair
    prompts, params = batch(plain, eval_text, random.Random(seed))
    sequences = check_equal_and_valid(plain, spec, prompts, params)
    assert_clean(spec, sequences)


def test_draft_model_greedy_constrained_output_equals_decoding_without_drafts(drafting_pair, eval_text, seed):
    plain, spec = drafting_pair
    prompts, params = batch(plain, eval_text, random.Random(seed))
    sequences = check_equal_and_valid(plain, spec, prompts, params)
    assert_both_clean(spec, sequences)


def test_mtp_greedy_constrained_output_equals_decoding_without_drafts(mtp_pair, eval_text, seed):
    """The next-n layer's drafts are poor (random projections): rejected, seldom kept. The choice and
    two regexes of the batch, as each verify step of tiny-dsv4-py is slow on a CPU."""
    plain, spec = mtp_pair
    prompts, params = (x[1:4] for x in batch(plain, eval_text, random.Random(seed)))
    sequences = check_equal_and_valid(plain, spec, prompts, params, kept_too=False)
    assert_both_clean(spec, sequences, keys=pairs)


def matcher_state(matcher, vocab_size: int) -> tuple:
    """What a matcher allows next (None once it ended), and the first line of its own account of
    itself (how many tokens its history holds)."""
    history = matcher._debug_print_internal_state().splitlines()[0]
    if matcher.is_terminated():
        return None, history
    mask = allow_all(1, vocab_size, torch.device("cpu"))
    matcher.fill_next_token_bitmask(mask, 0)
    return mask.tolist(), history


@pytest.mark.parametrize("pair", ["tiny-qwen3-py"], indirect=True)
def test_after_each_verify_the_matcher_holds_exactly_the_kept_tokens(pair, eval_text, seed):
    plain, spec = pair
    engine = spec.engine
    engine.kv_manager.reset_prefix_cache()  # what earlier tests left
    prompts, params = batch(plain, eval_text, random.Random(seed))
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"m{i}", p, sp, stream=False)
    compared = rejected_steps = 0
    ended = []
    while engine.has_unfinished_requests():
        before = drafted(spec)
        ended += engine.step()
        rejected_steps += drafted(spec)[1] > before[1]
        for seq in engine.scheduler.running:
            if seq.grammar is None:
                continue
            fresh = engine.grammars.matcher(engine.grammars.request(seq.params.structured_outputs).wait())
            assert all(fresh.accept_token(t) for t in seq.output_token_ids)
            assert matcher_state(seq.grammar, engine.vocab_size) == matcher_state(fresh, engine.vocab_size)
            compared += 1
    assert compared and rejected_steps
    assert_clean(spec, [o.prompt_token_ids + c.token_ids for o in ended for c in o.outputs])


@pytest.mark.parametrize("pair", ["tiny-qwen3-py"], indirect=True)
def test_sampled_constrained_output_holds_to_its_grammar(pair, eval_text, seed):
    """Sampled drafts are kept by chance (a batch of 16 seeds kept some each time, CI's run once
    none): fresh batches, each held to its grammar, until constrained drafts were kept and rejected."""
    _, spec = pair
    rng = random.Random(seed)
    constrained = GrammarDrafts(spec)
    for _ in range(SAMPLED_BATCHES):
        spec.engine.kv_manager.reset_prefix_cache()  # what earlier tests left
        prompts, params = batch(spec, eval_text, rng)
        params = [SamplingParams(temperature=1.0, top_p=0.9, seed=rng.randrange(2**31),
                                 max_tokens=400 if p.structured_outputs else 40,
                                 structured_outputs=p.structured_outputs, ignore_eos=p.ignore_eos) for p in params]
        with constrained:
            got = spec.generate(prompts, params)
        for p, o in zip(params, got):
            c = o.outputs[0]
            if p.structured_outputs is not None:
                assert c.finish_reason == "stop" and holds(p, c.text), (p.structured_outputs, c.text)
        assert_clean(spec, [o.prompt_token_ids + c.token_ids for o in got for c in o.outputs])
        if constrained.kept and constrained.rejected:
            break
    assert constrained.kept > 0 and constrained.rejected > 0


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny-qwen3-py", "tiny-dsv4-py"])
def test_on_cuda_greedy_constrained_output_equals_decoding_without_drafts(shared_dir, model, eval_text, seed):
    """fp32 (in bf16 a verify row and a decode reach the same logits through different kernels), with
    decode, verify and prefill graphs: the masks reach the device behind the queued work."""
    path = shared_dir / "models" / model
    plain, spec = make(path, False, device="cuda", enable_prefix_caching=False), make(path, True, device="cuda")
    prompts, params = batch(plain, eval_text, random.Random(seed))
    sequences = check_equal_and_valid(plain, spec, prompts, params)
    assert_clean(spec, sequences)
