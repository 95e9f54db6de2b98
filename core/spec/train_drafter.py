"""What training any drafter for a checkpoint takes (``engine train-drafter``; train_mtp.py and
dspark/train.py say what each method trains): the frozen target built by the engine in fp32, the
text's tokens cut into random windows, a batch of windows run through the target on its own KV
pages, AdamW on a one-cycle schedule with clipping behind a progress bar, and the held-out mean
acceptance length of the written drafter through the engine."""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from ..config import EngineConfig
from ..forward import ForwardBatch
from .draft_model import DraftSeq

logger = logging.getLogger(__name__)

PAGE = 16


@dataclass
class TrainReport:
    steps: int
    tokens: int
    first_loss: float  # mean over the first tenth of the steps
    last_loss: float  # mean over the last tenth
    seconds: float
    acceptance_length: float | None = None  # held out, through the engine
    num_speculative_tokens: int | None = None


def corpus(tokenizer, files: list[str], max_tokens: int) -> list[int]:
    """The files' tokens, one after another with the tokenizer's EOS between, at most ``max_tokens``."""
    ids: list[int] = []
    for f in files:
        ids += tokenizer.encode(Path(f).read_text(errors="replace"), add_special_tokens=False)
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        if len(ids) >= max_tokens:
            break
    return ids[:max_tokens]


def step_batch(kv_manager, windows: list[list[int]], page_size: int, device: torch.device, shift: int = 0):
    """A prefill batch of ``windows`` (from their token ``shift`` on) on pages of ``kv_manager``, on
    ``device``, and the draft sequences holding them (to free)."""
    seqs = [DraftSeq(i, w, list(w)) for i, w in enumerate(windows)]
    n = len(windows[0]) - shift
    rows = []
    for s in seqs:
        st = kv_manager.allocate(s, n)
        if st is None:
            raise RuntimeError("the training KV cache is too small for a batch")
        rows.append(st.row)
    tables = kv_manager.page_table.gather(rows, -(-n // page_size))
    ids = [t for w in windows for t in w[shift:]]
    batch = ForwardBatch.build(ids, [n] * len(windows), [0] * len(windows), tables, page_size, list(range(len(ids))),
                               device)
    return batch, seqs


class FrozenTarget:
    """The checkpoint in ``model`` built by the engine in fp32 without gradients, with the tokens of
    the training text, drawing batches of ``batch`` random windows of ``seq_len`` tokens."""

    def __init__(self, model: str, files: list[str], seq_len: int, batch: int, max_tokens: int, seed: int,
                 progress: bool) -> None:
        from ..startup import build
        from ..tokenizer import Tokenizer

        torch.manual_seed(seed)
        self.rng = random.Random(seed)
        self.seq_len, self.batch = seq_len, batch
        self.config = EngineConfig(model=model, dtype="float32", page_size=PAGE,
                                   num_pages=batch * -(-seq_len // PAGE) + 8, enforce_eager=True,
                                   enable_prefix_caching=False, warmup=False, max_model_len=seq_len + PAGE)
        self.components = build(self.config, progress=progress)
        self.model = self.components.model
        self.model.requires_grad_(False)
        self.ids = corpus(Tokenizer.from_dir(model), files, max_tokens)
        if len(self.ids) < seq_len * batch:
            raise ValueError(f"the data has {len(self.ids)} tokens, fewer than a batch of {batch} windows of {seq_len}")
        logger.info("train-drafter: %d tokens from %d files", len(self.ids), len(files))

    def windows(self) -> list[list[int]]:
        n = self.seq_len
        return [self.ids[s:s + n] for s in (self.rng.randrange(len(self.ids) - n) for _ in range(self.batch))]

    @torch.inference_mode()
    def run(self, windows: list[list[int]], feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict]:
        """The target over ``windows``: its final hidden states of every token, and its features."""
        c = self.components
        b, seqs = step_batch(c.kv_manager, windows, PAGE, c.device)
        b.features, b.feature_layers = {}, feature_layers
        b.attn_metadata = self.model.prepare(b)
        hidden = self.model(b, c.kv)
        for s in seqs:
            c.kv_manager.free(s, cache=False)
        return hidden, b.features


WARM_UP = 0.1  # of the schedule's progress spent climbing to the peak learning rate
START, END = 1 / 25, 1 / 25 / 1e4  # the rate at the start and the end, as fractions of the peak


def one_cycle(progress: float) -> float:
    """The one-cycle schedule (cosine up to the peak, cosine down to nearly zero) as a fraction of
    the peak learning rate, at ``progress`` in [0, 1] of the whole run."""
    if progress < WARM_UP:
        return START + (1 - START) * (1 - math.cos(math.pi * progress / WARM_UP)) / 2
    down = min(1.0, (progress - WARM_UP) / (1 - WARM_UP))
    return END + (1 - END) * (1 + math.cos(math.pi * down)) / 2


def fit(params: list[torch.Tensor], loss_of: Callable[[], torch.Tensor], steps: int, lr: float, desc: str,
        progress: bool, seconds: float | None = None) -> tuple[list[float], float]:
    """At most ``steps`` AdamW steps on ``params`` (clipped at 1) of the loss ``loss_of`` draws each
    step, in at most ``seconds``: the one-cycle schedule follows whichever of the two runs out first,
    so a run stopped by the clock still ends annealed. The losses and the seconds taken."""
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr * START, weight_decay=0.0)
    losses: list[float] = []
    started = time.monotonic()
    bar = tqdm(range(steps), desc=desc, unit="step", disable=not progress)
    for i in bar:
        loss = loss_of()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        done = max((i + 1) / steps, 0.0 if seconds is None else (time.monotonic() - started) / max(seconds, 1e-9))
        if done >= 1.0 and i + 1 < steps:
            logger.warning("%s: stopped after %d of %d steps, its %.0f s spent", desc, len(losses), steps, seconds)
            break
        for group in opt.param_groups:
            group["lr"] = lr * one_cycle(done)
    return losses, time.monotonic() - started


def report(losses: list[float], seconds: float, target: FrozenTarget) -> TrainReport:
    steps, tenth = len(losses), max(1, len(losses) // 10)
    return TrainReport(steps, steps * target.batch * target.seq_len, sum(losses[:tenth]) / tenth,
                       sum(losses[-tenth:]) / tenth, seconds)


def held_out_acceptance(model: str, method: str, drafter: str, eval_file: str, k: int, seed: int,
                        num_prompts: int = 16, prompt_len: int = 64, max_tokens: int = 32,
                        **engine) -> float:
    """Mean acceptance length of the drafter at ``k`` (all ``k`` drafts verified) over greedy
    continuations of prompts cut from ``eval_file``, through the engine."""
    from ..llm import LLM
    from ..sampling_params import SamplingParams

    llm = LLM(model, dtype="float32", speculative_config={"method": method, "num_speculative_tokens": k,
                                                          "model": str(drafter)}, progress=False, **engine)
    llm.engine.speculator.verify_length = None  # every draft verified: the drafter's acceptance, not the load's
    text = Path(eval_file).read_text(errors="replace")
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    prompts = [ids[s:s + prompt_len] for s in (rng.randrange(len(ids) - prompt_len) for _ in range(num_prompts))]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return llm.engine.speculator.counters.mean_acceptance_length
