"""DeepSeek-V4.1's CSA2 mechanisms in the native oracle against computations written out here,
on small random inputs: pair pooling (a softmax over each pair's two gate scores per channel),
ratio-1 entries, the index keys a KV source derives from its entries, and the two-level indexer
(candidate blocks, then the top-k inside them). The compressions run over batches of sequences
that resume after cached context (inside a pair too), on shuffled pages and window pages."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.core.families.v4_attention import Compression, IndexerLayer, IndexKey, V4AttentionLayer
from engine.core.forward import ForwardBatch
from engine.core.kv.storage import KVCache
from engine.core.models.deepseek_v4.cache import cache_layout, flat
from engine.core.models.deepseek_v4.topology import CSA2Role
from engine.core.native.compressor import pool_windows
from engine.core.native.rope import RotaryEmbedding
from engine.core.native.v4_attention import NativeV4Attention

HEAD, INDEX, ROPE, HEADS, EPS, THETA = 16, 8, 8, 3, 1e-6, 10000.0


def test_pairs_pool_by_a_softmax_over_their_two_scores(seed):
    n = random.randint(1, 9)
    kv, gate = torch.randn(2 * n + 1, 5), torch.randn(2 * n + 1, 5) * 3  # the odd last token makes no entry
    got = pool_windows(kv, gate, None, 2, False)
    assert got.shape == (n, 5)
    for j in range(n):
        for c in range(5):
            a, b = math.exp(gate[2 * j, c]), math.exp(gate[2 * j + 1, c])
            want = (a * kv[2 * j, c] + b * kv[2 * j + 1, c]) / (a + b)
            assert abs(got[j, c] - want) < 1e-5


def rope(x: torch.Tensor, pos: int) -> torch.Tensor:
    """Interleaved pairs of the last ROPE channels turned by pos * THETA^(-2i/ROPE)."""
    out = x.clone()
    for i in range(ROPE // 2):
        angle = pos * THETA ** (-2 * i / ROPE)
        c, s = math.cos(angle), math.sin(angle)
        a, b = x[x.shape[0] - ROPE + 2 * i], x[x.shape[0] - ROPE + 2 * i + 1]
        out[x.shape[0] - ROPE + 2 * i], out[x.shape[0] - ROPE + 2 * i + 1] = a * c - b * s, b * c + a * s
    return out


def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean() + EPS) * weight


class Source:
    """One CSA2 KV source (rate 1 or 2) that indexes, as the family sees it, over a KV cache on
    shuffled pages; ``step`` runs its compression for a batch of (cached, new) sequences."""

    def __init__(self, rate: int, ends: list[int], page_size: int, blocks: int = 0, block_size: int = 0,
                 filtered: bool = False, top_k: int = 4) -> None:
        self.rate, self.ends, self.page_size = rate, ends, page_size
        role = CSA2Role(rate, 0, 0, keeps_index_keys=True)
        specs, (self.cache,) = cache_layout(HEAD, [rate], [False], INDEX, roles=[role])
        need = [-(-e // page_size) for e in ends]
        num_pages = sum(need) + 2
        ids = random.sample(range(1, num_pages), sum(need))
        self.tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(ends))]
        self.kv = KVCache(specs, num_pages, page_size, torch.float32, "cpu", num_window_pages=sum(need) + 3)
        for page, window_page in zip(ids, random.sample(range(1, sum(need) + 3), sum(need))):
            self.kv.stage_window(page, window_page)
        self.rope = RotaryEmbedding(HEAD, ROPE, 512, THETA, None, is_neox_style=False)
        self.norm_w, self.key_norm_w = torch.rand(HEAD) + 0.5, torch.rand(INDEX) + 0.5
        self.wk = torch.randn(INDEX, HEAD) * 0.3
        key = IndexKey(lambda latent: latent @ self.wk.T, self.key_norm_w, EPS, self.cache.index_keys)
        self.comp = Compression(rate, False, None, self.norm_w, EPS, self.cache.projections, self.cache.entries, key)
        keys = Compression(rate, False, None, self.key_norm_w, EPS, None, self.cache.index_keys)
        self.layer = V4AttentionLayer(2, HEAD, 8, torch.zeros(2), self.rope, self.cache.window, torch.ones(HEAD), EPS,
                                      self.comp,
                                      IndexerLayer(HEADS, INDEX, top_k, keys, blocks, block_size, filtered))
        self.backend = NativeV4Attention(None)
        self.kv_all = [torch.randn(e, HEAD) for e in ends]
        self.gate_all = [torch.randn(e, HEAD) * 2 for e in ends]

    def batch(self, spans: list[tuple[int, int]]) -> ForwardBatch:
        return ForwardBatch.build([0] * sum(b - a for a, b in spans), [b - a for a, b in spans], [a for a, _ in spans],
                                  self.tables, self.page_size, [])

    def step(self, spans: list[tuple[int, int]]) -> ForwardBatch:
        batch = self.batch(spans)
        kv_p = torch.cat([k[a:b] for k, (a, b) in zip(self.kv_all, spans)])
        gate = torch.cat([g[a:b] for g, (a, b) in zip(self.gate_all, spans)]) if self.rate > 1 else None
        self.backend.compress(kv_p, gate, self.comp, self.layer, self.kv, batch, self.backend.prepare(batch, self.kv))
        return batch

    def stored(self, i: int, index: int) -> torch.Tensor:
        seq = self.backend.prepare(self.batch([(0, e) for e in self.ends]), self.kv).seqs[i]
        return flat(self.kv, index)[0][seq.entry_slots(0, self.ends[i] // self.rate, self.rate)]

    def latents(self, i: int) -> list[torch.Tensor]:
        kv, gate, out = self.kv_all[i], self.gate_all[i], []
        for j in range(self.ends[i] // self.rate):
            if self.rate == 1:
                pooled = kv[j]
            else:
                w = torch.sigmoid(gate[2 * j] - gate[2 * j + 1])  # softmax over the pair, first slot's weight
                pooled = w * kv[2 * j] + (1 - w) * kv[2 * j + 1]
            out.append(norm(pooled, self.norm_w))
        return out

    def entries(self, i: int) -> torch.Tensor:
        return torch.stack([rope(x, j * self.rate) for j, x in enumerate(self.latents(i))])

    def keys(self, i: int) -> torch.Tensor:
        return torch.stack([rope(norm(self.wk @ x, self.key_norm_w), j * self.rate)
                            for j, x in enumerate(self.latents(i))])


def prefilled(rate: int, page_size: int, rng: random.Random) -> Source:
    """Sequences compressed in two steps, the second resuming after a cut anywhere (inside a pair),
    one a decode row."""
    ends = [rng.randint(2, 30) for _ in range(3)] + [rng.randint(8, 40)]
    src = Source(rate, ends, page_size)
    cuts = [rng.randint(0, e - 1) for e in ends[:3]] + [ends[3] - 1]
    src.step([(0, c) for c in cuts])
    src.step(list(zip(cuts, ends)))
    return src


@pytest.mark.parametrize("page_size", [1, 3, 4])
@pytest.mark.parametrize("rate", [1, 2])
def test_entries_and_the_index_keys_derived_from_them(seed, rate, page_size):
    src = prefilled(rate, page_size, random.Random(seed))
    for i, end in enumerate(src.ends):
        if end // rate:
            torch.testing.assert_close(src.stored(i, src.cache.entries), src.entries(i), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(src.stored(i, src.cache.index_keys), src.keys(i), rtol=1e-5, atol=1e-5)


def _scores(src: Source, i: int, q: torch.Tensor, w: torch.Tensor, pos: int) -> list[float]:
    """Index scores of one query at ``pos`` against its sequence's visible keys."""
    keys = src.keys(i)
    visible = (pos + 1) // src.rate
    return [sum(float(w[h]) * max(0.0, float(rope(q[h], pos) @ keys[n])) / math.sqrt(INDEX) for h in range(HEADS))
            for n in range(visible)]


def _blocks(scores: list[float], num_blocks: int, size: int) -> list[int]:
    """Level one written out: blocks ranked by their best score, the newest block first."""
    count = -(-len(scores) // size)
    best = [max(scores[b * size:(b + 1) * size]) for b in range(count)]
    rank = sorted(range(count), key=lambda b: (b != count - 1, -best[b], b))
    return sorted(rank[:num_blocks])


def _picks(scores: list[float], top_k: int, allowed=None) -> list[int]:
    entries = [n for n in range(len(scores)) if allowed is None or allowed(n)]
    return sorted(sorted(entries, key=lambda n: (-scores[n], n))[:top_k])


@pytest.mark.parametrize("rate", [1, 2])
def test_candidate_blocks_then_the_top_k_inside_them(seed, rate):
    rng = random.Random(seed)
    blocks, size, top_k = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 6)
    src = prefilled(rate, 4, rng)
    src.layer = V4AttentionLayer(2, HEAD, 8, torch.zeros(2), src.rope, src.cache.window, torch.ones(HEAD), EPS,
                                 src.comp,
                                 IndexerLayer(HEADS, INDEX, top_k, src.layer.indexer.compression, blocks, size, True))
    spans = [(rng.randint(0, e - 1), e) for e in src.ends]
    batch = src.batch(spans)
    q, w = torch.randn(batch.num_tokens, HEADS, INDEX), torch.randn(batch.num_tokens, HEADS)
    meta = src.backend.prepare(batch, src.kv)
    chosen = src.backend.select_candidates(q, w, src.layer, src.kv, batch, meta)
    picks = src.backend.select(q, w, src.layer, src.kv, batch, meta, chosen)
    unfiltered = src.backend.select(q, w, src.layer, src.kv, batch, meta)
    assert chosen.shape == (batch.num_tokens, blocks) and picks.shape == (batch.num_tokens, top_k)
    row = 0
    for i, (a, b) in enumerate(spans):
        for pos in range(a, b):
            scores = _scores(src, i, q[row], w[row], pos)
            want_blocks = _blocks(scores, blocks, size) if scores else []
            assert sorted(x for x in chosen[row].tolist() if x >= 0) == want_blocks, (i, pos)
            inside = _picks(scores, top_k, lambda n: n // size in want_blocks)
            assert sorted(x for x in picks[row].tolist() if x >= 0) == inside, (i, pos)
            assert sorted(x for x in unfiltered[row].tolist() if x >= 0) == _picks(scores, top_k), (i, pos)
            row += 1
