"""The offline Python API, shaped like vLLM's: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence as Seq

from tqdm import tqdm

from .config import EngineConfig
from .engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

Prompt = str | list[int]

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def normalize_prompts(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    """A string, a token-id list, or a list of either."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts


class LLM:
    def __init__(self, model: str, progress: bool = True, **kwargs) -> None:
        unknown = set(kwargs) - _ENGINE_FIELDS
        if unknown:
            raise TypeError(f"unknown LLM arguments: {', '.join(sorted(unknown))}; "
                            f"known: {', '.join(sorted(_ENGINE_FIELDS - {'model'}))}")
        self.engine = LLMEngine(EngineConfig(model=str(model), **kwargs), progress=progress)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; one output per prompt, in order."""
        prompts = normalize_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        order: dict[str, int] = {}
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, p, sp, stream=False)
                order[rid] = i
        except Exception:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = tqdm(total=len(prompts), desc="generating", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
                    bar.update(1)
        bar.close()
        return [r for r in results if r is not None]
