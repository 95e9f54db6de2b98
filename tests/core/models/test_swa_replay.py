"""DeepSeek-V4.1's SWA bounded replay (--enable-swa-bounded-replay, core/models/deepseek_v4/replay.py)
on a tiny random V4.1 whose decoder is layers 3-6 (tests/replay_steps.py), in fp32: off, every layer
runs every token; on, a prompt that fits the window prefills exactly as without it, a longer one
runs the decoder over its last window only, writes the decoder source's shared entries of every
position, reads no KV it did not write, and stays within the bound measured by
benchmarks/swa_bounded_replay.py; chunked prefill at any cut gives the one-chunk replay, a prefix
hit leaves the last window to compute, and checkpoints without a split are refused."""

from __future__ import annotations

import argparse
import json
import random
import shutil
from collections import Counter

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.config import EngineConfig
from engine.core.models.deepseek_v4.attention import Attention
from engine.core.models.deepseek_v4.cache import SeqView, flat
from engine.core.startup import build
from engine.server.engine_args import add_engine_args, engine_config
from dsv41_random import random_v41_checkpoint, v41_config
from packed_logits import rel_err
from replay_steps import FIRST_DECODER_LAYER, SPLIT, WINDOW, prompt_logits

# max|replay - full| / max|full| of the first token's logits, measured at prompts of 9-96 tokens on
# this model, 144 prompts over 4 checkpoints (benchmarks/results/swa-bounded-replay-cpu.json): at most
# 1.14, a mean of 0.12-0.25 per length. Random weights: bounds on how far the replay moves this
# model, not DeepSeek-V4.1-Flash
REPLAY_MAX, REPLAY_MEAN = 1.5, 0.5
CHUNK_BOUND = 1e-4  # chunked against one-chunk prefill: fp32, sums in another order
LAYERS = len(SPLIT["ratios"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, run_seed, shared_dir):
    return random_v41_checkpoint(tmp_path_factory.mktemp("v41-split"), run_seed, v41_config(**SPLIT),
                                 shared_dir / "models" / "tiny-dsv4-py")


def engine(checkpoint, replay: bool, **kwargs) -> LLM:
    return LLM(str(checkpoint), dtype="float32", progress=False, page_size=4, enable_swa_bounded_replay=replay,
               **kwargs)


@pytest.fixture(scope="module")
def full(checkpoint):
    return engine(checkpoint, False, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def replay(checkpoint):
    return engine(checkpoint, True, enable_prefix_caching=False)


@pytest.fixture
def rows(monkeypatch):
    """Rows each layer's attention ran over (and, under "shared", those whose entries a KV source
    wrote without attending), counted by layer."""
    seen: dict[str, Counter] = {"attention": Counter(), "shared": Counter()}
    forward, write_shared = Attention.forward, Attention.write_shared

    def counting_forward(self, x, *args):
        seen["attention"][self.layer_id] += x.shape[0]
        return forward(self, x, *args)

    def counting_write_shared(self, x, *args):
        seen["shared"][self.layer_id] += x.shape[0]
        return write_shared(self, x, *args)

    monkeypatch.setattr(Attention, "forward", counting_forward)
    monkeypatch.setattr(Attention, "write_shared", counting_write_shared)
    return seen


def prompts_of(rng: random.Random, lengths) -> list[list[int]]:
    return [[rng.randrange(128) for _ in range(n)] for n in lengths]


def greedy(llm: LLM, prompts: list[list[int]], n: int = 6) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def scored(outs) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy outputs' tokens, and the logprobs of each chosen one (all sequences', one tensor)."""
    tokens = [o.outputs[0].token_ids for o in outs]
    return tokens, torch.tensor([lp[t] for o, ts in zip(outs, tokens) for lp, t in zip(o.outputs[0].logprobs, ts)])


def assert_same(outs, want) -> None:
    """The same greedy tokens, each chosen with the same logprob (to CHUNK_BOUND)."""
    (tokens, logprobs), (want_tokens, want_logprobs) = scored(outs), scored(want)
    assert tokens == want_tokens
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=CHUNK_BOUND)


def assert_pages_back(llm: LLM) -> None:
    kv = llm.engine.kv_manager
    kv.check_consistency()
    stats = kv.stats()
    assert stats.num_used == stats.num_cached and not llm.engine.scheduler.has_work()


def test_replay_off_runs_every_layer_on_every_token(full, seed, rows):
    prompt = prompts_of(random.Random(seed), [3 * WINDOW + 5])[0]
    assert full.engine.runner.model.replay_tail == 0
    prompt_logits(full, prompt)
    assert rows["attention"] == Counter({layer: len(prompt) for layer in range(LAYERS)})
    assert not rows["shared"]


def test_replay_off_prefix_hits_leave_one_token(checkpoint, seed):
    llm = engine(checkpoint, False, enable_prefix_caching=True)
    prompt = prompts_of(random.Random(seed), [3 * WINDOW + 5])[0]
    greedy(llm, [prompt])
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0]
    assert out.num_cached_tokens == (len(prompt) - 1) // 4 * 4


def test_prompt_inside_the_window_prefills_exactly_as_without_replay(full, replay, seed, rows):
    prompts = prompts_of(random.Random(seed), range(1, WINDOW + 1))
    for prompt in prompts:
        assert torch.equal(prompt_logits(replay, prompt), prompt_logits(full, prompt))
    assert not rows["shared"]
    assert greedy(replay, prompts) == greedy(full, prompts)
    assert_pages_back(replay)


def test_longer_prompt_runs_the_decoder_over_its_last_window(full, replay, seed, rows):
    prompt = prompts_of(random.Random(seed), [3 * WINDOW + 6])[0]
    source = replay.engine.runner.model.model.layers[FIRST_DECODER_LAYER].attn.cache.entries
    entries = {}

    def keep(name):
        def after(pages):  # the decoder source's shared entries (ratio 1: one a position)
            runner = name.engine.runner
            seq = SeqView(0, 0, 0, torch.tensor(pages, dtype=torch.int32), torch.zeros(0), runner.page_size)
            entries[name] = flat(runner.kv, source)[0][seq.entry_slots(0, len(prompt), 1)].clone()
        return after

    prompt_logits(full, prompt, after=keep(full))
    rows["attention"].clear()
    prompt_logits(replay, prompt, after=keep(replay))
    assert rows["attention"] == Counter({layer: len(prompt) if layer < FIRST_DECODER_LAYER else WINDOW
                                         for layer in range(LAYERS)})
    assert rows["shared"] == Counter({FIRST_DECODER_LAYER: len(prompt) - WINDOW})
    # written from the encoder output for every position, as the full prefill writes them
    torch.testing.assert_close(entries[replay], entries[full], rtol=1e-5, atol=1e-6)


def test_replay_reads_no_kv_it_did_not_write(replay, seed):
    """Noise in every page beforehand changes nothing: the decoder's window KV below the replay's
    first position is never written, and never read."""
    prompt = prompts_of(random.Random(seed), [4 * WINDOW + 3])[0]
    want = prompt_logits(replay, prompt)
    kv = replay.engine.runner.kv
    for i in range(len(replay.engine.runner.model.kv_layer_specs())):
        for t in (kv.layer(i).k, kv.layer(i).v):
            if t.is_floating_point():
                t.normal_()
    assert torch.equal(prompt_logits(replay, prompt), want)


def test_longer_prompts_stay_within_the_measured_bound(full, replay, seed):
    """An approximation: the first token's logits move, within the bounds measured."""
    rng = random.Random(seed)
    errors = [rel_err(prompt_logits(replay, p), prompt_logits(full, p))
              for p in prompts_of(rng, [WINDOW + 1, 2 * WINDOW, 3 * WINDOW, 6 * WINDOW, 12 * WINDOW, 12 * WINDOW])]
    assert max(errors) < REPLAY_MAX and sum(errors) / len(errors) < REPLAY_MEAN, errors
    assert max(errors) > CHUNK_BOUND, errors  # not exact: the earliest replayed tokens see a truncated window


@pytest.mark.parametrize("cuts", [(5,), (2 * WINDOW + 1,), (2 * WINDOW + 2,), (2 * WINDOW + 5,),
                                  (3, 17, 23, 28), (3 * WINDOW - 1,)])
def test_chunked_replay_equals_the_one_chunk_replay(replay, seed, cuts):
    """Prompt of 30, replay from 22: chunks before it, ending at it, across it, inside the window."""
    prompt = prompts_of(random.Random(seed), [3 * WINDOW + 6])[0]
    assert rel_err(prompt_logits(replay, prompt, cuts), prompt_logits(replay, prompt)) < CHUNK_BOUND


def test_scheduled_chunks_and_prefix_hits_give_the_unchunked_replay(checkpoint, replay, seed):
    """The runner tells each chunk its prompt's length; a later turn's prefix hit (on the cached
    end of an earlier one) leaves its last window to compute, so it replays as with no hit."""
    rng = random.Random(seed)
    base = prompts_of(rng, [60])[0]
    turn = base + greedy(replay, [base])[0]  # 66 tokens, then cached
    prompts = [base, turn + prompts_of(rng, [3])[0], turn + prompts_of(rng, [10])[0]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    want = replay.generate(prompts, params)
    for chunk in (5, 7):
        chunked = engine(checkpoint, True, enable_prefix_caching=False, chunked_prefill_size=chunk)
        assert_same(chunked.generate(prompts, params), want)
        assert_pages_back(chunked)
    cached = engine(checkpoint, True, enable_prefix_caching=True)
    greedy(cached, [base])  # its pages serve the hits
    outs = cached.generate(prompts, params)
    hits = [o.num_cached_tokens for o in outs]
    # without the cap 64 and 68 for the later turns (within the window); the prompt itself finds no
    # window pages kept below 52 (only near the cached end, 66)
    assert all(hit <= len(p) - WINDOW for hit, p in zip(hits, prompts)) and hits[1] and hits[2], hits
    assert_same(outs, want)
    assert_pages_back(cached)


def _config_dir(tmp_path, shared_dir, **fields):
    hf = v41_config(**{**SPLIT, **fields})
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(shared_dir / "models" / "tiny-dsv4-py" / name, tmp_path / name)
    return tmp_path


@pytest.mark.parametrize("fields, reason", [
    (dict(ratios=[0, 4, 128, 4], kv_sources=[], index_sources=[], candidate=None), "names no kv_source_layer_ids"),
    (dict(ratios=[0, 2, 2, 1, 1, 0], kv_sources=[1, 3], index_sources=[1, 3], candidate=None),
     "layer 5 after the last KV source"),
    (dict(engram=[0, 4]), r"engram_layer_ids \[4\] are decoder layers"),
])
def test_checkpoints_without_a_split_are_refused(tmp_path, shared_dir, fields, reason):
    path = _config_dir(tmp_path, shared_dir, **fields)
    with pytest.raises(ValueError, match=f"enable_swa_bounded_replay: .*{reason}"):
        build(EngineConfig(model=str(path), dtype="float32", enable_swa_bounded_replay=True), progress=False)


def test_a_model_of_another_family_is_refused(tiny_qwen3):
    with pytest.raises(ValueError, match="enable_swa_bounded_replay: Qwen3ForCausalLM has no encoder/decoder split"):
        build(EngineConfig(model=str(tiny_qwen3), dtype="float32", enable_swa_bounded_replay=True), progress=False)


def test_the_flag_reaches_the_engine_config(checkpoint):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for argv, on in (([], False), (["--enable-swa-bounded-replay"], True)):
        assert engine_config(parser.parse_args(["--model", str(checkpoint), *argv])).enable_swa_bounded_replay is on
