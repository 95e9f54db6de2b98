"""DeepSeek-V4.1's config.json: the public fixtures' keys load (CSA2 ratios 1 and 2 beside V4's, the
sharing fields, Engram and DSpark keys), the cache keeps shared components once, Engram's table
layout reproduces V4.1-Flash's sizes, and a malformed config fails at load with the field it
breaks named."""

from __future__ import annotations

import json

import pytest

from engine.core.config import EngineConfig
from engine.core.models.deepseek_v4.attention import CSA2, SLIDING
from engine.core.models.deepseek_v4.engram import bucket_primes
from engine.core.models.deepseek_v4.model import _normalised
from engine.core.startup import build
from dsv41_random import random_v41_checkpoint, v41_config

# DeepSeek-V4.1-Flash's text config as the public fixtures (vllm-ascend, vllm_gaudi, SGLang) give it:
# only the fields the attention topology and the refusals read
FLASH = {
    "num_hidden_layers": 40, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
    "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8, "index_topk": 512,
    "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000, "engram_n_heads": 8, "engram_head_dim": 256, "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": 3, "dspark_block_size": 5,
    "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256, "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3, "dspark_noise_token_id": 128799, "head_dim": 512, "sliding_window": 128,
}
TINY = dict(ratios=[0, 2, 2, 4, 1, 1, 1, 128, 1, 2, 2], kv_sources=[1, 4, 9], index_sources=[1, 4, 6], candidate=4,
            blocks=3, block_size=2)


def test_the_flash_topology_reads_as_the_tech_report_describes():
    """Groups of six ratio-2 layers (Full, then Reuse), a ratio-1 group led by layer 20 (Full, the
    candidate source), then Reindex layers every four, which score inside layer 20's blocks."""
    hf = _normalised(FLASH)
    assert hf["layer_types"] == [SLIDING] * 2 + [CSA2] * 38
    roles = hf["csa2_roles"]
    assert roles[0] is roles[1] is None
    assert [(r.kv_source, r.index_source) for r in roles[2:8]] == [(2, 2)] * 6
    assert (roles[19].kv_source, roles[19].index_source, roles[19].ratio) == (14, 14, 2)
    assert (roles[20].candidate_blocks, roles[20].candidate_block_size, roles[20].filtered) == (2048, 8, False)
    assert [r.index_source for r in roles[20:40]] == [20] * 4 + [24] * 4 + [28] * 4 + [32] * 4 + [36] * 4
    assert {r.kv_source for r in roles[20:40]} == {20}
    assert [i for i, r in enumerate(roles) if r and r.filtered] == [24, 28, 32, 36]
    assert [i for i, r in enumerate(roles) if r and r.keeps_index_keys] == [2, 8, 14, 20]


def test_the_flash_engram_tables_are_consecutive_primes_from_engram_vocab_size():
    per_layer = (FLASH["engram_max_ngram_size"] - 1) * FLASH["engram_n_heads"]
    tables = bucket_primes(FLASH["engram_vocab_size"], per_layer, len(FLASH["engram_layer_ids"]))
    assert [sum(t) for t in tables] == FLASH["engram_num_embeddings"]
    assert all(len(t) == per_layer for t in tables) and len({p for t in tables for p in t}) == 2 * per_layer


def test_engram_fields_that_do_not_fit_the_tokenizer_fail_at_load(tmp_path, shared_dir):
    for field, value in (("engram_num_embeddings", [200, 300]), ("engram_compressed_vocab_size", 7)):
        hf = {**v41_config(**TINY, engram=[0, 5]), field: value}
        path = tmp_path / field
        random_v41_checkpoint(path, 0, v41_config(**TINY), shared_dir / "models" / "tiny-dsv4-py")
        (path / "config.json").write_text(json.dumps(hf))
        with pytest.raises(ValueError, match=field):
            build(EngineConfig(model=str(path), dtype="float32"), progress=False)


def test_a_tiny_v41_loads_and_keeps_shared_components_once(tmp_path, seed):
    path = random_v41_checkpoint(tmp_path / "m", seed, v41_config(**TINY))
    c = build(EngineConfig(model=str(path), dtype="float32", page_size=4, num_pages=64), progress=False)
    caches = [layer.attn.cache for layer in c.model.model.layers]
    specs = c.model.kv_layer_specs()
    assert len({cache.window for cache in caches}) == 11  # every layer keeps its own window
    assert [caches[i].entries for i in (1, 2)] == [caches[1].entries] * 2
    assert {caches[i].entries for i in (4, 5, 6, 8)} == {caches[4].entries}
    assert caches[10].entries == caches[9].entries and caches[9].index_keys is None  # 9 indexes nothing
    assert caches[6].index_keys == caches[4].index_keys is not None
    entries = {cache.entries for cache in caches if cache.entries is not None}
    assert sorted(specs[i].rate for i in entries) == [1, 2, 2, 4, 128]  # sources 1, 4, 9 and V4's two layers
    # 11 windows; sources 1 (entries, pair projections, index keys), 4 (entries, index keys), 9 (entries,
    # pair projections); V4's CSA (4 components) and HCA (2)
    assert len(specs) == 11 + 3 + 2 + 2 + 4 + 2
    attn = [layer.attn for layer in c.model.model.layers]
    assert attn[1].compressor.wgate is not None and attn[4].compressor.wgate is None  # ratio 1 has no gate
    assert attn[1].compressor.ape is None and attn[3].compressor.ape is not None  # CSA2 has no position bias
    assert attn[6].indexer.wk is None and attn[4].indexer.wk is not None  # Reindex scores layer 4's keys
    assert attn[2].compressor is attn[2].indexer is None  # Reuse


def _broken(**change) -> dict:
    hf = v41_config(**TINY)
    for key, value in change.items():
        if callable(value):
            value(hf)
        else:
            hf[key] = value
    return hf


def _set_ratio(layer: int, ratio):
    return lambda hf: hf["compress_ratios"].__setitem__(layer, ratio)


MALFORMED = {
    "source out of range": (_broken(kv_source_layer_ids=[1, 4, 11]), r"kv_source_layer_ids names layer 11, out of range"),
    "source after its reader": (_broken(kv_source_layer_ids=[2, 4, 9]), r"layer 1 .* kv_source_layer_ids"),
    "source of another ratio": (_broken(fix=_set_ratio(5, 2)), r"layer 5 has compress ratio 2 .* kv_source_layer_ids"),
    "source on a V4 layer": (_broken(kv_source_layer_ids=[1, 3, 4, 9]), r"kv_source_layer_ids names layer 3"),
    "unknown ratio": (_broken(fix=_set_ratio(2, 3)), r"compress_ratios\[2\] is 3"),
    "too few ratios": (_broken(compress_ratios=[0, 2]), r"compress_ratios has 2 entries for 11 layers"),
    "index source out of range": (_broken(index_source_layer_ids=[1, 4, 6, 12]), r"index_source_layer_ids names layer 12"),
    "index source without entries": (_broken(index_source_layer_ids=[0, 1, 4]), r"index_source_layer_ids names layer 0"),
    "reindex without keys": (_broken(index_source_layer_ids=[1, 6], candidate_source_layer_id=-1), r"index_source_layer_ids: layer 6 .* layer 4"),
    "repeated ids": (_broken(index_source_layer_ids=[1, 4, 4]), r"index_source_layer_ids .* without repeats"),
    "candidate source not indexing": (_broken(candidate_source_layer_id=5), r"candidate_source_layer_id 5"),
    "candidate blocks missing": (_broken(candidate_topk_blocks=0), r"candidate_topk_blocks \(0\)"),
    "engram layer out of range": (_broken(engram_layer_ids=[1, 11]), r"engram_layer_ids names layer 11"),
    "engram unigrams": (_broken(engram_layer_ids=[1], engram_max_ngram_size=1), r"engram_max_ngram_size is 1"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_config_fails_at_load_naming_the_field(tmp_path, name):
    hf, message = MALFORMED[name]
    hf.pop("fix", None)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=message):
        build(EngineConfig(model=str(tmp_path), dtype="float32"), progress=False)
