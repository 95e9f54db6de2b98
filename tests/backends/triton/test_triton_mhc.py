"""mHC kernels (pre, post, head, and the sublayer boundaries that fuse them with the norm after)
against core/native/mhc.py: interpreter, GPU, and compiled for every target."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from aot import LDS_BYTES, TARGETS, amd_scratch_and_lds, amdgcn_target, compile_asm, local_memory_ops, pdl

from engine.backends.triton import mhc, mhc_boundary, mhc_partials
from engine.backends.triton.descriptors import triton_descriptors
from engine.backends.triton.norm import rms_norm
from engine.backends.triton.target import pick
from engine.core.families.mhc import MixWeights
from engine.core.native import mhc as native
from engine.core.native.norm import NativeNorm
from engine.core.platform import PlatformSpec
from engine.core.registry import SelectionContext

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
MIX_TOL = dict(rtol=1e-4, atol=2e-5)  # the fp32 gates and comb: K-long fp32 sums in another order
SPLIT_TOL = dict(rtol=1e-5, atol=1e-7)  # the same partials in the same order, fused multiply-adds or not
ROW_TOL = dict(rtol=1e-5, atol=2e-6)  # a collapse from those weights (its cancellations), normalised to O(1)
ORACLE = native.NativeMHC(None)  # the boundaries' defaults: post, pre or head, then the norm


def split_tol(k: int) -> dict:
    """The mixes of the same K-long fp32 sums split over D instead of K: the terms are added in
    another order, so the two part by a random walk of about sqrt(K) roundings of an O(1) partial
    sum (2**-24 each); four of its standard deviations: 3.8e-6 at tiny-dsv4-py's K = 1024, 3.1e-5
    at V4-Flash's 16384 (9.7e-6 seen on the H100 in a gate, where SPLIT_TOL's 1e-7 failed)."""
    return dict(rtol=1e-5, atol=4 * k**0.5 * 2**-24)


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the launches allocate (outputs and split-K partials) starts as NaN."""
    for module in (mhc, mhc_partials):
        monkeypatch.setattr(module, "buffer", lambda *shape, dtype, device: torch.full(shape, float("nan"),
                                                                                       dtype=dtype, device=device))


def _weights(n: int, d: int, mixes: int, scales: int, device, iters: int = 20) -> MixWeights:
    """fn rows of unit norm, so the mixes of RMS-normalised streams are about N(0, 1)."""
    k = n * d
    return MixWeights(torch.randn(mixes, k, device=device) / k**0.5, torch.randn(mixes, device=device),
                      torch.randn(scales, device=device), 1e-6, 1e-6, iters)


def _streams(t: int, n: int, d: int, dtype, device) -> torch.Tensor:
    return (torch.randn(t, n, d, device=device) * torch.rand(t, n, 1, device=device) * 4).to(dtype)


def _check_pre(streams: torch.Tensor, w: MixWeights):
    x, post, comb = mhc.mhc_pre(streams, w)
    want_x, want_post, want_comb = native.hc_pre(streams, w.fn, w.base, w.scale, w.norm_eps, w.hc_eps,
                                                 w.sinkhorn_iters)
    assert x.dtype == streams.dtype and post.dtype == comb.dtype == torch.float32
    torch.testing.assert_close(post, want_post, **MIX_TOL)
    torch.testing.assert_close(comb, want_comb, **MIX_TOL)
    torch.testing.assert_close(x, want_x, **TOL[streams.dtype])
    _check_against_two_launches((x, post, comb), mhc.two_launch_pre(streams, w))
    _arrival_counters_at_rest(streams.device)
    return post, comb


def _check_post(streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
    block_out = torch.randn(streams.shape[0], streams.shape[2], device=streams.device).to(streams.dtype)
    got = mhc.mhc_post(block_out, streams, post, comb)
    want = native.hc_post(block_out, streams, post, comb)
    torch.testing.assert_close(got, want, **TOL[streams.dtype])
    if streams.dtype != torch.float32 and streams.device.type == "cpu":
        # the same rounding steps: only the n-term fp32 sums' order differs (on a GPU the native
        # comb product is a cuBLAS bf16 matmul with its own order: 75% equal to the bit on the H200)
        assert (got == want).float().mean() > 0.98


def _check_head(streams: torch.Tensor, w: MixWeights):
    got = mhc.mhc_head(streams, w)
    torch.testing.assert_close(got, native.hc_head(streams, w.fn, w.base, w.scale, w.norm_eps, w.hc_eps),
                               **TOL[streams.dtype])
    _check_against_two_launches([got], [mhc.two_launch_pre(streams, w, head=True)])


def _norm_weight(d: int, dtype, device) -> torch.Tensor:
    return (1 + 0.5 * torch.randn(d, device=device)).to(dtype)


def _assert_rounded_alike(got: torch.Tensor, want: torch.Tensor):
    """Two roundings of collapses whose fp32 weights are a few ulps apart: 16-bit results equal to
    the bit but where a value straddles a rounding boundary (and the norm after carries the flip),
    fp32 ones within ROW_TOL."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, **ROW_TOL)
        return
    torch.testing.assert_close(got, want, **TOL[got.dtype])
    assert (got == want).float().mean() > 0.99


def _check_against_two_launches(got, want):
    """The one-launch boundary against the two-launch one: the same partials summed in the same
    order, so equal to the bit in the interpreter; compiled, the boundary kernel is built without
    fused multiply-adds (for its post), which the per-token kernel has, so its mixes may differ by
    an ulp or so and a collapse's rounding flip with them."""
    for a, b in zip(got, want):
        if a.device.type == "cpu":
            assert torch.equal(a, b)
        elif a.dtype == torch.float32:
            torch.testing.assert_close(a, b, **SPLIT_TOL)
        else:
            _assert_rounded_alike(a, b)


def _arrival_counters_at_rest(device: torch.device | str):
    """Every launch leaves its token blocks' counters at 0 for the next launch and graph replays
    (``device`` as the launches' tensors name it: cuda:0, not cuda)."""
    assert not mhc_boundary.arrival_counters(torch.device(device), 1).any()


def _check_boundary(streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, w: MixWeights, head: MixWeights,
                    g: torch.Tensor):
    """post + the next pre + its norm, and post + the head + the final norm, in one launch each:
    against the native composition, the two-launch boundary, the Triton launches one by one (the
    new streams equal to the bit; the mixes from the same partial sums split another way), and
    itself called again (its arrival counters back at 0: the same results)."""
    block_out = torch.randn(streams.shape[0], streams.shape[2], device=streams.device).to(streams.dtype)
    ops = NativeNorm(None)
    got = mhc.TritonMHC(None).post_pre_norm(block_out, streams, post, comb, w, g, 1e-6, ops)
    _arrival_counters_at_rest(streams.device)
    _check_against_two_launches(got, mhc.two_launch_boundary(block_out, streams, post, comb, w, (g, 1e-6)))
    again = mhc.TritonMHC(None).post_pre_norm(block_out, streams, post, comb, w, g, 1e-6, ops)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    want = ORACLE.post_pre_norm(block_out, streams, post, comb, w, g, 1e-6, ops)
    torch.testing.assert_close(got[0], want[0], **TOL[streams.dtype])
    torch.testing.assert_close(got[1], want[1], **TOL[streams.dtype])
    torch.testing.assert_close(got[2], want[2], **MIX_TOL)
    torch.testing.assert_close(got[3], want[3], **MIX_TOL)
    new = mhc.mhc_post(block_out, streams, post, comb)
    x, new_post, new_comb = mhc.mhc_pre(new, w)
    assert torch.equal(got[0], new)
    torch.testing.assert_close(got[2], new_post, **split_tol(streams.shape[1] * streams.shape[2]))
    torch.testing.assert_close(got[3], new_comb, **split_tol(streams.shape[1] * streams.shape[2]))
    _assert_rounded_alike(got[1], rms_norm(x, g, 1e-6))
    got = mhc.TritonMHC(None).post_head_norm(block_out, streams, post, comb, head, g, 1e-6, ops)
    _arrival_counters_at_rest(streams.device)
    torch.testing.assert_close(got, ORACLE.post_head_norm(block_out, streams, post, comb, head, g, 1e-6, ops),
                               **TOL[streams.dtype])
    _assert_rounded_alike(got, rms_norm(mhc.mhc_head(new, head), g, 1e-6))
    _check_against_two_launches([got], [mhc.two_launch_boundary(block_out, streams, post, comb, head, (g, 1e-6),
                                                                head=True)])
    assert torch.equal(got, mhc.mhc_post_head(block_out, streams, post, comb, head, (g, 1e-6)))


def _check_pre_norm(streams: torch.Tensor, w: MixWeights, g: torch.Tensor):
    """A model's first collapse, through the attention's input norm."""
    ops = NativeNorm(None)
    got = mhc.TritonMHC(None).pre_norm(streams, w, g, 1e-6, ops)
    want = ORACLE.pre_norm(streams, w, g, 1e-6, ops)
    torch.testing.assert_close(got[0], want[0], **TOL[streams.dtype])
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, b, **MIX_TOL)
    x, post, comb = mhc.mhc_pre(streams, w)
    assert torch.equal(got[1], post) and torch.equal(got[2], comb)  # the same partials and sums
    _assert_rounded_alike(got[0], rms_norm(x, g, 1e-6))  # the norm kernel's steps, its sum in another order
    _check_against_two_launches(got, mhc.two_launch_pre(streams, w, (g, 1e-6)))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype,t,n,d", [(torch.float32, 5, 4, 64), (torch.float16, 5, 4, 64),
                                         (torch.float32, 3, 4, 256), (torch.float16, 3, 4, 256),  # tiny-dsv4-py
                                         (torch.float16, 18, 3, 40)])
@pytest.mark.parametrize("norm_dtype", ["fp32", "streams'"])
def test_mhc_boundary_interpreted(seed, poisoned, dtype, t, n, d, norm_dtype):
    """Several splits of D and token blocks, a stream count and a hidden size that are not powers
    of two; the norm weight in fp32 (DeepSeek-V4's) or in the streams' dtype (rounded before it)."""
    streams = _streams(t, n, d, dtype, "cpu")
    w = _weights(n, d, (2 + n) * n, 3, "cpu")
    g = _norm_weight(d, torch.float32 if norm_dtype == "fp32" else dtype, "cpu")
    post, comb = _check_pre(streams, w)
    _check_pre_norm(streams, w, g)
    _check_boundary(streams, post, comb, _weights(n, d, (2 + n) * n, 3, "cpu"), _weights(n, d, n, 1, "cpu"), g)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype,t,n,d", [(torch.float32, 5, 4, 64), (torch.float16, 5, 4, 64),
                                         (torch.float32, 3, 4, 256), (torch.float16, 3, 4, 256),  # tiny-dsv4-py
                                         (torch.float16, 18, 3, 40)])
def test_mhc_interpreted(seed, poisoned, dtype, t, n, d):
    """Several K splits and token blocks (the interpreter's table), a stream count and a hidden size
    that are not powers of two."""
    streams = _streams(t, n, d, dtype, "cpu")
    post, comb = _check_pre(streams, _weights(n, d, (2 + n) * n, 3, "cpu"))
    _check_post(streams, post, comb)
    _check_head(streams, _weights(n, d, n, 1, "cpu"))


@pytest.mark.interpret
def test_mhc_boundary_without_norm_interpreted(seed, poisoned):
    """The one-launch boundary's collapse block by block (no norm after it), over two token blocks."""
    t, n, d = 18, 3, 40
    streams, block_out = _streams(t, n, d, torch.float16, "cpu"), torch.randn(t, d).to(torch.float16)
    post, comb = _check_pre(streams, _weights(n, d, (2 + n) * n, 3, "cpu"))
    w = _weights(n, d, (2 + n) * n, 3, "cpu")
    got = mhc.mhc_post_pre(block_out, streams, post, comb, w)
    _check_against_two_launches(got, mhc.two_launch_boundary(block_out, streams, post, comb, w))
    torch.testing.assert_close(got[1], ORACLE.pre(got[0], w)[0], **TOL[torch.float16])
    _arrival_counters_at_rest("cpu")


@pytest.mark.interpret
def test_mhc_reads_strided_streams_interpreted(seed, poisoned):
    """Streams that are a view with padding between tokens, and a one-iteration Sinkhorn."""
    streams = _streams(4, 4, 96, torch.float16, "cpu")
    wide = torch.zeros(4, 5, 96, dtype=torch.float16)
    wide[:, :4] = streams
    post, comb = _check_pre(wide[:, :4], _weights(4, 96, 24, 3, "cpu", iters=1))
    _check_post(wide[:, :4], post, comb)


def _check_one_row_as_every_stream(t: int, n: int, d: int, dtype, device):
    """A model's first streams: the embedding's row expanded over the streams (stride 0), read as
    it is by the first pre (one launch or two, with the norm or the head) and by the post after it,
    each result equal to the bit to that of the streams copied out, and the pre to the oracle's."""
    row = (torch.randn(t, d, device=device) * 4).to(dtype)
    shared, copied = row.unsqueeze(1).expand(-1, n, -1), row.unsqueeze(1).repeat(1, n, 1)
    assert shared.stride(1) == 0
    w, head, g = _weights(n, d, (2 + n) * n, 3, device), _weights(n, d, n, 1, device), _norm_weight(d, dtype, device)
    ops = NativeNorm(None)
    triton_mhc = mhc.TritonMHC(None)
    got = triton_mhc.pre_norm(shared, w, g, 1e-6, ops)
    assert all(torch.equal(a, b) for a, b in zip(got, triton_mhc.pre_norm(copied, w, g, 1e-6, ops)))
    assert all(torch.equal(a, b) for a, b in zip(mhc.two_launch_pre(shared, w, (g, 1e-6)),
                                                 mhc.two_launch_pre(copied, w, (g, 1e-6))))
    assert torch.equal(mhc.mhc_head(shared, head), mhc.mhc_head(copied, head))
    want = ORACLE.pre_norm(shared, w, g, 1e-6, ops)
    torch.testing.assert_close(got[0], want[0], **TOL[dtype])
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, b, **MIX_TOL)
    block_out = torch.randn(t, d, device=device).to(dtype)
    new = triton_mhc.post_pre_norm(block_out, shared, got[1], got[2], w, g, 1e-6, ops)
    assert all(torch.equal(a, b)
               for a, b in zip(new, triton_mhc.post_pre_norm(block_out, copied, got[1], got[2], w, g, 1e-6, ops)))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype,t,n,d", [(torch.float16, 3, 4, 256), (torch.float32, 18, 3, 40)])
def test_mhc_reads_one_row_as_every_stream_interpreted(seed, poisoned, dtype, t, n, d):
    _check_one_row_as_every_stream(t, n, d, dtype, "cpu")


def test_mhc_names_the_field_of_bad_input():
    streams = torch.zeros(2, 4, 32)
    with pytest.raises(ValueError, match="MixWeights.fn"):
        mhc.mhc_pre(streams, _weights(4, 16, 24, 3, "cpu"))
    with pytest.raises(ValueError, match="MixWeights.scale"):
        mhc.mhc_head(streams, _weights(4, 32, 4, 3, "cpu"))
    with pytest.raises(ValueError, match="comb"):
        mhc.mhc_post(torch.zeros(2, 32), streams, torch.zeros(2, 4), torch.zeros(2, 4, 3))
    with pytest.raises(ValueError, match="streams"):
        mhc.mhc_pre(torch.zeros(2, 128), _weights(4, 32, 24, 3, "cpu"))
    with pytest.raises(ValueError, match="norm weight"):
        mhc.mhc_pre(streams, _weights(4, 32, 24, 3, "cpu"), (torch.ones(31), 1e-6))
    with pytest.raises(ValueError, match="MixWeights.fn"):
        mhc.mhc_post_head(torch.zeros(2, 32), streams, torch.zeros(2, 4), torch.zeros(2, 4, 4),
                          _weights(4, 32, 24, 3, "cpu"))


@pytest.mark.parametrize("vendor,arch", [("nvidia", "sm_90"), ("amd", "gfx942")])
def test_mhc_descriptor_gives_its_reasons(vendor, arch):
    (descriptor,) = triton_descriptors("mhc", vendor)
    gpu = PlatformSpec(vendor, arch, "a GPU", "cuda")

    def reasons(platform, hc_mult):
        model = SimpleNamespace(hf={"hc_mult": hc_mult})
        return descriptor.check(SelectionContext(platform, model_config=model))

    assert descriptor.name == "triton" and descriptor.family == "mhc"
    assert reasons(gpu, 4) == []
    assert any("hc_mult 32" in r for r in reasons(gpu, 32))
    assert any("needs an" in r for r in reasons(PlatformSpec("cpu", "cpu", "a CPU", "cpu"), 4))


FLASH = dict(n=4, d=4096)  # DeepSeek-V4-Flash: hidden 4096, hc_mult 4


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 32, 4096])
def test_mhc_gpu_flash_shape(seed, poisoned, t):
    n, d = FLASH["n"], FLASH["d"]
    streams = _streams(t, n, d, torch.bfloat16, "cuda")
    w = _weights(n, d, (2 + n) * n, 3, "cuda")
    post, comb = _check_pre(streams, w)
    _check_post(streams, post, comb)
    _check_head(streams, _weights(n, d, n, 1, "cuda"))
    again = mhc.mhc_pre(streams, w)  # the split-K sums run in a fixed order: bit-identical reruns
    assert torch.equal(again[1], post) and torch.equal(again[2], comb)
    g = _norm_weight(d, torch.float32, "cuda")
    _check_pre_norm(streams, w, g)
    _check_boundary(streams, post, comb, _weights(n, d, (2 + n) * n, 3, "cuda"), _weights(n, d, n, 1, "cuda"), g)
    block_out = torch.randn(t, d, device="cuda").to(torch.bfloat16)
    once, twice = (mhc.mhc_post_pre(block_out, streams, post, comb, w, (g, 1e-6)) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(once, twice))  # the post's partials too


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 32])
def test_mhc_gpu_reads_one_row_as_every_stream(seed, poisoned, t):
    """bf16 at V4-Flash (hc_mult 4, hidden 4096): the first pre's BROADCAST product reads the same
    values in the same order as the copied streams' product."""
    _check_one_row_as_every_stream(t, FLASH["n"], FLASH["d"], torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 200])
def test_mhc_gpu_boundary_ignores_the_order_of_arrival(seed, t):
    """Many launches of the one-launch boundaries (one token block, and 7 of 32 tokens each over
    128 splits of D): whichever program of a block arrives last, every result is the same to the
    bit, and the counters are back at 0 after each."""
    n, d = FLASH["n"], FLASH["d"]
    streams, block_out = _streams(t, n, d, torch.bfloat16, "cuda"), torch.randn(t, d, device="cuda").to(torch.bfloat16)
    w, head = _weights(n, d, (2 + n) * n, 3, "cuda"), _weights(n, d, n, 1, "cuda")
    g = _norm_weight(d, torch.float32, "cuda")
    _, post, comb = mhc.mhc_pre(streams, w)
    first = mhc.mhc_post_pre(block_out, streams, post, comb, w, (g, 1e-6))
    last = mhc.mhc_post_head(block_out, streams, post, comb, head, (g, 1e-6))
    for _ in range(20):
        assert all(torch.equal(a, b) for a, b in zip(first, mhc.mhc_post_pre(block_out, streams, post, comb, w,
                                                                               (g, 1e-6))))
        assert torch.equal(last, mhc.mhc_post_head(block_out, streams, post, comb, head, (g, 1e-6)))
    _arrival_counters_at_rest(streams.device)


@pytest.mark.gpu
def test_mhc_gpu_graph_replays_on_new_contents(seed):
    n, d, t = FLASH["n"], FLASH["d"], 32
    streams = _streams(t, n, d, torch.bfloat16, "cuda")
    block_out = torch.randn(t, d, device="cuda").to(torch.bfloat16)
    w, head = _weights(n, d, (2 + n) * n, 3, "cuda"), _weights(n, d, n, 1, "cuda")
    g = _norm_weight(d, torch.float32, "cuda")

    def step():
        x, post, comb = mhc.mhc_pre(streams, w, (g, 1e-6))
        new, y, post, comb = mhc.mhc_post_pre(block_out, streams, post, comb, w, (g, 1e-6))
        return x, new, y, mhc.mhc_post_head(block_out, new, post, comb, head, (g, 1e-6))

    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    streams.copy_(_streams(t, n, d, torch.bfloat16, "cuda"))
    block_out.copy_(torch.randn(t, d, device="cuda"))
    graph.replay()
    eager = step()
    for got, want in zip(captured, eager):
        assert torch.equal(got, want)


@pytest.mark.gpu
def test_tiny_dsv4_logits_with_the_triton_mhc(seed, shared_dir):
    """The whole model on the GPU with only the mHC family switched: its bf16 prompt logprobs are as
    close to an fp32 reference (native mHC and MoE) as those of the native mHC in bf16. bf16 runs
    differ from each other by more than either kernel's rounding: a one-ulp change can flip an
    expert choice."""
    from engine import LLM, SamplingParams

    model = str(shared_dir / "models" / "tiny-dsv4-py")
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, 4096, (int(k),), generator=gen).tolist() for k in (1, 37, 200, 120)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)

    def logprobs(**kw):
        llm = LLM(model, device="cuda", max_model_len=512, progress=False, **kw)
        if kw["mhc_backend"] == "triton":
            assert llm.engine.components.selections["mhc"].chosen.name == "triton"
        outs = llm.generate(prompts, params)
        return torch.cat([torch.tensor([next(iter(p.values())) for p in o.prompt_logprobs[1:]]) for o in outs])

    reference = logprobs(dtype="float32", mhc_backend="native", moe_backend="native")
    native = (logprobs(dtype="bfloat16", mhc_backend="native") - reference).abs()
    fast = (logprobs(dtype="bfloat16", mhc_backend="triton") - reference).abs()
    assert fast.mean() <= 1.25 * native.mean() + 5e-3, (fast.mean(), native.mean())
    assert fast.quantile(0.9) <= 1.5 * native.quantile(0.9) + 1e-2, (fast.quantile(0.9), native.quantile(0.9))


def _signature(x: str) -> dict:
    per_token = {"mix_ptr": "*fp32", "ss_ptr": "*fp32", "base_ptr": "*fp32", "scale_ptr": "*fp32",
                 "streams_ptr": f"*{x}", "out_ptr": f"*{x}", "post_ptr": "*fp32", "comb_ptr": "*fp32",
                 "norm_ptr": "*fp32", "T": "i32", "D": "i32", "splits": "i32", "stride_st": "i32", "stride_si": "i32",
                 "stride_ot": "i32", "norm_eps": "fp32", "hc_eps": "fp32", "iters": "i32", "eps": "fp32"}
    post = {"block_out_ptr": f"*{x}", "streams_ptr": f"*{x}", "post_ptr": "*fp32", "comb_ptr": "*fp32",
            "out_ptr": f"*{x}", "fn_ptr": "*fp32", "mix_ptr": "*fp32", "ss_ptr": "*fp32", "T": "i32", "D": "i32",
            "M": "i32", "d_per_split": "i32", "stride_bt": "i32", "stride_st": "i32", "stride_si": "i32",
            "stride_pt": "i32", "stride_ct": "i32", "stride_ot": "i32", "stride_oi": "i32", "stride_fn": "i32"}
    boundary = {**{k: v for k, v in post.items() if k not in ("out_ptr", "stride_ot", "stride_oi")},
                "new_ptr": f"*{x}", "counters_ptr": "*i32", "base_ptr": "*fp32", "scale_ptr": "*fp32",
                "x_ptr": f"*{x}", "next_post_ptr": "*fp32", "next_comb_ptr": "*fp32", "norm_ptr": "*fp32",
                "stride_nt": "i32", "stride_ni": "i32", "stride_xt": "i32", "norm_eps": "fp32", "hc_eps": "fp32",
                "iters": "i32", "eps": "fp32"}
    first = {**boundary, "streams_ptr": f"*{x}", "K": "i32", "k_per_split": "i32"}
    return {
        "boundary": {k: boundary[k] for k in mhc_boundary.boundary_kernel.arg_names if k in boundary},
        "first": {k: first[k] for k in mhc_boundary.pre_kernel.arg_names if k in first},
        "post": post,
        "partials": {"x_ptr": f"*{x}", "fn_ptr": "*fp32", "mix_ptr": "*fp32", "ss_ptr": "*fp32", "T": "i32",
                     "M": "i32", "K": "i32", "k_per_split": "i32", "stride_x": "i32", "stride_fn": "i32",
                     "D": "i32"},
        "pre": per_token,
        "head": {k: v for k, v in per_token.items() if k not in ("post_ptr", "comb_ptr", "iters")},
    }


ALIGNED = ["K", "k_per_split", "stride_x", "stride_fn", "D", "d_per_split", "stride_st", "stride_si", "stride_ot",
           "stride_bt", "stride_oi", "stride_nt", "stride_ni", "stride_xt"]  # as the JIT specializes the V4-Flash sizes


def _compile(kernel, signature, constexprs, target, cfg=None, **options):
    cfg = cfg or SimpleNamespace(num_warps=4, num_stages=None)
    return compile_asm(kernel, signature, {**constexprs, "PDL": pdl(target)}, target, num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages, divisible_by_16=[a for a in ALIGNED if a in signature], **options)


@pytest.mark.aot
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_mhc_compiles(target):
    """bf16 streams at V4-Flash, each kernel as its launch compiles it there: the products on the
    matrix units, the norm's reciprocal root, post * block_out rounded before the sum, and the post
    that writes the next pre's partials (at a decode step's 16-token block and at the table's block)
    in registers alone where the table was chosen (sm_90; AMD: no scratch), with 16-byte stores of
    the new streams at the table's block; a model's first pre also reading one row as every stream."""
    sig, cfg = _signature("bf16"), pick(mhc.MIX, target)
    token = dict(N=4, NP=4, SPLITS=128, BLOCK_D=cfg.block_d)
    post = dict(N=4, NP=4, MP=32, BLOCK_D=cfg.post.block_k // 4)
    asm = {"partials": _compile(mhc_partials.mix_partials_kernel, sig["partials"],
                                {"BLOCK_T": cfg.partials.block_t, "BLOCK_K": cfg.partials.block_k, "MP": 32,
                                 "BROADCAST": False}, target,
                                cfg.partials),
           "pre": _compile(mhc.pre_mix_kernel, sig["pre"], {**token, "MP": 32, "NORM": False,
                                                            "ROUND_BEFORE_WEIGHT": False}, target),
           "pre_norm": _compile(mhc.pre_mix_kernel, sig["pre"], {**token, "MP": 32, "NORM": True,
                                                                 "ROUND_BEFORE_WEIGHT": False}, target),
           "head_norm": _compile(mhc.head_mix_kernel, sig["head"], {**token, "MP": 16, "NORM": True,
                                                                    "ROUND_BEFORE_WEIGHT": False}, target),
           "post": _compile(mhc_partials.post_mix_kernel, sig["post"],
                            {**post, "BLOCK_T": 16, "PARTIALS": False}, target, cfg.post, enable_fp_fusion=False),
           "post_pre": _compile(mhc_partials.post_mix_kernel, sig["post"], {**post, "BLOCK_T": 16, "PARTIALS": True},
                                target, cfg.post, enable_fp_fusion=False, sass=target.startswith("sm_")),
           "post_pre_prefill": _compile(mhc_partials.post_mix_kernel, sig["post"],
                                        {**post, "BLOCK_T": cfg.post.block_t, "PARTIALS": True}, target, cfg.post,
                                        enable_fp_fusion=False, sass=target.startswith("sm_")),
           **{f"boundary_{tail}": _compile(mhc_boundary.boundary_kernel, sig["boundary"],
                                           {**post, "MP": 16 if tail == "head" else 32, "BLOCK_T": 16,
                                            "SPLITS": 128, "TOKEN_BLOCK_D": cfg.boundary_block_d,
                                            "HEAD": tail == "head",
                                            "NORM": True, "ROUND_BEFORE_WEIGHT": False},
                                           target, cfg.post, enable_fp_fusion=False, sass=target.startswith("sm_"))
              for tail in ("pre", "head")},
           **{f"first_{tail}": _compile(mhc_boundary.pre_kernel, sig["first"],
                                        {"N": 4, "NP": 4, "MP": 16 if tail == "head" else 32, "BLOCK_T": 16,
                                         "BLOCK_K": cfg.partials.block_k, "SPLITS": 128,
                                         "TOKEN_BLOCK_D": cfg.boundary_block_d, "HEAD": tail == "head", "NORM": True,
                                         "ROUND_BEFORE_WEIGHT": False, "BROADCAST": tail == "pre_broadcast"},
                                        target, cfg.partials, sass=target.startswith("sm_"))
              for tail in ("pre", "head", "pre_broadcast")}}  # broadcast: the embedding's row as every stream
    boundaries = ("boundary_pre", "boundary_head", "first_pre", "first_head", "first_pre_broadcast")
    if target.startswith("sm_"):
        assert all(f".target {target}a" in a["ptx"] for a in asm.values())
        assert all("mma" in asm[k]["ptx"] for k in ("partials", "post_pre", "post_pre_prefill"))
        assert "rsqrt" in asm["pre_norm"]["ptx"] and "rsqrt" in asm["head_norm"]["ptx"]
        assert "st.global.v4.b32" in asm["post_pre_prefill"]["ptx"]  # 16 bytes of a stream a thread
        for k in ("post", "post_pre", "post_pre_prefill", "boundary_pre", "boundary_head"):
            assert "fma.rn.bf16" not in asm[k]["ptx"], k  # post * block_out is rounded before the sum
        for k in boundaries:  # the product on the matrix units, the arrival released and acquired at GPU scope
            assert "mma" in asm[k]["ptx"] and "atom.global.gpu.acq_rel.add" in asm[k]["ptx"], k
            assert "bar.sync" in asm[k]["ptx"] and "rsqrt" in asm[k]["ptx"], k
        if target == "sm_90":  # the table's arch
            assert local_memory_ops(asm["post_pre"]["sass"]) == local_memory_ops(asm["post_pre_prefill"]["sass"]) == 0
            assert all(local_memory_ops(asm[k]["sass"]) == 0 for k in boundaries)
    else:
        assert all(target in amdgcn_target(a["amdgcn"]) for a in asm.values())
        assert all("mfma" in asm[k]["amdgcn"] for k in ("partials", "post_pre", "post_pre_prefill", *boundaries))
        assert all("ScratchSize: 0" in asm[k]["amdgcn"] for k in ("post", "post_pre", "post_pre_prefill", *boundaries))
        assert all(amd_scratch_and_lds(asm[k])[1] <= LDS_BYTES[target] for k in boundaries)
        assert all("global_atomic_add" in asm[k]["amdgcn"] for k in boundaries)
