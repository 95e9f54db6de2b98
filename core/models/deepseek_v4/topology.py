"""DeepSeek-V4.1's attention topology (CSA2): which layers make compressed entries, which read
another layer's, which run an indexer, and which narrow the indexers after them to candidate blocks.

In a V4.1 config.json, ``compress_ratios[l]`` 1 or 2 names the entries layer ``l`` attends over, not
a compressor of its own: only ``kv_source_layer_ids`` compress (ratio 2: each pair of tokens pooled
by a softmax over their two gate scores; ratio 1: one entry per token), and each CSA2 layer reads
the entries of the last KV source at or before it ("Full" mode in the source, "Reuse" or
"Reindex" after it). ``index_source_layer_ids`` run an indexer: a KV source among them also keeps
index keys derived from its entries, a later one ("Reindex") scores its source's keys with its own
queries, and every other CSA2 layer attends to the picks of the last index source since its KV
source. ``candidate_source_layer_id`` (with ``candidate_topk_blocks`` of ``candidate_block_size``
entries) picks blocks per query that later index sources take their top-k inside.

Ratios 4 and 128 keep V4's meaning (CSA, HCA: a compressor and indexer of the layer's own) and
are never shared. A config that breaks these rules is refused here, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

CSA2_RATIOS = (1, 2)


@dataclass(frozen=True)
class CSA2Role:
    """One CSA2 layer's part in the sharing."""

    ratio: int  # 1: an entry per token; 2: one per pair of tokens
    kv_source: int  # the layer whose entries it reads (itself: it compresses)
    index_source: int | None  # the layer whose picks it attends to (itself: it indexes); None: every visible entry
    keeps_index_keys: bool = False  # a KV source that indexes: it derives index keys from its entries
    candidate_blocks: int = 0  # > 0: it publishes this many candidate blocks per query
    candidate_block_size: int = 0
    filtered: bool = False  # its top-k is taken inside the candidate source's blocks

    def owns_compressor(self, layer: int) -> bool:
        return self.kv_source == layer

    def indexes(self, layer: int) -> bool:
        return self.index_source == layer


def _layer_ids(hf: dict, field: str, n: int) -> list[int]:
    ids = hf.get(field) or []
    for i in ids:
        if not isinstance(i, int) or not 0 <= i < n:
            raise ValueError(f"{field} names layer {i!r}, out of range for {n} layers")
    if sorted(set(ids)) != list(ids):
        raise ValueError(f"{field} {ids} must be increasing layer ids without repeats")
    return list(ids)


def csa2_roles(hf: dict, ratios: list[int]) -> list[CSA2Role | None]:
    """Each layer's CSA2 role (None for a layer of another kind), from ``ratios`` (one per layer)
    and the sharing fields of ``hf``; a ValueError names the field a malformed config breaks."""
    n = len(ratios)
    kv_sources = _layer_ids(hf, "kv_source_layer_ids", n)
    index_sources = _layer_ids(hf, "index_source_layer_ids", n)
    for field, ids in (("kv_source_layer_ids", kv_sources), ("index_source_layer_ids", index_sources)):
        for i in ids:
            if ratios[i] not in CSA2_RATIOS:
                raise ValueError(f"{field} names layer {i}, whose compress ratio is {ratios[i]}: only layers of "
                                 f"ratio 1 or 2 (CSA2) share entries or indexers")
    candidate = hf.get("candidate_source_layer_id")
    candidate = None if candidate is None or candidate < 0 else candidate
    if candidate is not None and candidate not in index_sources:
        raise ValueError(f"candidate_source_layer_id {candidate} is not one of index_source_layer_ids "
                         f"{index_sources}: the candidate blocks come from an indexer's scores")
    blocks, block_size = hf.get("candidate_topk_blocks", 0), hf.get("candidate_block_size", 0)
    if candidate is not None and not (isinstance(blocks, int) and blocks > 0 and isinstance(block_size, int)
                                      and block_size > 0):
        raise ValueError(f"candidate_topk_blocks ({blocks!r}) and candidate_block_size ({block_size!r}) must be "
                         f"positive where candidate_source_layer_id is set")
    roles: list[CSA2Role | None] = []
    for layer, ratio in enumerate(ratios):
        if ratio not in CSA2_RATIOS:
            roles.append(None)
            continue
        before = [s for s in kv_sources if s <= layer]
        if not before:
            raise ValueError(f"layer {layer} (compress ratio {ratio}) reads the entries of a KV source at or before "
                             f"it, but kv_source_layer_ids {kv_sources} names none")
        source = before[-1]
        if ratios[source] != ratio:
            raise ValueError(f"layer {layer} has compress ratio {ratio} but its KV source, layer {source} of "
                             f"kv_source_layer_ids, has ratio {ratios[source]}")
        indexers = [s for s in index_sources if source <= s <= layer]
        index = indexers[-1] if indexers else None
        if index == layer and source not in index_sources:
            raise ValueError(f"index_source_layer_ids: layer {layer} scores the index keys of its KV source, layer "
                             f"{source}, which is not an index source and so keeps none")
        filtered = index == layer and candidate is not None and candidate < layer
        if filtered and roles[candidate].kv_source != source:
            raise ValueError(f"index_source_layer_ids: layer {layer} takes its top-k inside the candidate blocks of "
                             f"candidate_source_layer_id {candidate}, but reads the entries of layer {source}, not "
                             f"those the candidates are blocks of (layer {roles[candidate].kv_source}'s)")
        roles.append(CSA2Role(ratio, source, index, keeps_index_keys=layer == source and layer in index_sources,
                              candidate_blocks=blocks if layer == candidate else 0,
                              candidate_block_size=block_size if candidate is not None else 0, filtered=filtered))
    return roles

