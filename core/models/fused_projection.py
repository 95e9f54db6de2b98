"""Several projections of one input as one GEMM.

A decode step of a small model is launch-bound, and a layer often projects the same input several
times (DeepSeek-V4's attention input feeds the low-rank q, the KV and each compressor). The parts
stay the ``Linear`` layers the checkpoint names: they load as before, may keep the format their
checkpoint stores, and are what the model's parameters list. ``fuse``, called once the weights are
in, concatenates the parts that one weight can hold into one [sum N, K] weight per group and makes
each part's weight (and scale) a view of it, so the memory is held once and one launch computes
the group. A group is the parts in one format: dense, or FP8 with block scales of one edge (128, or
DeepSeek-V4.1's 32) where each part fills whole blocks of rows (its scale rows then concatenate
too); any other part runs alone.
Which parts a checkpoint quantizes is known only once it is read (DeepSeek's published layout
keeps some of these projections in FP8 and others in bf16), hence after loading, not before.

An input that an RMSNorm feeds (V4's low-rank q, which both query projections read) goes through
``normed``: with one group the linear backend may fuse the norm into the GEMM's prologue, which
then costs no launch of its own. Where that input is itself the leading part of another group's
product (the low-rank q among the attention input's projections), ``then_normed`` hands both
products to the linear backend at once (``projection_then_normed``), which may run them as one
launch.
"""

from __future__ import annotations

import torch

from ..families.linear import LinearWeight
from .layers import Linear, RMSNorm


def _group_key(part: Linear) -> tuple | None:
    """Parts with equal keys concatenate into one weight; None: this part runs alone."""
    if part.bias is not None:
        return None
    if part.scheme == "dense":
        return "dense", part.weight.dtype
    if part.scheme == "fp8_block":
        block = part.linear_weight.block
        if part.weight.shape[0] % block == 0:
            return "fp8_block", part.weight.dtype, block
    return None


class FusedProjection:
    """Named ``Linear`` parts of one input [..., K] (one linear backend); calling it returns each
    part's output, views of one product per group."""

    def __init__(self, parts: dict[str, Linear]) -> None:
        backends = {p.backend for p in parts.values()}
        if len(backends) != 1:
            raise ValueError(f"the parts of a FusedProjection share one linear backend, not {len(backends)}")
        (self.backend,) = backends
        self.parts = parts
        self.groups: list[tuple[LinearWeight, list[str], list[int]]] = []  # (weight, its parts, their N)

    def fuse(self) -> None:
        """Concatenate each group's weights (and scales) and make the parts views of them."""
        grouped: dict[object, list[str]] = {}
        for name, part in self.parts.items():
            grouped.setdefault(_group_key(part) or name, []).append(name)
        self.groups = []
        for names in grouped.values():
            parts = [self.parts[n] for n in names]
            sizes = [p.weight.shape[0] for p in parts]
            if len(parts) == 1:
                self.groups.append((parts[0].linear_weight, names, sizes))
                continue
            data = torch.cat([p.weight.data for p in parts])
            scale = None if parts[0].weight_scale is None else torch.cat([p.weight_scale.data for p in parts])
            block = parts[0].linear_weight.block if scale is not None else 1  # rows a scale row covers
            offset = 0
            for part, n in zip(parts, sizes):
                part.weight.data = data.narrow(0, offset, n)
                if scale is not None:
                    part.weight_scale.data = scale.narrow(0, offset // block, n // block)
                offset += n
            self.groups.append((LinearWeight(data, parts[0].scheme, scale), names, sizes))

    def __call__(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each part's product with x."""
        if not self.groups:
            raise RuntimeError("a FusedProjection runs once fuse() made its groups (the model calls it after loading)")
        out = {}
        for weight, names, sizes in self.groups:
            out.update(zip(names, self.backend.apply(x, weight).split(sizes, dim=-1)))
        return out

    def then_normed(self, x: torch.Tensor, part: str, norm: RMSNorm,
                    then: FusedProjection) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(``self(x)``, ``then.normed(self(x)[part], norm)``), the group that leads with ``part`` and
        ``then``'s one group through the backend's ``projection_then_normed``."""
        lead = next((g for g in self.groups if g[1][0] == part), None)
        if lead is None or len(then.groups) != 1 or then.backend is not self.backend:
            out = self(x)
            return out, then.normed(out[part], norm)
        out = {}
        for weight, names, sizes in self.groups:
            if weight is lead[0]:
                first, second = self.backend.projection_then_normed(x, weight, sizes[0], norm.weight, norm.eps,
                                                                    then.groups[0][0], norm.ops)
                out.update(zip(names, first.split(sizes, dim=-1)))
            else:
                out.update(zip(names, self.backend.apply(x, weight).split(sizes, dim=-1)))
        _, then_names, then_sizes = then.groups[0]
        return out, dict(zip(then_names, second.split(then_sizes, dim=-1)))

    def normed(self, x: torch.Tensor, norm: RMSNorm) -> dict[str, torch.Tensor]:
        """Each part's product with norm(x): one group's through the backend's ``norm_linear`` (the
        norm in its prologue where it can), several groups' from one norm of x."""
        if len(self.groups) != 1:
            return self(norm(x))
        weight, names, sizes = self.groups[0]
        out, _ = self.backend.norm_linear(x, None, norm.weight, norm.eps, weight, norm.ops)
        return dict(zip(names, out.split(sizes, dim=-1)))
