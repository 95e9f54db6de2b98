"""Copying checkpoint tensors into a model's parameters, with the checks a user needs.

A model maps each checkpoint name to a :class:`Target`: the parameter, and optionally the row
range of a fused projection and the expert index of a stacked expert tensor. Every element of
every parameter must be written exactly once; anything else is an error that names the tensor.
Parameters are looked up as each tensor arrives, so a layer may switch to the format its
checkpoint stores (DeepSeek-V4's resident FP8 and FP4 weights) before that tensor is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn


@dataclass(frozen=True)
class Target:
    param: str
    rows: tuple[int, int] | None = None  # (offset, count) along the rows (of one expert's slice)
    expert: int | None = None
    part: tuple[int, int, int] | None = None  # (dim, index, count) of the checkpoint tensor; None: the parameter's


Resolver = Callable[[str], "Target | None"]  # None: a tensor the model deliberately ignores


class WeightLoadError(ValueError):
    pass


def load_into(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], resolve: Resolver,
              shared: dict[str, str] | None = None) -> None:
    """Fill ``model``'s parameters; ``shared`` maps a parameter to the one it is tied to."""
    shared = shared or {}
    written: dict[str, int] = {}
    for name, tensor in weights:
        target = resolve(name)
        if target is None:
            continue
        try:
            param = model.get_parameter(target.param)
        except AttributeError:
            raise WeightLoadError(f"checkpoint tensor {name!r} maps to {target.param!r}, "
                                  f"which the model lacks") from None
        dest = param.data
        part = target.part or getattr(param, "partition", None)
        if target.expert is not None:
            dest = dest[target.expert]
        if target.rows is not None:
            offset, count = target.rows
            dest = dest.narrow(0, offset, count)
        if part is not None:
            tensor = take_part(tensor, part, dest.shape)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise WeightLoadError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"but {target.param!r} expects {tuple(dest.shape)} there"
            )
        dest.copy_(tensor)
        written[target.param] = written.get(target.param, 0) + tensor.numel()
    params = dict(model.named_parameters(remove_duplicate=False))
    for tied, source in shared.items():
        if written.get(tied, 0) == 0 and source in written:
            params[tied].data = params[source].data
            written[tied] = params[tied].numel()
    incomplete = [n for n, p in params.items() if written.get(n, 0) != p.numel()]
    if incomplete:
        detail = ", ".join(f"{n} ({written.get(n, 0)}/{params[n].numel()} elements)" for n in incomplete[:8])
        more = f" and {len(incomplete) - 8} more" if len(incomplete) > 8 else ""
        raise WeightLoadError(f"checkpoint does not fill every parameter: {detail}{more}")


def read_back(model: nn.Module, target: Target) -> torch.Tensor:
    """What a checkpoint tensor resolved to ``target`` holds now in ``model`` (a view, detached):
    ``load_into``'s destination read instead of written (a trained model's export)."""
    p = model.get_parameter(target.param).detach()
    p = p[target.expert] if target.expert is not None else p
    return p.narrow(0, *target.rows) if target.rows is not None else p


def take_part(tensor: torch.Tensor, part: tuple[int, int, int], shape: torch.Size) -> torch.Tensor:
    """Chunk ``index`` of ``count`` along ``dim`` of a whole checkpoint tensor; a tensor of the part's
    size already is that chunk."""
    dim, index, count = part
    size = shape[dim] if dim < len(shape) else 0
    if count > 1 and tensor.dim() == len(shape) and tensor.shape[dim] == size * count:
        return tensor.narrow(dim, index * size, size)
    return tensor


def checkpoint_part(model: nn.Module, resolve: Resolver, name: str) -> tuple[int, int, int] | bool | None:
    """The part of checkpoint tensor ``name`` that ``model`` holds: None for all of it, False for
    none (a tensor it ignores, such as another rank's experts)."""
    target = resolve(name)
    if target is None:
        return False
    if target.part is not None:
        return target.part
    try:
        return getattr(model.get_parameter(target.param), "partition", None)
    except AttributeError:
        return None


def resident_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes the model's parameters hold, weights they stand for). A parameter may say how many
    weights an element holds in ``values_per_element``: 2 for packed FP4, 0 for a scale."""
    held = weights = 0
    for p in model.parameters():
        held += p.numel() * p.element_size()
        weights += p.numel() * getattr(p, "values_per_element", 1)
    return held, weights
