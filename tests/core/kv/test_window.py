"""Window pages: held per page by sequences and cached prefixes, freed with the last holder."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.kv.pages import PagePool
from engine.core.kv.radix import RadixCache
from engine.core.kv.storage import KVCache, KVLayerSpec
from engine.core.kv.window import WindowPool

PS = 4
SPECS = [KVLayerSpec(1, 8, 0, windowed=True), KVLayerSpec(1, 4, 0, rate=4)]


def make(num_pages: int = 40, num_window: int = 12, reach: int = 7):
    kv = KVCache(SPECS, num_pages, PS, torch.float32, "cpu", num_window)
    pool = PagePool(num_pages)
    window = WindowPool(num_window, kv, reach)
    return kv, pool, window, RadixCache(pool, PS, window=window)


def test_a_window_page_lives_while_any_holder_does_and_the_table_follows():
    kv, pool, window, _ = make()
    pages = pool.alloc(3)
    window.hold(pages)
    window.hold(pages[1:])
    table = kv.window_table()
    assert all(table[p] > 0 for p in pages) and len({int(table[p]) for p in pages}) == 3
    window.let_go(pages)
    assert not window.has(pages[0]) and window.has(pages[1]) and kv.window_table()[pages[0]] == 0
    window.let_go(pages[1:])
    assert window.pool.num_used == 0 and not kv.window_table().any()
    with pytest.raises(ValueError):
        window.let_go(pages[:1])
    with pytest.raises(ValueError):
        window.hold(pool.alloc(12))  # 11 usable window pages


def test_span_reaches_back_from_the_page_a_step_starts_in():
    _, _, window, _ = make(reach=7)
    assert window.span(0, 5, PS) == (0, 2)
    assert window.span(13, 14, PS) == (1, 4)  # page 3 starts at 12; 12 - 7 = 5 is in page 1
    assert window.span(16, 16, PS) == (2, 4)


def test_copy_pages_copies_windowed_layers_between_window_pages(seed):
    kv, pool, window, _ = make()
    src, dst = pool.alloc(2)
    window.hold([src, dst])
    kv.layer(0).k.normal_()
    kv.layer(1).k.normal_()
    kv.copy_pages([src], [dst])
    table = kv.window_table()
    assert torch.equal(kv.layer(0).k[table[dst]], kv.layer(0).k[table[src]])
    assert torch.equal(kv.layer(1).k[dst], kv.layer(1).k[src])


def test_a_hit_ends_only_where_the_windows_within_reach_are_kept(seed):
    rng = random.Random(seed)
    kv, pool, window, radix = make(reach=7)
    tokens = [rng.randrange(100) for _ in range(24)]  # 6 pages
    pages = pool.alloc(6)
    window.hold(pages[3:])  # a sequence near its end holds pages 3..5 (tokens 12..23)
    radix.insert(tokens, pages)  # the end, 24, needs pages covering 17..23: held, so the node holds them
    window.let_go(pages[3:])
    pool.decref(pages)
    assert [window.has(p) for p in pages] == [False, False, False, False, True, True]
    assert radix.match(tokens).num_tokens == 24
    assert radix.match(tokens[:22] + [999, 999]).num_tokens == 0  # 20 needs page 3's window, gone
    assert radix.release_windows(window.pool.num_usable)
    assert radix.match(tokens).num_tokens == 0 and window.pool.num_used == 0
    radix.reset()
    window.check_consistency(pool)
    assert pool.num_used == 0
