import math
import random

import pytest
import torch

from engine.core.native.sampling import filter_logits
from engine.core.sampler import PromptLogprobs, Sampler, SamplingRow
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from engine.core.token_table import TokenTable


def make_row(prompt=(), output=(), generator=None, **params) -> Sequence:
    return Sequence(0, "r", 0, list(prompt), SamplingParams(**params), generator, list(output))


def reference_allowed(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> tuple[set[int], torch.Tensor]:
    """Allowed tokens and their renormalized probabilities, one filter after another, in float64."""
    probs = logits.double().softmax(-1)
    allowed = list(torch.argsort(probs, descending=True).tolist())
    if top_k > 0:
        allowed = allowed[:top_k]
    if top_p < 1:
        total = sum(probs[t].item() for t in allowed)
        kept, mass = [], 0.0
        for t in allowed:
            if mass >= top_p:
                break
            kept.append(t)
            mass += probs[t].item() / total
        allowed = kept
    if min_p > 0:
        best = max(probs[t].item() for t in allowed)
        allowed = [t for t in allowed if probs[t].item() >= min_p * best]
    final = torch.zeros_like(probs)
    final[allowed] = probs[allowed]
    return set(allowed), final / final.sum()


def reference_process(logits: torch.Tensor, rows: list[SamplingRow], eos: set[int]) -> torch.Tensor:
    """Bias, min_tokens, repetition, frequency and presence penalties, one token at a time."""
    out = logits.clone()
    for i, r in enumerate(rows):
        p = r.params
        for t, b in (p.logit_bias or {}).items():
            out[i, t] += b
        if len(r.output_token_ids) < p.min_tokens:
            for t in eos | set(p.stop_token_ids):
                out[i, t] = float("-inf")
        for t in set(r.prompt_token_ids) | set(r.output_token_ids):
            v = out[i, t].item()
            out[i, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t in set(r.output_token_ids):
            out[i, t] -= p.frequency_penalty * r.output_token_ids.count(t) + p.presence_penalty
    return out


def test_greedy_is_argmax(seed):
    V = 300
    logits = torch.randn(9, V) * 4
    rows = [make_row(temperature=0) if i % 2 == 0 else make_row(temperature=1.3, top_k=5) for i in range(9)]
    out = Sampler(V, {1}, TokenTable(4, "cpu"), seed=seed)(logits, rows)
    for i in range(0, 9, 2):
        assert out.token_ids[i] == int(logits[i].argmax())
    for i in range(1, 9, 2):
        assert out.token_ids[i] in set(logits[i].topk(5).indices.tolist())


def spied(sampler: Sampler) -> list[int]:
    """Count the calls of the general path."""
    calls, general = [], sampler.sample
    sampler.sample = lambda *args: calls.append(1) or general(*args)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_fast_path_equals_the_general_path(seed, dtype):
    V, N = 257, 33
    sampler = Sampler(V, {1}, TokenTable(4, "cpu"), seed=seed)
    general = spied(sampler)
    rows = [make_row(temperature=0, output=[random.randrange(V)]) for _ in range(N)]
    for logits in (torch.randn(N, V) * 3, torch.randint(0, 4, (N, V)).float()):  # the second is full of ties
        logits = logits.to(dtype)
        fast = sampler(logits, rows)
        assert not general  # the fast path was taken
        assert fast.logprobs is None and fast.top_logprobs == [None] * N
        assert fast.token_ids == Sampler.sample(sampler, logits, rows).token_ids == logits.float().argmax(-1).tolist()


@pytest.mark.parametrize("extra", [dict(logprobs=0), dict(logit_bias={5: 50.0}), dict(min_tokens=3),
                                   dict(repetition_penalty=1.5), dict(frequency_penalty=0.5),
                                   dict(presence_penalty=-0.5), dict(temperature=1.0)])
def test_one_row_that_needs_more_takes_the_batch_off_the_fast_path(seed, extra):
    V, N = 64, 6
    logits = torch.randn(N, V)
    rows = [make_row(temperature=0, output=[7, 7]) for _ in range(N)]
    k = random.randrange(N)
    rows[k] = make_row(output=[7, 7], **{"temperature": 0, **extra})
    sampler = Sampler(V, {1}, TokenTable(4, "cpu"), seed=seed)
    general = spied(sampler)
    out = sampler(logits, rows)
    assert general == [1]
    assert (out.logprobs is None) == ("logprobs" not in extra)
    if "logit_bias" in extra:
        assert out.token_ids[k] == 5


@pytest.mark.parametrize("top_k, top_p, min_p", [
    (5, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.2), (8, 0.8, 0.1), (0, 0.05, 0.0), (1, 1.0, 0.0), (0, 1.0, 0.0),
])
def test_filter_matches_reference(seed, top_k, top_p, min_p):
    logits = torch.randn(6, 40) * 2
    got = filter_logits(logits, [top_k] * 6, [top_p] * 6, [min_p] * 6)
    for i in range(6):
        allowed, _ = reference_allowed(logits[i], top_k, top_p, min_p)
        assert set(torch.isfinite(got[i]).nonzero().flatten().tolist()) == allowed
        kept = list(allowed)
        assert torch.equal(got[i, kept], logits[i, kept])


def test_filter_is_per_row(seed):
    logits = torch.randn(3, 30)
    settings = [(3, 1.0, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.3)]
    got = filter_logits(logits, *[list(s) for s in zip(*settings)])
    for i, (k, p, m) in enumerate(settings):
        assert set(torch.isfinite(got[i]).nonzero().flatten().tolist()) == reference_allowed(logits[i], k, p, m)[0]


def _check_distribution(tokens: list[int], allowed: set[int], expected: torch.Tensor) -> None:
    n = len(tokens)
    assert set(tokens) <= allowed
    freq = torch.bincount(torch.tensor(tokens), minlength=expected.numel()).double() / n
    tol = 5 * torch.sqrt(expected * (1 - expected) / n) + 2e-3
    assert torch.all((freq - expected).abs() <= tol), (freq, expected)


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 4, 1.0, 0.0), (1.5, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.15), (1.2, 6, 0.9, 0.05),
])
def test_sampling_distribution_shared_generator(seed, temperature, top_k, top_p, min_p):
    V, N = 12, 20000
    logits = torch.randn(V) * 1.5
    allowed, expected = reference_allowed(logits / temperature, top_k, top_p, min_p)
    rows = [make_row(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)] * N
    out = Sampler(V, set(), TokenTable(4, "cpu"), seed=seed)(logits.expand(N, V).contiguous(), rows)
    _check_distribution(out.token_ids, allowed, expected)


def test_sampling_distribution_seeded_rows(seed):
    V, N = 10, 4000
    logits = torch.randn(V)
    allowed, expected = reference_allowed(logits / 0.8, 0, 0.9, 0.0)
    rows = [make_row(generator=torch.Generator().manual_seed(seed * 7919 + i), temperature=0.8, top_p=0.9, seed=i)
            for i in range(N)]
    out = Sampler(V, set(), TokenTable(4, "cpu"), seed=seed)(logits.expand(N, V).contiguous(), rows)
    _check_distribution(out.token_ids, allowed, expected)


def test_penalties_and_bias_match_reference(seed):
    V = 16
    eos = {1, 3}
    rows = []
    for _ in range(10):
        rows.append(make_row(
            prompt=[random.randrange(V) for _ in range(random.randrange(0, 8))],
            output=[random.randrange(V) for _ in range(random.randrange(0, 8))],
            repetition_penalty=random.choice([1.0, 0.7, 1.3, 2.0]),
            frequency_penalty=random.choice([0.0, 0.5, -0.4]),
            presence_penalty=random.choice([0.0, 1.0, -0.8]),
            logit_bias=random.choice([None, {random.randrange(V): random.uniform(-5, 5) for _ in range(3)}]),
            min_tokens=random.choice([0, 4]), stop_token_ids=[random.randrange(V)], max_tokens=None,
            temperature=0))
    logits = torch.randn(len(rows), V) * 3
    sampler = Sampler(V, eos, TokenTable(4, "cpu"), seed=seed)
    expected = reference_process(logits, rows, eos)
    before = logits.clone()
    torch.testing.assert_close(sampler.process(logits, rows), expected)
    assert sampler(logits, rows).token_ids == expected.argmax(-1).tolist()
    assert torch.equal(logits, before)  # the caller's logits (a graph's static output) are left as they were


def test_a_token_in_flight_counts_from_the_table(seed):
    """A row sampled again before its last token reached the host: penalties and min_tokens count
    that token from its table slot, as if it were on the host; every draw lands in its row's slot."""
    V, N = 16, 12
    eos = {1, 3}
    table = TokenTable(2, "cpu")
    host_rows, flying_rows = [], []
    for _ in range(N):
        params = dict(repetition_penalty=random.choice([1.0, 0.7, 1.3]), frequency_penalty=random.choice([0.0, 0.5]),
                      presence_penalty=random.choice([0.0, -0.8]), min_tokens=random.choice([0, 2, 3, 4]),
                      stop_token_ids=[random.randrange(V)], max_tokens=None, temperature=0)
        prompt = [random.randrange(V) for _ in range(random.randrange(0, 6))]
        output = [random.randrange(V) for _ in range(random.randrange(0, 5))]
        last = random.randrange(V)
        host_rows.append(make_row(prompt, output + [last], **params))
        flying = make_row(prompt, output, **params)
        flying.slot, flying.num_pending = table.assign(), 1
        table.write([flying.slot], torch.tensor([last]))
        flying_rows.append(flying)
    logits = torch.randn(N, V) * 3
    sampler = Sampler(V, eos, table, seed=seed)
    expected = reference_process(logits, host_rows, eos)
    torch.testing.assert_close(sampler.process(logits, flying_rows), expected)
    out = sampler(logits, flying_rows)
    assert out.token_ids == expected.argmax(-1).tolist()
    assert table.read([r.slot for r in flying_rows]).tolist() == out.token_ids


def _seeded_run(layouts, steps_logits, V, run_seed) -> list[int]:
    """Sample the target row over several steps, with a different crowd around it in each layout."""
    sampler = Sampler(V, {0}, TokenTable(4, "cpu"), seed=run_seed)
    target = make_row(prompt=[5, 6, 7], generator=torch.Generator().manual_seed(1234), seed=1234,
                      temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1, frequency_penalty=0.2,
                      max_tokens=None)
    for step, target_logits in enumerate(steps_logits):
        crowd, pos = layouts(step)
        rows = list(crowd)
        rows.insert(pos, target)
        logits = torch.randn(len(rows), V) * 3
        logits[pos] = target_logits
        out = sampler(logits, rows)
        target.output_token_ids.append(out.token_ids[pos])
    return target.output_token_ids


def test_seeded_rows_ignore_the_batch(seed):
    V, steps = 64, 12
    steps_logits = [torch.randn(V) * 3 for _ in range(steps)]

    def crowd(step):
        rng = random.Random(seed + step * 31)
        rows = []
        for j in range(rng.randrange(0, 6)):
            kind = rng.choice(["greedy", "shared", "seeded"])
            if kind == "greedy":
                rows.append(make_row(temperature=0))
            elif kind == "shared":
                rows.append(make_row(temperature=1.0, top_p=0.8))
            else:
                rows.append(make_row(generator=torch.Generator().manual_seed(rng.randrange(2**31)), seed=j))
        return rows, rng.randrange(0, len(rows) + 1)

    alone = _seeded_run(lambda step: ([], 0), steps_logits, V, seed)
    crowded = _seeded_run(crowd, steps_logits, V, seed + 1)
    reordered = _seeded_run(lambda step: crowd(step + 100), steps_logits, V, seed + 2)
    assert alone == crowded == reordered
    assert len(set(alone)) > 1


def test_seed_changes_the_draw(seed):
    V, N = 1000, 20
    logits = torch.zeros(N, V)
    rows = [make_row(generator=torch.Generator().manual_seed(seed + i), seed=i) for i in range(N)]
    assert len(set(Sampler(V, set(), TokenTable(4, "cpu"), seed=seed)(logits, rows).token_ids)) > N // 2


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids(seed, ignore_eos):
    V = 20
    eos, stop = {1, 3}, [7]
    logits = torch.randn(4, V)
    logits[:, [1, 3, 7]] = 50.0
    rows = [make_row(output=[4] * n, min_tokens=3, stop_token_ids=stop, ignore_eos=ignore_eos, temperature=t)
            for n, t in [(0, 0), (2, 0), (2, 1.0), (3, 0)]]
    sampler = Sampler(V, eos, TokenTable(4, "cpu"), seed=seed)
    for _ in range(20):
        out = sampler(logits, rows)
        assert not set(out.token_ids[:3]) & {1, 3, 7}
        assert out.token_ids[3] in {1, 3, 7}


def test_logprobs_are_raw(seed):
    V = 50
    logits = torch.randn(4, V) * 2
    rows = [make_row(output=[2, 2, 5], repetition_penalty=1.5, frequency_penalty=1.0, temperature=0.5, logprobs=5),
            make_row(temperature=0, logit_bias={7: 30.0}, logprobs=0),
            make_row(top_k=3, logprobs=None),
            make_row(temperature=2.0, logprobs=2)]
    out = Sampler(V, set(), TokenTable(4, "cpu"), seed=seed)(logits, rows)
    raw = torch.log_softmax(logits, -1)
    assert out.token_ids[1] == 7
    for i, t in enumerate(out.token_ids):
        assert math.isclose(out.logprobs[i], raw[i, t].item(), rel_tol=1e-6, abs_tol=1e-6)
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] is None
    for i, n in [(0, 5), (3, 2)]:
        vals, ids = raw[i].topk(n)
        assert [t for t, _ in out.top_logprobs[i]] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in out.top_logprobs[i]]), vals)


def test_prompt_logprobs_include_actual_token(seed):
    L, V = 7, 30
    logits = torch.randn(L, V)
    lp = torch.log_softmax(logits, -1)
    nexts = [int(lp[i].argmin()) if i % 2 else int(lp[i].argmax()) for i in range(L)]
    got = PromptLogprobs(logits, nexts, 3).entries
    top = lp.topk(3).indices
    for i, d in enumerate(got):
        assert set(d) == set(top[i].tolist()) | {nexts[i]}
        for t, v in d.items():
            assert math.isclose(v, lp[i, t].item(), rel_tol=1e-6, abs_tol=1e-6)
    assert [list(d) for d in PromptLogprobs(logits, nexts, 0).entries] == [[t] for t in nexts]


def test_rejects_wrong_shape():
    with pytest.raises(ValueError, match="logits must be"):
        Sampler(10, set(), TokenTable(4, "cpu"))(torch.zeros(2, 11), [make_row(), make_row()])
