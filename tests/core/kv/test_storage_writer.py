"""Storage writes off the engine thread (core/kv/storage_writer.py), at the KV manager: a store whose
writes hang holds up no step, its records land later and are hit only then; a full queue drops
writes (counted, logged once per burst) and leaks no page or record; closing, or detaching the
tier, drains what is queued for a bounded time and drops the rest (counted, logged)."""

from __future__ import annotations

import logging
import random
import threading
import time

from engine.core.families.cache_tier import prefix_keys
from engine.core.kv import hierarchy, storage_writer

from test_hierarchy_storage import engine, run
from test_hierarchy import run_to_completion


class Held:
    """A tier whose writes wait until ``go`` is set; ``entered`` tells that one has begun."""

    def __init__(self, tier):
        self.tier, self.go, self.entered = tier, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.tier, name)

    def put(self, pages):
        self.entered.set()
        self.go.wait(10)
        return self.tier.put(pages)


class Gated(Held):
    """A tier that makes one write per permit released (``permits.release(n)``)."""

    def __init__(self, tier):
        super().__init__(tier)
        self.permits = threading.Semaphore(0)

    def put(self, pages):
        self.entered.set()
        self.permits.acquire(timeout=10)
        return self.tier.put(pages)


def held_engine(directory, rng, wrapper=Held):
    held = []
    m, h, files = engine(directory, False, rng, tier_wrapper=lambda t: held.append(wrapper(t)) or held[0])
    return m, h, files, held[0]


def prompt_of(rng, pages: int = 10) -> list[int]:
    return [rng.randrange(1000) for _ in range(pages * 4)]


def test_steps_do_not_wait_on_a_slow_store_and_hits_come_once_it_lands(tmp_path, seed):
    rng = random.Random(seed)
    first, h1, files, held = held_engine(tmp_path, rng)
    prompt = prompt_of(rng)
    started = time.monotonic()
    for _ in range(3):  # the prompt, then two more turns of it: steps go on while the first write hangs
        run_to_completion(first, h1, prompt + [rng.randrange(1000)])
    assert time.monotonic() - started < 5 and held.entered.wait(5) and not held.go.is_set()
    keys = prefix_keys(prompt, 4, first.lower.model_key)
    assert files.contains(keys) == 0 and first.lower.stats.storage_written == 0
    held.go.set()
    assert first.lower.flush_storage(5)
    assert first.lower.stats.storage_written == 10 and files.contains(keys) == 10
    second, h2, _ = engine(tmp_path, False, rng)
    assert run(second, h2, prompt + [1])[0] == 40 and second.lower.stats.storage_hit_tokens == 40
    first.check_consistency()


def test_a_full_queue_drops_writes_counts_them_and_logs_once_per_burst(tmp_path, seed, monkeypatch, caplog):
    rng = random.Random(seed)
    monkeypatch.setattr(storage_writer, "MAX_QUEUED_BYTES", 1)  # one write waits beside the one under way
    m, h, files, held = held_engine(tmp_path, rng)
    prompts = [prompt_of(rng, rng.randint(2, 6)) for _ in range(8)]
    with caplog.at_level(logging.WARNING, logger="engine.core.kv.storage_writer"):
        for burst in (prompts[:4], prompts[4:]):
            held.go.clear()
            held.entered.clear()
            run_to_completion(m, h, burst[0] + [1])
            assert held.entered.wait(5)  # under way
            for p in burst[1:]:  # one queued, two dropped
                run_to_completion(m, h, p + [1])
            held.go.set()
            assert m.lower.flush_storage(5)
    warnings = [r for r in caplog.records if r.name == "engine.core.kv.storage_writer"]
    assert len(warnings) == 2 and "dropped" in warnings[0].getMessage()
    pages = [len(p) // 4 for p in prompts]
    kept = pages[0] + pages[1] + pages[4] + pages[5]
    assert m.lower.stats.storage_written == kept and m.lower.storage_dropped() == sum(pages) - kept
    for i, p in enumerate(prompts):  # a dropped prefix is not in storage; host memory still has it
        assert files.contains(prefix_keys(p, 4, m.lower.model_key)) == (pages[i] if i in (0, 1, 4, 5) else 0)
    m.check_consistency()
    m.reset_prefix_cache()
    m.check_consistency()
    assert m.stats().num_used == 0 and not m.lower.tier.keys()


def test_closing_drains_what_is_queued_for_a_bounded_time(tmp_path, seed, monkeypatch):
    rng = random.Random(seed)
    m, h, files, held = held_engine(tmp_path, rng)
    prompts = [prompt_of(rng, 3) for _ in range(2)]
    for p in prompts:
        run_to_completion(m, h, p + [1])
    threading.Timer(0.2, held.go.set).start()
    m.lower.close()
    assert m.lower.stats.storage_written == 6 and m.lower.storage_dropped() == 0

    monkeypatch.setattr(storage_writer, "CLOSE_DRAIN_S", 0.2)
    m, h, files, held = held_engine(tmp_path / "b", rng)
    for p in prompts:
        run_to_completion(m, h, p + [1])
    assert held.entered.wait(5)
    started = time.monotonic()
    m.lower.close()  # the first write hangs: the second is dropped, the first ends alone
    assert time.monotonic() - started < 2 and m.lower.storage_dropped() == 3
    held.go.set()
    m.lower.writer._thread.join(5)
    assert m.lower.stats.storage_written == 3 and files.contains(prefix_keys(prompts[0], 4, m.lower.model_key)) == 3
    assert not list((tmp_path / "b").rglob(".tmp-*"))
    m.check_consistency()


def closing_log(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.core.kv.storage_writer"]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_detach_writes_what_is_queued_before_it_lets_the_tier_go(tmp_path, seed, caplog):
    rng = random.Random(seed)
    m, h, files, held = held_engine(tmp_path, rng)
    prompts = [prompt_of(rng, rng.randint(2, 5)) for _ in range(4)]
    for p in prompts:  # the first write waits on the store, the others queue behind it
        run_to_completion(m, h, p + [1])
    assert held.entered.wait(5) and m.lower.stats.storage_written == 0
    threading.Timer(0.2, held.go.set).start()
    with caplog.at_level(logging.INFO, logger="engine.core.kv.storage_writer"):
        assert m.lower.detach_storage() is held
    pages = sum(len(p) // 4 for p in prompts)
    assert m.lower.stats.storage_written == pages and m.lower.storage_dropped() == 0
    for p in prompts:
        assert files.contains(prefix_keys(p, 4, m.lower.model_key)) == len(p) // 4
    assert f"{pages} records to write: {pages} written, 0 given up" in closing_log(caplog)
    m.check_consistency()


def test_a_detach_from_a_hanging_store_returns_in_time_and_counts_what_it_gave_up(tmp_path, seed, monkeypatch,
                                                                                  caplog):
    rng = random.Random(seed)
    monkeypatch.setattr(hierarchy, "DETACH_DRAIN_S", 1.0)
    m, h, files, gated = held_engine(tmp_path, rng, Gated)
    prompts = [prompt_of(rng, rng.randint(2, 5)) for _ in range(4)]
    for p in prompts:
        run_to_completion(m, h, p + [1])
    pages = [len(p) // 4 for p in prompts]
    writer = m.lower.writer
    threading.Timer(0.1, gated.permits.release, (2,)).start()  # two writes land, the third hangs
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="engine.core.kv.storage_writer"):
        m.lower.detach_storage()
    assert 1.0 <= time.monotonic() - started < 1.8
    assert m.lower.stats.storage_written == pages[0] + pages[1] and m.lower.storage_dropped() == pages[3]
    assert (f"{sum(pages)} records to write: {pages[0] + pages[1]} written, {pages[3]} given up after 1.0 s, "
            f"{pages[2]} in a write still under way") in closing_log(caplog)
    assert [files.contains(prefix_keys(p, 4, m.lower.model_key)) for p in prompts] == pages[:2] + [0, 0]
    gated.permits.release()  # the write under way ends alone, and is counted when it does
    writer._thread.join(5)
    assert m.lower.stats.storage_written == sum(pages[:3]) and m.lower.storage_dropped() == pages[3]
    assert files.contains(prefix_keys(prompts[2], 4, m.lower.model_key)) == pages[2]
    m.check_consistency()
