"""Top-k, top-p and min-p filtering and the draw in a few launches, without sorting the vocabulary;
and the sampling family's Triton backend.

The oracle (core/native/sampling.py) sorts every row to find where its probability mass reaches
top_p; over a 152K vocabulary that sort and the dozen torch ops around it took 0.22 ms of a 1.13 ms
Qwen3-0.6B decode step on the H200 (benchmarks/results/decode-breakdown-top-p-h200.json). Here
each row is split over many programs and the top-p cut is found by refinement: the cut lies in a
known interval of logit values, and each round measures the mass above 32 thresholds spread over
it, narrowing it 33-fold; four rounds leave it a millionth of its first width (under 3e-5 of a
logit), finer than the rounding of the running sums a sort takes. Top-k takes the row's k-th
largest logit from torch.topk (a radix select), min-p is a threshold under the row's largest
logit, and the draw is argmax(probs / noise) over the kept tokens, each program's best then the
row's.

Ties: where equal logits straddle a cut the oracle keeps some of them (by its sort order), a
threshold keeps them all; so do tokens within the last interval's width above the top-p cut.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from engine.core.families.sampling import SamplingBackend
from engine.core.to_device import to_device

THRESHOLDS = 32  # measured per row per round
ROUNDS = 4  # each narrows the cut's interval THRESHOLDS + 1 times
BLOCK = 1024  # logits a program reads per iteration in the stats and draw passes
ROUND_BLOCK = 128  # ... and in a round, where each meets every threshold


@triton.jit
def _row_norm(stats_ptr, row, S, S_P2: tl.constexpr):
    """The row's largest scaled logit and the sum of exp(x - max) over its kept tokens."""
    c = tl.arange(0, S_P2)
    m_c = tl.load(stats_ptr + (row * S + c) * 2, mask=c < S, other=float("-inf"))
    z_c = tl.load(stats_ptr + (row * S + c) * 2 + 1, mask=c < S, other=0.0)
    m = tl.max(m_c, 0)
    z = tl.sum(tl.where(m_c == float("-inf"), 0.0, z_c * tl.exp(m_c - m)), 0)
    return m, z


@triton.jit
def _cut_interval(cut_ptr, mass_ptr, row, B, S, target, ROUND: tl.constexpr, S_P2: tl.constexpr,
                  NT: tl.constexpr):
    """The interval round ``ROUND`` narrowed: the highest of its thresholds with at least ``target``
    mass at or above it, and the lowest with less."""
    lo = tl.load(cut_ptr + ((ROUND * B) + row) * 2)
    hi = tl.load(cut_ptr + ((ROUND * B) + row) * 2 + 1)
    j = tl.arange(0, NT)
    theta = lo + (hi - lo) * (j + 1).to(tl.float32) / (NT + 1)
    c = tl.arange(0, S_P2)
    parts = tl.load(mass_ptr + (((ROUND * B) + row) * S + c[:, None]) * NT + j[None, :], mask=(c < S)[:, None],
                    other=0.0)
    mass = tl.sum(parts, 0)
    new_lo = tl.max(tl.where(mass >= target, theta, lo), 0)
    new_hi = tl.min(tl.where(mass < target, theta, hi), 0)
    return new_lo, new_hi


@triton.jit
def _scaled(logits_ptr, stride, row, idx, V, t, floor, HAS_FLOOR: tl.constexpr):
    """The row's logits at ``idx`` over its temperature; -inf past the vocabulary and under top-k."""
    raw = tl.load(logits_ptr + row * stride + idx, mask=idx < V, other=float("-inf"))
    if HAS_FLOOR:
        raw = tl.where(raw >= floor, raw, float("-inf"))
    return raw / t


@triton.jit
def _stats_kernel(logits_ptr, stride, params_ptr, floor_ptr, stats_ptr, V, B, S, CHUNK,
                  HAS_FLOOR: tl.constexpr, BLOCK: tl.constexpr):
    """Per (row, chunk): the largest scaled logit kept and the sum of exp(x - it), online."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    t = tl.load(params_ptr + row)
    floor = tl.load(floor_ptr + row) if HAS_FLOOR else 0.0
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    z = tl.zeros([BLOCK], tl.float32)
    for off in range(c * CHUNK, (c + 1) * CHUNK, BLOCK):
        x = _scaled(logits_ptr, stride, row, off + tl.arange(0, BLOCK), V, t, floor, HAS_FLOOR)
        new = tl.maximum(m, x)
        safe = tl.where(new == float("-inf"), 0.0, new)
        z = z * tl.exp(m - safe) + tl.exp(x - safe)
        m = new
    top = tl.max(m, 0)
    safe = tl.where(top == float("-inf"), 0.0, top)
    tl.store(stats_ptr + (row * S + c) * 2, top)
    tl.store(stats_ptr + (row * S + c) * 2 + 1, tl.sum(z * tl.exp(m - safe), 0))


@triton.jit
def _round_kernel(logits_ptr, stride, params_ptr, floor_ptr, stats_ptr, cut_ptr, mass_ptr, V, B, S, CHUNK,
                  ROUND: tl.constexpr, HAS_FLOOR: tl.constexpr, S_P2: tl.constexpr, NT: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Per (row, chunk): the mass at or above each of the round's thresholds, over the chunk."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    t = tl.load(params_ptr + row)
    p = tl.load(params_ptr + B + row)
    floor = tl.load(floor_ptr + row) if HAS_FLOOR else 0.0
    m, z = _row_norm(stats_ptr, row, S, S_P2)
    if ROUND == 0:
        # tokens under lo hold less than (1 - p) of the mass between them: the cut is not below it
        lo = m + tl.log(tl.maximum((1.0 - p) * z / V, 1e-30))
        if HAS_FLOOR:
            lo = tl.maximum(lo, floor / t)
        hi = m
    else:
        lo, hi = _cut_interval(cut_ptr, mass_ptr, row, B, S, p * z, ROUND - 1, S_P2, NT)
    if c == 0:
        tl.store(cut_ptr + ((ROUND * B) + row) * 2, lo)
        tl.store(cut_ptr + ((ROUND * B) + row) * 2 + 1, hi)
    j = tl.arange(0, NT)
    theta = lo + (hi - lo) * (j + 1).to(tl.float32) / (NT + 1)
    acc = tl.zeros([BLOCK, NT], tl.float32)  # summed over the block once, at the end
    for off in range(c * CHUNK, (c + 1) * CHUNK, BLOCK):
        x = _scaled(logits_ptr, stride, row, off + tl.arange(0, BLOCK), V, t, floor, HAS_FLOOR)
        acc += tl.where(x[:, None] >= theta[None, :], tl.exp(x - m)[:, None], 0.0)
    tl.store(mass_ptr + (((ROUND * B) + row) * S + c) * NT + j, tl.sum(acc, 0))


@triton.jit
def _draw_kernel(logits_ptr, stride, noise_ptr, noise_stride, params_ptr, floor_ptr, stats_ptr, cut_ptr, mass_ptr,
                 best_ptr, best_idx_ptr, V, B, S, CHUNK, ROUNDS: tl.constexpr, HAS_FLOOR: tl.constexpr,
                 S_P2: tl.constexpr, NT: tl.constexpr, BLOCK: tl.constexpr):
    """Per (row, chunk): argmax(exp(x - max) / noise) over the kept tokens, the lowest index of equals."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    t = tl.load(params_ptr + row)
    p = tl.load(params_ptr + B + row)
    min_p = tl.load(params_ptr + 2 * B + row)
    floor = tl.load(floor_ptr + row) if HAS_FLOOR else 0.0
    m, z = _row_norm(stats_ptr, row, S, S_P2)
    cut = float("-inf")
    if ROUNDS > 0:
        lo, _ = _cut_interval(cut_ptr, mass_ptr, row, B, S, p * z, ROUNDS - 1, S_P2, NT)
        cut = tl.where(p < 1.0, lo, float("-inf"))
    best = tl.full([BLOCK], -1.0, tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for off in range(c * CHUNK, (c + 1) * CHUNK, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        x = _scaled(logits_ptr, stride, row, idx, V, t, floor, HAS_FLOOR)
        e = tl.exp(x - m)
        q = tl.load(noise_ptr + row * noise_stride + idx, mask=idx < V, other=1.0)
        score = tl.where((x >= cut) & (e >= min_p) & (x > float("-inf")), e / tl.maximum(q, 1.1754943508222875e-38),
                         -1.0)
        better = score > best
        best = tl.where(better, score, best)
        best_idx = tl.where(better, idx, best_idx)
    top = tl.max(best, 0)
    tl.store(best_ptr + row * S + c, top)
    tl.store(best_idx_ptr + row * S + c, tl.min(tl.where(best == top, best_idx, 2147483647), 0))


@triton.jit
def _pick_kernel(best_ptr, best_idx_ptr, out_ptr, S, S_P2: tl.constexpr):
    """The row's token: the best of its chunks', the lowest index of equals."""
    row = tl.program_id(0)
    c = tl.arange(0, S_P2)
    best = tl.load(best_ptr + row * S + c, mask=c < S, other=-2.0)
    idx = tl.load(best_idx_ptr + row * S + c, mask=c < S, other=2147483647)
    top = tl.max(best, 0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, idx, 2147483647), 0).to(tl.int64))


@lru_cache
def _programs(device: torch.device) -> int:
    """Programs to spread a batch over: two per multiprocessor; a few on the interpreter."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _chunk(batch: int, vocab: int, device: torch.device) -> int:
    """Logits per program: a row over as many programs as keep the device busy, BLOCK at least."""
    per_row = max(1, _programs(device) // batch)
    return triton.cdiv(triton.cdiv(vocab, per_row), BLOCK) * BLOCK


def _top_k_floor(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor | None:
    """Each row's k-th largest logit (-inf where top-k is off); None where no row uses top-k."""
    vocab = logits.shape[1]
    ks = [k if 0 < k < vocab else 0 for k in top_k]
    if not any(ks):
        return None
    values = logits.topk(max(ks), dim=1).values
    kth = values.gather(1, to_device([[max(k - 1, 0)] for k in ks], torch.int64, logits.device))[:, 0]
    return kth.masked_fill_(to_device([k == 0 for k in ks], torch.bool, logits.device), float("-inf"))


def sample(logits: torch.Tensor, noise: torch.Tensor, temperature: list[float], top_k: list[int],
           top_p: list[float], min_p: list[float], chunk: int | None = None) -> torch.Tensor:
    """``SamplingBackend.draw`` (core/families/sampling.py); ``chunk``: logits per program (a multiple
    of BLOCK or a power of two under it; default: spread over the device)."""
    if logits.dtype != torch.float32 or noise.shape != logits.shape or logits.stride(1) != 1 or noise.stride(1) != 1:
        raise ValueError("logits and noise must be fp32 [B, V] with contiguous rows")
    batch, vocab = logits.shape
    dev = logits.device
    chunk = chunk or _chunk(batch, vocab, dev)
    block, round_block = min(BLOCK, chunk), min(ROUND_BLOCK, chunk)
    if chunk % block:
        raise ValueError(f"chunk {chunk} must be a multiple of {block}")
    s = triton.cdiv(vocab, chunk)
    s_p2 = triton.next_power_of_2(s)
    rounds = ROUNDS if any(p < 1 for p in top_p) else 0
    params = to_device([*temperature, *top_p, *min_p], torch.float32, dev)
    floor = _top_k_floor(logits, top_k)
    has_floor = floor is not None
    floor = floor if has_floor else params
    scratch = torch.empty(batch * s * (2 + 1 + max(rounds, 1) * THRESHOLDS) + max(rounds, 1) * batch * 2,
                          dtype=torch.float32, device=dev)
    stats, best, mass, cut = scratch.split([batch * s * 2, batch * s, max(rounds, 1) * batch * s * THRESHOLDS,
                                            max(rounds, 1) * batch * 2])
    best_idx = torch.empty(batch * s, dtype=torch.int32, device=dev)
    grid = (batch, s)
    _stats_kernel[grid](logits, logits.stride(0), params, floor, stats, vocab, batch, s, chunk,
                        HAS_FLOOR=has_floor, BLOCK=block, num_warps=4)
    for r in range(rounds):
        _round_kernel[grid](logits, logits.stride(0), params, floor, stats, cut, mass, vocab, batch, s, chunk,
                            ROUND=r, HAS_FLOOR=has_floor, S_P2=s_p2, NT=THRESHOLDS, BLOCK=round_block, num_warps=4)
    _draw_kernel[grid](logits, logits.stride(0), noise, noise.stride(0), params, floor, stats, cut, mass, best,
                       best_idx, vocab, batch, s, chunk, ROUNDS=rounds, HAS_FLOOR=has_floor, S_P2=s_p2,
                       NT=THRESHOLDS, BLOCK=block, num_warps=4)
    out = torch.empty(batch, dtype=torch.int64, device=dev)
    _pick_kernel[(batch,)](best, best_idx, out, s, S_P2=s_p2, num_warps=1)
    return out


def _int_class(n: int) -> int:
    """How Triton specializes an integer argument: equal to 1, a multiple of 16, or neither."""
    return 1 if n == 1 else 16 if n % 16 == 0 else 0


def launch_classes(vocab: int, max_rows: int, device: torch.device) -> dict[tuple, int]:
    """The smallest row count of each set of kernels ``sample`` compiles for batches of 1 to
    ``max_rows`` rows: the row count B, the chunk count S and the chunk length are integer
    arguments (specialized by class), S's power of two a constexpr, and the scratch buffers start
    B * S * (8, 12, ...) bytes into one allocation, 16-byte aligned (a pointer's class) or not by
    B * S mod 4; all vary with the batch."""
    classes: dict[tuple, int] = {}
    for rows in range(1, max_rows + 1):
        chunk = _chunk(rows, vocab, device)
        s = triton.cdiv(vocab, chunk)
        key = (_int_class(rows), _int_class(s), triton.next_power_of_2(s), _int_class(chunk), rows * s % 4)
        classes.setdefault(key, rows)
    return classes


class TritonSampling(SamplingBackend):
    name = "triton"

    def warm_up(self, vocab_size: int, max_rows: int, device: torch.device) -> None:
        """One draw per launch class and per filter set: with and without top-k (HAS_FLOOR), with
        and without top-p (ROUNDS), the constexprs a served batch's parameters pick."""
        for rows in launch_classes(vocab_size, max_rows, device).values():
            logits = torch.zeros(rows, vocab_size, device=device)
            noise = torch.ones_like(logits)
            for top_k in (0, 1):
                for top_p in (1.0, 0.5):
                    sample(logits, noise, [1.0] * rows, [top_k] * rows, [top_p] * rows, [0.0] * rows)

    def draw(self, logits: torch.Tensor, noise: torch.Tensor, temperature: list[float], top_k: list[int],
             top_p: list[float], min_p: list[float]) -> torch.Tensor:
        return sample(logits.contiguous(), noise, temperature, top_k, top_p, min_p)
