"""DeepSeek-V4.1's SWA bounded replay (core/models/deepseek_v4/replay.py) driven step by step: a
tiny random V4.1 whose decoder is layers 3-6, and the last prompt position's logits after a
prefill cut into chunks, each step told the prompt's length as the runner tells it."""

from __future__ import annotations

from typing import Callable

import torch

from engine.core.forward import ForwardBatch
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence

# layers: sliding; CSA2 ratio 2 (KV and index source, then Reuse): the encoder; CSA2 ratio 1 from
# layer 3 on (KV, index and candidate source; Reuse; Reindex inside the candidates; Reuse): the
# decoder. Engram (3-grams) before layer 0; the window 8 tokens
SPLIT = dict(ratios=[0, 2, 2, 1, 1, 1, 1], kv_sources=[1, 3], index_sources=[1, 3, 5], candidate=3, blocks=3,
             block_size=2, window=8, top_k=4, engram=[0])
FIRST_DECODER_LAYER, WINDOW = 3, 8


def prompt_logits(llm, prompt: list[int], cuts: tuple[int, ...] = (),
                  after: Callable[[list[int]], None] | None = None) -> torch.Tensor:
    """The logits of ``prompt``'s last position from ``llm``'s model, its prefill cut at ``cuts``;
    ``after`` sees the sequence's pages before they go back."""
    engine, runner = llm.engine, llm.engine.runner
    seq = Sequence(0, "replay", 0, prompt, SamplingParams())
    assert engine.kv_manager.allocate(seq, len(prompt))
    tables = [engine.kv_manager.pages(seq)]
    bounds = [0, *cuts, len(prompt)]
    with torch.inference_mode():
        for lo, hi in zip(bounds, bounds[1:]):
            last = [hi - lo - 1] if hi == len(prompt) else []
            batch = ForwardBatch.build(prompt[lo:hi], [hi - lo], [lo], tables, runner.page_size, last, runner.device)
            batch.prompt_ends_cpu = [len(prompt)]
            batch.attn_metadata = runner.model.prepare(batch)
            hidden = runner.model(batch, runner.kv)
        logits = runner.model.compute_logits(hidden[batch.logits_indices])[0]
    if after is not None:
        after(list(tables[0]))
    engine.kv_manager.free(seq, cache=False)
    return logits
