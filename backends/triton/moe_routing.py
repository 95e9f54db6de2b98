"""MoE routing in one launch: router logits -> (weights, expert ids) per token, on the device.

What ``NativeMoE.route`` computes for ungrouped routing, rounding apart: scores (softmax, sigmoid
or DeepSeek-V4's sqrtsoftplus) in fp32; the experts chosen by the scores plus the correction bias
(no-aux routing), best first, among equal choice scores the lowest expert id first (a stable
descending sort; ``torch.topk`` picks and orders exact ties its own way), or read from the hash
table by token id; the weights are the unbiased scores of the chosen experts, renormalised and
times the routed scaling factor; a shared expert (``RoutingConfig.shared_expert``) is one column
more, weight 1, written by the same program.

Everything is sized by the logits' shape, so a step that routes can be captured in a graph. A
program takes BLOCK_T tokens and every expert of them; the top-k is TOP_K rounds of (max, lowest
id at the max, remove it). Grouped top-k (DeepSeek-V3) is not here: ``TritonMoE.route`` gives it to
the native routing, torch ops with no host synchronisation either.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.core.families.moe import RoutingConfig

from .pdl import launch_options, wait_for_prior
from .target import config_for

SCORINGS = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch's: above it softplus(x) is x
# logits held per program (BLOCK_T = this // experts rows) and warps
ROUTE_TILE = {"cuda": (2048, 4), "hip": (2048, 4), "default": (512, 4)}


@triton.jit
def _softplus(x):
    """log(1 + e**x) as torch computes it: x past the threshold, else log1p(e**x), where log1p(u)
    is log(1 + u) * u / ((1 + u) - 1), exact to a few ulp even where 1 + u rounds to 1."""
    u = tl.exp(tl.minimum(x, SOFTPLUS_THRESHOLD))
    v = 1.0 + u
    d = v - 1.0
    log1p = tl.where(d == 0.0, u, tl.log(v) * (u / tl.where(d == 0.0, 1.0, d)))
    return tl.where(x > SOFTPLUS_THRESHOLD, x, log1p)


@triton.jit
def route_rows(logits_ptr, bias_ptr, table_ptr, token_ids_ptr, rows, live, E, stride_l, scaling,
               SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, HASHED: tl.constexpr, RENORMALIZE: tl.constexpr,
               TOP_K: tl.constexpr, K_POW2: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_T: tl.constexpr,
               ROUND_TO: tl.constexpr, SHARED: tl.constexpr):
    """The routing of tokens ``rows`` (those ``live``) -> (expert ids [BLOCK_T, K_POW2] int64, weights
    [BLOCK_T, K_POW2] fp32): slots 0..TOP_K-1 the routed experts (weights rounded to ROUND_TO), slot
    TOP_K expert SHARED with weight 1 where SHARED >= 0; K_POW2 covers them all."""
    experts = tl.arange(0, EXPERTS)
    real = experts < E
    mask = live[:, None] & real[None, :]
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_l + experts[None, :], mask=mask,
                other=0.0).to(tl.float32)
    if SCORING == 0:
        x = tl.where(real[None, :], x, float("-inf"))
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        scores = e / tl.sum(e, axis=1)[:, None]
    elif SCORING == 1:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        scores = tl.sqrt_rn(_softplus(x))
    scores = tl.where(real[None, :], scores, 0.0)
    if not HASHED:
        choice = scores
        if HAS_BIAS:
            choice += tl.load(bias_ptr + experts, mask=real, other=0.0).to(tl.float32)[None, :]
        choice = tl.where(real[None, :], choice, float("-inf"))
    else:
        token = tl.load(token_ids_ptr + rows, mask=live, other=0).to(tl.int64)
    slots = tl.arange(0, K_POW2)
    chosen = tl.zeros((BLOCK_T, K_POW2), dtype=tl.int64)
    picked = tl.zeros((BLOCK_T, K_POW2), dtype=tl.float32)
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)  # summed in k order, whatever K_POW2 is
    for k in tl.static_range(TOP_K):
        if HASHED:
            expert = tl.load(table_ptr + token * TOP_K + k, mask=live, other=0).to(tl.int32)
        else:
            best = tl.max(choice, axis=1)
            expert = tl.min(tl.where(choice == best[:, None], experts[None, :], EXPERTS), axis=1)
            choice = tl.where(experts[None, :] == expert[:, None], float("-inf"), choice)
        weight = tl.sum(tl.where(experts[None, :] == expert[:, None], scores, 0.0), axis=1)
        chosen = tl.where(slots[None, :] == k, expert.to(tl.int64)[:, None], chosen)
        picked = tl.where(slots[None, :] == k, weight[:, None], picked)
        total += weight
    if RENORMALIZE:
        picked = picked / (total[:, None] + 1e-20)  # the epsilon guards 0/0, as native's
    picked = (picked * scaling).to(ROUND_TO).to(tl.float32)
    if SHARED >= 0:
        chosen = tl.where(slots[None, :] == TOP_K, SHARED, chosen)
        picked = tl.where(slots[None, :] == TOP_K, 1.0, picked)
    return chosen, picked


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, table_ptr, token_ids_ptr, weights_ptr, ids_ptr, T, E, stride_l, scaling,
                  SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, HASHED: tl.constexpr, RENORMALIZE: tl.constexpr,
                  TOP_K: tl.constexpr, K_POW2: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_T: tl.constexpr,
                  ROUND_TO: tl.constexpr, SHARED: tl.constexpr, PDL: tl.constexpr):
    """weights [T, WIDTH] fp32 (rounded to ROUND_TO first) and ids [T, WIDTH] int64 of BLOCK_T tokens:
    the TOP_K routed experts, then, where SHARED >= 0, expert SHARED with weight 1 (WIDTH = TOP_K + 1)."""
    wait_for_prior(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = rows < T
    chosen, picked = route_rows(logits_ptr, bias_ptr, table_ptr, token_ids_ptr, rows, live, E, stride_l, scaling,
                                SCORING, HAS_BIAS, HASHED, RENORMALIZE, TOP_K, K_POW2, EXPERTS, BLOCK_T, ROUND_TO,
                                SHARED)
    store_routes(weights_ptr, ids_ptr, rows, live, chosen, picked, TOP_K + (SHARED >= 0), K_POW2)


@triton.jit
def store_routes(weights_ptr, ids_ptr, rows, live, chosen, picked, WIDTH: tl.constexpr, K_POW2: tl.constexpr):
    """Rows ``rows`` of weights and ids [T, WIDTH]."""
    slots = tl.arange(0, K_POW2)
    out = rows.to(tl.int64)[:, None] * WIDTH + slots[None, :]
    keep = live[:, None] & (slots[None, :] < WIDTH)
    tl.store(weights_ptr + out, picked, mask=keep)
    tl.store(ids_ptr + out, chosen, mask=keep)


ROUNDINGS = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def routing_arguments(router_logits: torch.Tensor, cfg: RoutingConfig, input_ids: torch.Tensor | None
                      ) -> tuple[tuple, dict]:
    """What ``route_rows`` takes after the token rows, checked: (tensors and scalars, constexprs)."""
    if cfg.num_groups > 1:
        raise ValueError("grouped top-k is not in the routing kernel; route it natively")
    if cfg.scoring not in SCORINGS:
        raise ValueError(f"scoring {cfg.scoring!r} is not supported; supported: {sorted(SCORINGS)}")
    e = router_logits.shape[1]
    if e != cfg.num_experts:
        raise ValueError(f"router logits have {e} experts, the routing {cfg.num_experts}")
    hashed = cfg.hash_table is not None
    if hashed and input_ids is None:
        raise ValueError("hash routing needs the token ids")
    if hashed and (cfg.hash_table.dim() != 2 or cfg.hash_table.shape[1] != cfg.top_k):
        raise ValueError(f"hash table {list(cfg.hash_table.shape)} is not [vocab, top_k={cfg.top_k}]")
    if cfg.weight_dtype not in ROUNDINGS:
        raise ValueError(f"routing weights rounded to {cfg.weight_dtype}: supported {sorted(map(str, ROUNDINGS))}")
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    shared = -1 if cfg.shared_expert is None else cfg.shared_expert
    bias = None if hashed else cfg.correction_bias
    table = cfg.hash_table.contiguous() if hashed else None
    tokens = input_ids.reshape(-1).contiguous() if hashed else None
    args = (logits, bias, table, tokens, e, logits.stride(0), float(cfg.routed_scaling_factor))
    constexprs = dict(SCORING=SCORINGS[cfg.scoring], HAS_BIAS=bias is not None, HASHED=hashed,
                      RENORMALIZE=cfg.renormalize, TOP_K=cfg.top_k, K_POW2=triton.next_power_of_2(route_width(cfg)),
                      EXPERTS=triton.next_power_of_2(e), ROUND_TO=ROUNDINGS[cfg.weight_dtype], SHARED=shared)
    return args, constexprs


def route_width(cfg: RoutingConfig) -> int:
    """Columns of a route: top_k, and one more for a shared expert."""
    return cfg.top_k + (cfg.shared_expert is not None)


def route(router_logits: torch.Tensor, cfg: RoutingConfig, input_ids: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, K] fp32, expert ids [T, K] int64), K = top_k (+ 1 with a shared
    expert); ungrouped routing only."""
    (logits, bias, table, tokens, e, stride_l, scaling), constexprs = routing_arguments(router_logits, cfg, input_ids)
    t, device = logits.shape[0], logits.device
    weights = torch.empty(t, route_width(cfg), dtype=torch.float32, device=device)
    ids = torch.empty(t, route_width(cfg), dtype=torch.int64, device=device)
    if t == 0:
        return weights, ids
    tile, num_warps = config_for(ROUTE_TILE, device)
    block_t = triton.next_power_of_2(max(1, tile // constexprs["EXPERTS"]))
    _route_kernel[(triton.cdiv(t, block_t),)](
        logits, bias, table, tokens, weights, ids, t, e, stride_l, scaling, **constexprs, BLOCK_T=block_t,
        num_warps=num_warps, **launch_options(device))
    return weights, ids
