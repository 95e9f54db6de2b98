"""DeepSeek-V4's cache layout: where each component's slots are, and what a token costs in each."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.kv.storage import KVCache
from engine.core.models.deepseek_v4.cache import SeqView, cache_layout, component_bytes_per_token, window_slots


@pytest.mark.parametrize("page_size", [1, 3, 4, 6, 16, 32])
@pytest.mark.parametrize("rate", [4, 16, 128])
def test_entries_get_distinct_slots_in_the_page_of_their_last_token(seed, page_size, rate):
    rng = random.Random(seed)
    num_entries = rng.randint(1, 3 * max(1, 64 // rate) + 8)
    num_pages = -(-num_entries * rate // page_size)
    pages = torch.tensor(rng.sample(range(1, 4 * num_pages + 2), num_pages), dtype=torch.int32)
    seq = SeqView(start=0, context=0, new=num_entries * rate, pages=pages, windows=torch.zeros(0), page_size=page_size)
    slots = seq.entry_slots(0, num_entries, rate)
    per_page = -(-page_size // rate)
    assert len(set(slots.tolist())) == num_entries
    for w, slot in enumerate(slots.tolist()):
        assert slot // per_page == pages[(w * rate + rate - 1) // page_size]
    first = rng.randrange(num_entries)
    assert torch.equal(seq.entry_slots(first, num_entries, rate), slots[first:])


def test_token_slots_follow_the_page_table_into_the_window_pages(seed):
    rng = random.Random(seed)
    pages = torch.tensor(rng.sample(range(1, 50), 10), dtype=torch.int32)
    windows = torch.tensor(rng.sample(range(1, 80), 50), dtype=torch.int32)
    seq = SeqView(start=0, context=0, new=40, pages=pages, windows=windows, page_size=4)
    assert seq.token_slots(0, 40).tolist() == [int(windows[pages[t // 4]]) * 4 + t % 4 for t in range(40)]
    slots = pages[torch.arange(40) // 4].long() * 4 + torch.arange(40) % 4
    assert torch.equal(window_slots(slots, windows, 4), seq.token_slots(0, 40))


@pytest.mark.parametrize("fp8_index_keys", [False, True])
def test_bytes_per_token_per_component_add_up_to_the_pages(seed, fp8_index_keys):
    """Beside FP8 weights an index key costs 32 E4M3 bytes and a 4-byte scale, not 32 bf16 values."""
    rng = random.Random(seed)
    rates = [rng.choice([0, 4, 16]) for _ in range(7)]
    specs, layers = cache_layout(64, rates, [r == 4 for r in rates], 32, fp8_index_keys=fp8_index_keys)
    per_token = component_bytes_per_token(specs, layers, torch.bfloat16)
    assert per_token["window"] == 7 * 64 * 2
    windowed = ("window", "projections", "index_projections")
    assert sum(v for k, v in per_token.items() if k in windowed) * 16 == KVCache.bytes_per_page(
        specs, 16, torch.bfloat16, windowed=True)
    assert sum(v for k, v in per_token.items() if k not in windowed) * 16 == KVCache.bytes_per_page(
        specs, 16, torch.bfloat16)
    csa, hca = rates.count(4), rates.count(16)
    assert per_token.get("entries", 0) == (csa * 64 / 4 + hca * 64 / 16) * 2
    assert per_token.get("index_keys", 0) == csa * ((32 + 4) if fp8_index_keys else 32 * 2) / 4
