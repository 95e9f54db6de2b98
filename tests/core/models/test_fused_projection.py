"""FusedProjection: the parts of one input as one GEMM per weight format, each part's output a view.

Weights and inputs are small random integers (FP8 codes with power-of-two block scales), so every
sum is exact in fp32 and the fused and separate products must agree to the bit whatever order the
GEMM sums in. With general floats they need not: CPU BLAS picks its kernel, and with it the order
of the K sums, by the whole problem's shape, so a column of the concatenated GEMM can differ from
the separate GEMM's in the last bits (at 7 or more rows, a part of 4 columns beside 576 others).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.models.fused_projection import FusedProjection
from engine.core.models.layers import Linear, RMSNorm
from engine.core.native.linear import NativeLinear
from engine.core.native.quant import FP8

BACKEND = NativeLinear(None)


def dense(k: int, n: int, dtype: torch.dtype = torch.float32, bias: bool = False) -> Linear:
    part = Linear(k, n, BACKEND, bias=bias, dtype=dtype, device="cpu")
    part.weight.data.copy_(torch.randint(-8, 9, (n, k)))
    if bias:
        part.bias.data.copy_(torch.randint(-8, 9, (n,)))
    return part


def fp8_block(k: int, n: int) -> Linear:
    part = Linear(k, n, BACKEND, dtype=torch.float32, device="cpu")
    blocks = (-(-n // 128), -(-k // 128))
    part.keep_quantized("fp8_block", FP8, blocks)
    part.weight.data.copy_(torch.randint(-16, 17, (n, k)).to(FP8))  # integers to 16 are exact in E4M3
    part.weight_scale.data.copy_(torch.exp2(torch.randint(-3, 4, blocks).float()))
    return part


def dequantized(part: Linear) -> torch.Tensor:
    """The part's weight as fp32 values (an FP8 one times its block scales)."""
    weight = part.weight.float()
    if part.weight_scale is None:
        return weight
    n, k = weight.shape
    return weight * part.weight_scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]


def check(parts: dict[str, Linear], k: int, dtype: torch.dtype = torch.float32) -> FusedProjection:
    """Fuse ``parts``: each output equals the part's own product, and each part's weight (and scale)
    keeps its values as a view of its group's concatenated one."""
    x = torch.randint(-4, 5, (random.randint(1, 9), k)).to(dtype)
    want = {name: part(x) for name, part in parts.items()}
    before = {name: (part.weight.clone(), part.weight_scale) for name, part in parts.items()}
    proj = FusedProjection(parts)
    proj.fuse()
    got = proj(x)
    assert got.keys() == parts.keys()
    for name, part in parts.items():
        assert torch.equal(got[name], want[name]), name
        assert torch.equal(part.weight, before[name][0]) and torch.equal(part(x), want[name]), name
    for weight, names, sizes in proj.groups:
        assert sizes == [parts[n].weight.shape[0] for n in names] and weight.data.shape[0] == sum(sizes)
        offset = 0
        for n, size in zip(names, sizes):
            assert parts[n].weight.data_ptr() == weight.data[offset].data_ptr()
            if weight.scale is not None:
                assert parts[n].weight_scale.data_ptr() == weight.scale[offset // 128].data_ptr()
                assert torch.equal(parts[n].weight_scale, before[n][1])
            offset += size
    return proj


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_parts_are_one_gemm(seed, dtype):
    k = random.randint(1, 300)
    parts = {f"p{i}": dense(k, random.randint(1, 300), dtype) for i in range(random.randint(2, 7))}
    proj = check(parts, k, dtype)
    assert [names for _, names, _ in proj.groups] == [list(parts)]


def test_each_format_is_one_gemm(seed):
    """FP8 parts of whole 128-row blocks share one GEMM (their scales concatenated), dense parts
    another; an FP8 part of a partial block and a part with a bias run alone."""
    k = random.randint(1, 300)
    parts = {"fp8": fp8_block(k, 128 * random.randint(1, 3)), "dense": dense(k, random.randint(1, 300)),
             "fp8_partial": fp8_block(k, 128 * random.randint(0, 2) + random.randint(1, 127)),
             "fp8_too": fp8_block(k, 128 * random.randint(1, 3)), "biased": dense(k, random.randint(1, 300), bias=True),
             "dense_too": dense(k, random.randint(1, 300))}
    order = list(parts)
    random.shuffle(order)
    parts = {name: parts[name] for name in order}
    proj = check(parts, k)
    groups = sorted(sorted(names) for _, names, _ in proj.groups)
    assert groups == [["biased"], ["dense", "dense_too"], ["fp8", "fp8_too"], ["fp8_partial"]]
    schemes = {tuple(sorted(names)): weight.scheme for weight, names, _ in proj.groups}
    assert schemes[("fp8", "fp8_too")] == "fp8_block" and schemes[("dense", "dense_too")] == "dense"


def test_one_backend_and_fused_before_use():
    other = Linear(8, 8, NativeLinear(None), dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="one linear backend"):
        FusedProjection({"a": dense(8, 8), "b": other})
    with pytest.raises(RuntimeError, match="fuse"):
        FusedProjection({"a": dense(8, 8)})(torch.zeros(1, 8))


@pytest.mark.parametrize("formats", [("dense", "dense"), ("fp8", "dense")])
def test_normed_projects_the_norm_of_x(seed, formats):
    """One group (the norm then in the backend's ``norm_linear``) or several (one norm for all): each
    part's output is the part's product with the norm of x, within fp32's bound for a K-term sum in
    another order (the norm's outputs are general floats, so the concatenated GEMM may sum its
    columns otherwise than the part's own; see the module docstring)."""
    k = 128
    make = {"dense": lambda: dense(k, random.randint(1, 300)), "fp8": lambda: fp8_block(k, 128)}
    parts = {f"p{i}": make[f]() for i, f in enumerate(formats)}
    norm = RMSNorm(k, 1e-6, dtype=torch.float32, device="cpu")
    norm.weight.data.copy_(torch.rand(k) + 0.5)
    x = torch.randn(random.randint(1, 4), k)
    want = {name: part(norm(x)) for name, part in parts.items()}
    proj = FusedProjection(parts)
    proj.fuse()
    assert len(proj.groups) == len(set(formats))
    got = proj.normed(x, norm)
    assert got.keys() == want.keys()
    eps = torch.finfo(torch.float32).eps
    for name, part in parts.items():
        bound = k * eps * (norm(x).abs() @ dequantized(part).abs().T)
        assert (got[name] - want[name]).abs().le(bound).all(), name


class CountingLinear(NativeLinear):
    """The native linear backend, counting the chained products it is handed."""

    def __init__(self) -> None:
        super().__init__(None)
        self.chained = 0

    def projection_then_normed(self, *args):
        self.chained += 1
        return super().projection_then_normed(*args)


@pytest.mark.parametrize("lead", ["dense", "fp8"])
def test_then_normed_hands_the_leading_group_to_the_backend(seed, lead):
    """The input's projections, the first part (``q``) leading its group, then the projections of q's
    norm: the backend gets the leading group and the next projection's one group in one call, the
    other group apart; every output is what ``self(x)`` then ``normed`` give, to the bit (integer
    weights and inputs, one norm computed the same way)."""
    backend = CountingLinear()
    k, q = 128, 128

    def part(kind, n, k=k):
        made = dense(k, n) if kind == "dense" else fp8_block(k, n)
        made.backend = backend
        return made

    first = FusedProjection({"q": part(lead, q), "kv": part(lead, 128), "other": part(
        "fp8" if lead == "dense" else "dense", 128)})
    then = FusedProjection({"a": part("dense", 40, q), "b": part("dense", 24, q)})
    first.fuse()
    then.fuse()
    norm = RMSNorm(q, 1e-6, dtype=torch.float32, device="cpu")
    norm.weight.data.copy_(torch.rand(q) + 0.5)
    x = torch.randint(-4, 5, (3, k)).float()
    out, normed = first.then_normed(x, "q", norm, then)
    assert backend.chained == 1
    want = first(x)
    assert out.keys() == want.keys() and all(torch.equal(out[n], want[n]) for n in want)
    want_normed = then.normed(want["q"], norm)
    assert normed.keys() == want_normed.keys() and all(torch.equal(normed[n], want_normed[n]) for n in want_normed)
