"""The hierarchical cache's counters and gauges on a real server's /metrics: hits counted in the
tier they were found in (l2 host memory, l3 storage), bytes each way per tier, tier usage, and
the checksum and storage failure totals."""

from __future__ import annotations

import random
import time

import httpx

from test_spec_metrics import samples

L = 'model_name="tiny-qwen3-py"'


def metrics(server, wait: bool = True) -> dict[str, float]:
    """/metrics' samples (``wait``: once the engine's first stats have come, which carry the tiers)."""
    deadline = time.monotonic() + 10
    while True:
        r = httpx.get(server.url + "/metrics", headers=server.headers, timeout=30)
        assert r.status_code == 200
        m = samples(r.text)
        if not wait or any("hicache" in k for k in m) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def generate(server, ids: list[int]) -> dict:
    r = httpx.post(server.url + "/generate", headers=server.headers, timeout=120,
                   json={"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def hits(m: dict[str, float]) -> dict[str, float]:
    return {t: m[f'engine:hicache_hit_tokens_total{{{L},tier="{t}"}}'] for t in ("l1", "l2", "l3")}


def moved(m: dict[str, float], tier: str, direction: str) -> float:
    return m[f'engine:hicache_bytes_total{{{L},tier="{tier}",direction="{direction}"}}']


def landed(server, before: dict[str, float]) -> dict[str, float]:
    """/metrics once storage has taken every record host memory took since ``before`` (its writes
    land on the writer's thread, soon after), or after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        m = metrics(server)
        wrote = {t: moved(m, t, "write") - moved(before, t, "write") for t in ("l2", "l3")}
        if wrote["l2"] == wrote["l3"] or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_hits_bytes_and_usage_are_counted_per_tier(hicache_server, seed):
    rng = random.Random(seed)
    s = hicache_server
    before = metrics(s)
    assert before[f'engine:hicache_storage_attached{{{L},backend="file"}}'] == 1
    for tier in ("l1", "l2", "l3"):
        assert 0 < before[f'engine:hicache_capacity_bytes{{{L},tier="{tier}"}}']
        assert 0 <= before[f'engine:hicache_used_bytes{{{L},tier="{tier}"}}'] \
            <= before[f'engine:hicache_capacity_bytes{{{L},tier="{tier}"}}']

    # a prompt of 25 pages, then one of 33 that pushes it off the device and out of host memory
    # (39 records there): its second turn finds it in storage only
    first, other = ([rng.randrange(4096) for _ in range(n)] for n in (100, 130))
    generate(s, first)
    generate(s, other)
    again = generate(s, first + [rng.randrange(4096) for _ in range(5)])
    assert again["meta_info"]["cached_tokens"] == 100
    mid = landed(s, before)
    got = {t: mid_v - before_v for (t, mid_v), before_v in zip(hits(mid).items(), hits(before).values())}
    assert got == {"l1": 0, "l2": 0, "l3": 100}
    for tier, direction in (("l2", "write"), ("l2", "read"), ("l3", "write"), ("l3", "read")):
        assert moved(mid, tier, direction) > moved(before, tier, direction), (tier, direction)
    # every record host memory took reached storage too, and what storage gave was loaded from host memory
    assert moved(mid, "l3", "write") - moved(before, "l3", "write") == moved(mid, "l2", "write") - moved(before, "l2", "write")
    assert moved(mid, "l2", "read") - moved(before, "l2", "read") == moved(mid, "l3", "read") - moved(before, "l3", "read")
    assert mid[f'engine:hicache_used_bytes{{{L},tier="l2"}}'] > 0

    # a short prompt (5 pages) pushed off the device by a long one (34 pages and a partial 35th)
    # stays in host memory (39 records): an l2 hit; then an l1 hit
    short, long_ = ([rng.randrange(4096) for _ in range(n)] for n in (20, 136))
    generate(s, short)
    generate(s, long_)
    assert generate(s, short + [1, 2])["meta_info"]["cached_tokens"] == 20
    assert generate(s, short + [3, 4])["meta_info"]["cached_tokens"] == 20
    after = metrics(s)
    got = {t: a - m for (t, a), m in zip(hits(after).items(), hits(mid).values())}
    assert got == {"l1": 20, "l2": 20, "l3": 0}
    assert sum(hits(after).values()) - sum(hits(before).values()) == (
        after[f"engine:prefix_cache_hits_total{{{L}}}"] - before[f"engine:prefix_cache_hits_total{{{L}}}"])
    for name in ("checksum_failures", "storage_failures"):
        assert after[f"engine:hicache_{name}_total{{{L}}}"] == before[f"engine:hicache_{name}_total{{{L}}}"]


def test_a_server_without_the_hierarchy_shows_none_of_it(tiny_server):
    assert not any("hicache" in k for k in metrics(tiny_server, wait=False))
