"""DSpark's context rows cross the hierarchical cache's tiers with the target's pages (the drafter
trained for tiny-dsv4-py, fp32, a device cache of 20 pages of 4 tokens): a prompt whose prefix the
device and the drafter's own prefix rows let go, loaded back from host memory, and one read back from
a storage directory by a second engine, each drafts exactly what it drafts with its rows still on
the device, and greedy output equals decoding without speculation. Rows of another drafter, or a
rows record that is corrupted or not its key's, are a miss for the rows only: the page hit stands,
the output is the same, and the bad record is counted and dropped."""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.core.families.cache_tier import prefix_keys
from engine.core.kv.page_rows import rows_key
from engine.core.spec.dspark.weights import build_drafter, save_dspark, shape_for
from engine.core.spec.verify_length import LoadAwareLength, StepCurve
from engine.core.tiers.file import record_name
from engine.server import wire
from engine.server.metrics import ServerMetrics

from drafts_spy import Drafts
from test_spec_decode import completions, greedy

ASSET = Path(__file__).resolve().parents[2] / "assets" / "tiny-dsv4-py-dspark"
PARAMS = greedy(8)
# the drafter keeps 16 pages of rows (one sequence of 64 tokens): the second prompt pushes the first's out
SMALL = dict(num_pages=20, max_num_seqs=1, hicache_ratio=4)


def make(path, drafter=None, **kw) -> LLM:
    spec = {"method": "dspark", "num_speculative_tokens": 4, "model": str(drafter)} if drafter else None
    llm = LLM(str(path), dtype="float32", page_size=4, max_model_len=64, progress=False, speculative_config=spec,
              **kw)
    if drafter is not None:  # every step memory-bound: every draft verified, whatever this CPU's timings
        llm.engine.speculator.verify_length = LoadAwareLength(StepCurve((1, 64), (1.0, 1.0)), 4)
    return llm


def tiered(path, directory, drafter=ASSET, policy="write_through") -> LLM:
    return make(path, drafter, enable_hierarchical_cache=True, hicache_write_policy=policy,
                hicache_storage_backend="file", hicache_storage_dir=str(directory),
                hicache_storage_prefetch_threshold=16, hicache_storage_prefetch_policy="wait_complete", **SMALL)


def last(llm: LLM, prompt: list[int]):
    """The output of ``prompt``, its drafts step by step and the drafts the target accepted."""
    counters = llm.engine.speculator.counters
    accepted = counters.num_accepted_tokens
    with Drafts(llm.engine) as spy:
        out = llm.generate([prompt], PARAMS)[0]
    return out, list(spy.by_seq.values()), counters.num_accepted_tokens - accepted


@pytest.fixture(scope="module")
def setup(shared_dir, eval_text, run_seed, tmp_path_factory):
    """A prompt, an unrelated longer one, the first again with five more tokens; each alone, in
    order, without speculation (the outputs), with DSpark on a large device cache (the third's drafts
    with its rows on the device), and with DSpark on the small cache over host memory and a storage
    directory (the first's pages and rows let go before the third comes)."""
    path = shared_dir / "models" / "tiny-dsv4-py"
    plain = make(path, num_pages=200)
    rng = random.Random(run_seed)
    while True:  # where the first's output goes on as the text does, the third would hit a page of it too
        start = rng.randrange(len(eval_text) - 60000)
        ids = plain.tokenizer.encode(eval_text[start:start + 60000])
        prompts = [ids[:32], ids[1000:1048], ids[:37]]
        want = [plain.generate([prompts[0]], PARAMS)[0]]
        if list(want[0].outputs[0].token_ids[:4]) != prompts[2][32:36]:
            break
    want += [plain.generate([p], PARAMS)[0] for p in prompts[1:]]
    reference = make(path, ASSET, num_pages=200, max_num_seqs=8)
    for p in prompts[:2]:
        reference.generate([p], PARAMS)
    on_device = last(reference, prompts[2])
    directory = tmp_path_factory.mktemp("dspark-rows")
    llm = tiered(path, directory)
    outs = [llm.generate([p], PARAMS)[0] for p in prompts[:2]]
    assert llm.engine.kv_manager.lower.flush_storage(30)
    stored = tmp_path_factory.mktemp("dspark-rows-stored")  # what storage holds before the third prompt
    shutil.copytree(directory, stored, dirs_exist_ok=True)
    let_go = llm.engine.speculator.proposer.prefixes.held(prompts[2], 8)  # rows the drafter still keeps
    outs.append(last(llm, prompts[2]))
    return dict(path=path, plain=plain, prompts=prompts, want=want, on_device=on_device, stored=stored, llm=llm,
                outs=outs, let_go=let_go)


def rows_metrics(llm: LLM) -> dict[str, int]:
    """The rows records' counters as /metrics shows them."""
    text = ServerMetrics("m", 4, 20).render(wire.Stats(hicache=llm.engine.stats().hicache), 0)
    return {event: int(re.search(rf'^engine:hicache_rows_{event}_total{{model_name="m"}} (\d+)$', text, re.M)[1])
            for event in ("written", "read", "missed")}


def storage(setup, directory: Path) -> Path:
    """A copy of the storage directory as the first two prompts left it."""
    shutil.copytree(setup["stored"], directory)
    return directory


def test_a_prefix_loaded_from_host_memory_drafts_as_with_its_rows_on_the_device(setup):
    want, llm, (out, drafts, accepted) = setup["want"], setup["llm"], setup["outs"][2]
    assert completions(setup["outs"][:2] + [out]) == completions(want)
    assert setup["let_go"] == 0, "the drafter's own prefix rows were meant to lose the first prompt"
    _, device_drafts, device_accepted = setup["on_device"]
    assert drafts == device_drafts and accepted == device_accepted > 0
    lower = llm.engine.kv_manager.lower
    assert out.num_cached_tokens == 32 and lower.stats.hit_tokens == 32 and lower.stats.storage_hit_tokens == 0
    assert lower.stats.loaded_rows == 8 and lower.stats.checksum_failures == 0
    assert rows_metrics(llm) == {"written": lower.stats.written_rows, "read": 8, "missed": 0}
    llm.engine.kv_manager.check_consistency()


def test_a_second_engine_reading_the_storage_directory_drafts_as_with_the_rows_on_the_device(setup, tmp_path):
    second = tiered(setup["path"], storage(setup, tmp_path / "stored"))
    out, drafts, accepted = last(second, setup["prompts"][2])
    assert completions([out]) == completions(setup["want"][2:])
    _, device_drafts, device_accepted = setup["on_device"]
    assert drafts == device_drafts and accepted == device_accepted > 0
    lower = second.engine.kv_manager.lower
    assert out.num_cached_tokens == 32 and lower.stats.storage_hit_tokens == 32
    assert lower.stats.loaded_rows == 8 and lower.stats.checksum_failures == 0
    second.engine.kv_manager.check_consistency()


def rows_file(llm: LLM, prompt: list[int], page: int) -> Path:
    lower = llm.engine.kv_manager.lower
    key = rows_key(prefix_keys(prompt, 4, lower.model_key)[page], lower.rows.identity)
    return lower.reader.tier.root / record_name(key)


def test_rows_of_another_drafter_or_a_bad_rows_record_are_a_miss_for_the_rows_only(setup, tmp_path):
    path, prompt, want = setup["path"], setup["prompts"][2], setup["want"][2:]
    target = setup["plain"].engine.components.model
    torch.manual_seed(0)
    drafter = save_dspark(tmp_path / "other", path, build_drafter(target, shape_for(target)), {})
    foreign = tiered(path, storage(setup, tmp_path / "foreign"), drafter)  # the directory holds the trained drafter's rows only
    out, _, _ = last(foreign, prompt)
    assert completions([out]) == completions(want)
    lower = foreign.engine.kv_manager.lower
    assert lower.stats.storage_hit_tokens == out.num_cached_tokens == 32
    assert lower.stats.loaded_rows == 0 and lower.stats.checksum_failures == 0
    assert rows_metrics(foreign) == {"written": lower.stats.written_rows, "read": 0, "missed": 8}

    llm = setup["llm"]  # host memory holds the prompt's pages and rows; the drafter lets its rows go
    lower, proposer = llm.engine.kv_manager.lower, llm.engine.speculator.proposer
    proposer.reset_prefix_cache()
    first = rows_key(prefix_keys(prompt, 4, lower.model_key)[0], lower.rows.identity)
    lower.tier.corrupt(first, 5)
    missed = rows_metrics(llm)["missed"]
    out, _, _ = last(llm, prompt)
    assert completions([out]) == completions(want) and out.num_cached_tokens >= 32
    assert lower.stats.checksum_failures == 1 and lower.stats.loaded_rows == 8 and first not in lower.tier.keys()
    assert rows_metrics(llm)["missed"] == missed + out.num_cached_tokens // 4
    llm.engine.kv_manager.check_consistency()

    reader = tiered(path, storage(setup, tmp_path / "stored"))  # in storage: the first page's rows cut short
    bad = rows_file(reader, prompt, 0)
    bad.write_bytes(bad.read_bytes()[:-7])
    out, _, _ = last(reader, prompt)
    assert completions([out]) == completions(want)
    lower = reader.engine.kv_manager.lower
    assert lower.stats.storage_hit_tokens == out.num_cached_tokens == 32
    assert lower.stats.loaded_rows == 0 and lower.stats.checksum_failures == 1 and not bad.exists()
    assert rows_metrics(reader)["missed"] == 8
    reader.engine.reset_prefix_cache()
    shutil.copyfile(rows_file(reader, prompt, 1), bad)  # a record of the second page's key under the first's name: foreign
    out, _, _ = last(reader, prompt)
    assert completions([out]) == completions(want) and out.num_cached_tokens >= 32
    assert lower.reader.tier.rejected == 1 and lower.stats.loaded_rows == 0 and not bad.exists()


@pytest.mark.parametrize("policy", ["write_back", "write_through_selective"])
def test_rows_the_drafter_let_go_before_its_pages_were_written_are_written_with_them(setup, policy, tmp_path):
    """The first prompt's rows leave the drafter (reset here, as its least-recently-used budget would
    let them go) while its pages are on the device, not yet written: write-back writes them when the
    other prompt pushes them off the device, selective write-through at the second match through
    them (by a prompt that shares the first's pages only, whose device hit gets the rows back from
    the copy taken when the pages were stored). The rows go down with them all the same: a hit from
    host memory drafts exactly as with the rows on the device, and so does one from the storage
    directory by a second engine (write-back; under either policy the rows records reach storage as
    host memory takes them)."""
    first, other, again = setup["prompts"]
    llm = tiered(setup["path"], tmp_path / "l3", policy=policy)
    lower, prefixes = llm.engine.kv_manager.lower, llm.engine.speculator.proposer.prefixes
    llm.generate([first], PARAMS)
    llm.engine.speculator.proposer.reset_prefix_cache()
    assert lower.stats.written_pages == 0 and prefixes.held(first, 8) == 0
    shares = [first + [next(t for t in other if t != again[32])]] * 2 if policy == "write_through_selective" else []
    for prompt in shares + [other]:
        llm.generate([prompt], PARAMS)
    assert lower.stats.written_pages >= 8 and lower.stats.missed_rows == 0
    llm.engine.speculator.proposer.reset_prefix_cache()  # the rows the shared prompts' hits got back, let go
    out, drafts, accepted = last(llm, again)
    assert completions([out]) == completions(setup["want"][2:])
    _, device_drafts, device_accepted = setup["on_device"]
    assert drafts == device_drafts and accepted == device_accepted > 0
    assert out.num_cached_tokens == 32 and lower.stats.hit_tokens == 32 and lower.stats.written_rows >= 8
    assert rows_metrics(llm) == {"written": lower.stats.written_rows, "read": 16 if shares else 8, "missed": 0}
    llm.engine.kv_manager.check_consistency()

    assert lower.flush_storage(30)
    assert all(rows_file(llm, first, page).exists() for page in range(8))
    if policy != "write_back":
        return
    second = tiered(setup["path"], tmp_path / "l3")
    out, drafts, accepted = last(second, again)
    assert completions([out]) == completions(setup["want"][2:])
    assert drafts == device_drafts and accepted == device_accepted
    lower = second.engine.kv_manager.lower
    assert out.num_cached_tokens == lower.stats.storage_hit_tokens == 32 and lower.stats.loaded_rows == 8
    second.engine.kv_manager.check_consistency()
