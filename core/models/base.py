"""What every model class provides to the runner, and the backends it is built with."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from ..config import ModelConfig
from ..distributed.group import SINGLE, ParallelGroup
from ..distributed.moe import expert_placement
from ..families.attention import AttentionBackend
from ..families.linear import LinearBackend
from ..families.mhc import MHCBackend
from ..families.moe import MoEBackend
from ..families.norm import NormBackend
from ..families.v4_attention import V4AttentionBackend
from ..forward import ForwardBatch
from ..kv.storage import KVCache, KVLayerSpec


@dataclass(frozen=True)
class Backends:
    """The implementations selected at start-up; layers hold them as plain objects. A family the
    model's ``blocks`` do not name is not selected (None). ``tp``: the tensor-parallel group the
    parallel layers split their weights over and run their collectives on (core/distributed);
    ``expert_parallel``: MoE layers place whole experts on its ranks instead of splitting each;
    ``moe_group``: the group MoE layers span, ``tp`` or, under data-parallel attention (``dp_attention``:
    each rank's tokens are its own, attention whole on every rank), every rank while ``tp`` is one."""

    attention: AttentionBackend | None = None
    linear: LinearBackend | None = None
    norm: NormBackend | None = None
    moe: MoEBackend | None = None
    v4_attention: V4AttentionBackend | None = None
    mhc: MHCBackend | None = None
    tp: ParallelGroup = SINGLE
    expert_parallel: bool = False
    moe_group: ParallelGroup = SINGLE
    dp_attention: bool = False

    def experts(self):
        """How an MoE layer's experts are placed over ``moe_group`` and how its tokens reach them."""
        return expert_placement(self.moe_group, self.expert_parallel, self.dp_attention, self.tp)


class CausalLM(nn.Module, ABC):
    """A decoder-only LM over packed, paged batches.

    Built on the meta device or directly on the target device with empty parameters, then filled
    by ``load_weights``; no parameter is ever initialised twice.
    """

    # True if forward reads the batch's shape only from device tensors and its attention backend's
    # metadata, so a decode step can be captured in a graph (core/graph_runner.py)
    graph_safe: bool = True
    # token ids before each step's first new one that ``stage`` reads on the host (0: it reads none);
    # a model that reads some needs every input id of a step on the host when the step is formed
    token_history: int = 0
    # > 0: a prefill runs some layers only over the last ``replay_tail`` tokens of each sequence
    # (DeepSeek-V4.1's SWA bounded replay): the runner passes each sequence's length
    # (ForwardBatch.prompt_ends_cpu) and a prefix hit leaves those tokens to compute
    replay_tail: int = 0
    # what runs each block: a backend family's name (its selection serves it) or where its own code is
    blocks: tuple[tuple[str, str], ...] = (("attention, RoPE + KV page store", "attention"),
                                           ("projections, LM head", "linear"),
                                           ("RMSNorm, add + RMSNorm, SiLU-and-mul", "norm"))

    def __init__(self, config: ModelConfig, backends: Backends) -> None:
        super().__init__()
        self.config = config
        self.backends = backends

    @abstractmethod
    def kv_layer_specs(self) -> list[KVLayerSpec]:
        """One spec per layer that keeps KV pages, in layer order."""

    def window_reach(self) -> int:
        """Tokens before a step's first new token whose windowed KV layers it reads (0: none windowed)."""
        return 0

    def prepare(self, batch: ForwardBatch) -> Any:
        """Per-step attention metadata, made once before ``forward`` (and once for a captured graph,
        whose replays must find it still true): the attention backend's."""
        return self.backends.attention.prepare(batch)

    def breakable_refusals(self) -> list[str]:
        """Why a step of this model cannot be recorded as segments around its backends' break points
        (core/breaks.py): work shaped by the step that no backend family call does, if any."""
        if self.token_history:
            return [f"{type(self).__name__} stages {self.token_history} token ids before each step on the host"]
        return []

    def stage(self, input_ids: list[int], query_lens: list[int], history: list[list[int]]) -> None:
        """Host work for a step from its token ids, before its forward (or its graph's replay): each
        sequence's new ``input_ids`` (packed) and the ``token_history`` ids before them (-1 before
        its start). Called only where ``token_history`` > 0."""
        raise NotImplementedError(f"{type(self).__name__} reads no token history on the host")

    @abstractmethod
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Hidden states [T, hidden] of every packed token after the final norm."""

    def layer_feature_size(self) -> int:
        """The width of one layer's output in ``ForwardBatch.features["layers"]``."""
        return self.config.hf["hidden_size"]

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab]."""

    def checkpoint_part(self, name: str) -> tuple[int, int, int] | bool | None:
        """The part of checkpoint tensor ``name`` this rank holds, for the loader to read only that
        (core/loader.py); None: the whole tensor; False: none of it (the model ignores it)."""
        return None

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume (checkpoint name, tensor) pairs; raise on unknown names, shapes, missing ones."""
