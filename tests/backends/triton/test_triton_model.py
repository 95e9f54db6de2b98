"""A model on the Triton backends in the interpreter: against the native backends, and decode through
the graph runner's static, padded buffers against the eager step.

The replay here runs the captured function again instead of a CUDA graph (no GPU in CI), so what
is tested is everything but the capture itself: the buffers, the buckets, the padding rows on the
null page, stale rows left by a larger step, and that the attention reads no host lengths. The
CUDA capture is tested against eager decoding by tests/backends/test_cuda_engine.py on a GPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.backends.triton.attention import TritonAttention
from engine.backends.triton.linear import TritonLinear
from engine.backends.triton.norm import TritonNorm
from engine.core.config import ModelConfig
from engine.core.families.graphs import GraphBackend
from engine.core.forward import ForwardBatch
from engine.core.graph_runner import DecodeGraphs, decode_buckets
from engine.core.kv.storage import KVCache
from engine.core.loader import iter_checkpoint
from engine.core.models.base import Backends
from engine.core.models.llama import Qwen3ForCausalLM
from engine.core.native.attention import NativeAttention
from engine.core.native.linear import NativeLinear
from engine.core.native.norm import NativeNorm

PAGE = 16


def _model(path, attention, linear, norm) -> Qwen3ForCausalLM:
    config = ModelConfig.from_dir(path, "float32", "cpu", 256)
    model = Qwen3ForCausalLM(config, Backends(attention=attention, linear=linear, norm=norm), device="cpu")
    model.load_weights(iter_checkpoint(config.path, progress=False))
    return model


def _pages(lens: list[int], extra: int = 0) -> tuple[list[list[int]], int]:
    tables, nxt = [], 1
    for n in lens:
        pages = -(-(n + extra) // PAGE)
        tables.append(list(range(nxt, nxt + pages)))
        nxt += pages
    return tables, nxt


@pytest.mark.interpret
def test_triton_backends_match_native(tiny_qwen3, seed):
    """Attention, RMSNorm, add+RMSNorm and SiLU-and-mul all on Triton kernels, logits as native's."""
    rng = random.Random(seed)
    fast = _model(tiny_qwen3, TritonAttention(None), TritonLinear(None), TritonNorm(None))
    oracle = _model(tiny_qwen3, NativeAttention(None), NativeLinear(None), NativeNorm(None))
    lens = [rng.randint(1, 60) for _ in range(3)]
    prompts = [[rng.randrange(10, fast.config.vocab_size) for _ in range(n)] for n in lens]
    tables, _ = _pages(lens)
    out = []
    for model in (fast, oracle):
        kv = KVCache(model.kv_layer_specs(), 32, PAGE, torch.float32, "cpu")
        batch = ForwardBatch.build([t for p in prompts for t in p], lens, [0] * 3, tables, PAGE, list(range(sum(lens))))
        with torch.inference_mode():
            batch.attn_metadata = model.prepare(batch)
            out.append(model.compute_logits(model(batch, kv)))
    torch.testing.assert_close(out[0], out[1], rtol=1e-4, atol=1e-4)


class ReplayByRerun(GraphBackend):
    """Replays by calling the function again: the semantics of a graph, without a device."""

    name = "rerun"

    def capture(self, fn):
        fn()
        return fn


def test_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    b = decode_buckets(256)
    assert b[:5] == [1, 2, 4, 8, 16] and b[-1] == 256 and 64 in b and 80 in b and b == sorted(set(b))


@pytest.mark.interpret
def test_padded_replay_equals_eager_decode(tiny_qwen3, seed):
    rng = random.Random(seed)
    model = _model(tiny_qwen3, TritonAttention(None), TritonLinear(None), TritonNorm(None))
    config = model.config
    kv = KVCache(model.kv_layer_specs(), 64, PAGE, torch.float32, "cpu")
    graphs = DecodeGraphs(model, kv, ReplayByRerun(None), PAGE, 256, 6, torch.device("cpu"))
    graphs.capture(progress=False)
    assert graphs.buckets == [1, 2, 4, 6]

    lens = [rng.randint(1, 40) for _ in range(5)]  # up to 3 pages each
    prompts = [[rng.randrange(10, config.vocab_size) for _ in range(n)] for n in lens]
    tables, nxt = _pages(lens, extra=1)
    with torch.inference_mode():  # prefill every prompt but its last token, eagerly
        pre = ForwardBatch.build([t for p in prompts for t in p[:-1]], [n - 1 for n in lens], [0] * 5, tables, PAGE, [])
        pre.attn_metadata = model.prepare(pre)
        model(pre, kv)
        for subset in ([0, 1, 2, 3, 4], [1, 3], [0, 2, 4], [2]):  # buckets 6, 2, 4 (row 3 stale from 3), 1
            left_out = [i for i in range(5) if i not in subset]
            for i in left_out:  # a sentinel where each absent sequence's last token went: padding must not touch it
                slot = tables[i][(lens[i] - 1) // PAGE] * PAGE + (lens[i] - 1) % PAGE
                for layer in range(len(kv.specs)):
                    kv.layer(layer).k.view(-1, *kv.layer(layer).k.shape[2:])[slot] = 123.0
            ids, ctx, pages = [prompts[i][-1] for i in subset], [lens[i] - 1 for i in subset], [tables[i] for i in subset]
            assert graphs.can_run([1] * len(subset), pages, len(subset))
            got = graphs.run(ids, ctx, pages).clone()
            batch = ForwardBatch.build(ids, [1] * len(subset), ctx, pages, PAGE, list(range(len(subset))))
            batch.attn_metadata = model.prepare(batch)
            want = model.compute_logits(model(batch, kv)[batch.logits_indices])
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            for i in left_out:
                slot = tables[i][(lens[i] - 1) // PAGE] * PAGE + (lens[i] - 1) % PAGE
                assert (kv.layer(0).k.view(-1, *kv.layer(0).k.shape[2:])[slot] == 123.0).all()
    assert not kv.layer(0).k[1:nxt].isnan().any()
