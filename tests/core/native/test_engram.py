"""Engram's hashing, gate and tokenizer compression against computations written out here: the
n-gram rows by the Engram demo's rule (left-shifted ids padded, multiplicative XOR per order,
modulo each head's prime, offset into the concatenated table), the gate per stream and token,
and the compression table by Python's unicodedata."""

from __future__ import annotations

import math
import random
import re
import unicodedata

import torch

from engine.core.models.deepseek_v4.engram import bucket_primes, compression_table
from engine.core.native.engram import engram_gate, ngram_rows
from engine.core.tokenizer import Tokenizer


def test_ngram_rows_follow_the_multiplicative_xor_hash(seed):
    rng = random.Random(seed)
    order, heads, pad = rng.randint(2, 5), rng.randint(1, 4), rng.randrange(50)
    (primes,) = bucket_primes(rng.randint(30, 10**7), (order - 1) * heads, 1)
    multipliers = [rng.randrange(1 << 40) * 2 + 1 for _ in range(order)]
    seq = [rng.randrange(50) for _ in range(rng.randint(1, 30))]
    ids = torch.tensor([[seq[p - k] if p - k >= 0 else pad for k in range(order)] for p in range(len(seq))])
    offsets = torch.cumsum(torch.tensor(primes), 0) - torch.tensor(primes)
    got = ngram_rows(ids, torch.tensor(multipliers), torch.tensor(primes).view(order - 1, heads),
                     offsets.view(order - 1, heads))
    for p in range(len(seq)):
        shifted = [seq[p - k] if p - k >= 0 else pad for k in range(order)]
        want = []
        for n in range(2, order + 1):
            mix = 0
            for k in range(n):
                mix ^= shifted[k] * multipliers[k]
            for h in range(heads):
                j = (n - 2) * heads + h
                want.append(mix % primes[j] + sum(primes[:j]))
        assert got[p].tolist() == want, p


def test_the_gate_adds_each_streams_gated_value(seed):
    t, n, d, eps = 5, 3, 16, 1e-6
    streams, keys, value = torch.randn(t, n, d), torch.randn(t, n, d), torch.randn(t, d)
    q_w, k_w = torch.rand(n, d) + 0.5, torch.rand(n, d) + 0.5
    keys[0, 0] = -keys[0, 0]  # both signs of the dot
    got = engram_gate(streams, keys, value, q_w, k_w, eps)
    for i in range(t):
        for s in range(n):
            h, k = streams[i, s], keys[i, s]
            hn = h / math.sqrt(float((h * h).mean()) + eps) * q_w[s]
            kn = k / math.sqrt(float((k * k).mean()) + eps) * k_w[s]
            dot = float((hn * kn).sum()) / math.sqrt(d)
            gate = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)))
            torch.testing.assert_close(got[i, s], h + gate * value[i], rtol=1e-5, atol=1e-5)


def _normal_form(text: str) -> str:
    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    text = re.sub(r"[ \t\r\n]+", " ", "".join(c for c in text if unicodedata.category(c) != "Mn").lower())
    return text if text == " " else text.strip()


def test_the_compression_table_merges_tokens_of_one_normal_form(shared_dir):
    tokenizer = Tokenizer.from_dir(shared_dir / "models" / "tiny-dsv4-py")
    table, size = compression_table(tokenizer)
    first: dict[str, int] = {}
    for tid in range(tokenizer.vocab_size):
        text = tokenizer.decode([tid], skip_special_tokens=False)
        key = tokenizer.convert_ids_to_tokens(tid) if "\ufffd" in text else _normal_form(text) or text
        first.setdefault(key, len(first))
        assert table[tid] == first[key], (tid, text)
    assert size == len(first) < tokenizer.vocab_size  # some tokens merge
