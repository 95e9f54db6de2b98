"""Training DeepSeek-V4's next-n layer for a checkpoint from text (``engine train-drafter --method
mtp``): the target frozen, its residual streams as the layer's input, the layer trained to predict
the token after next, written as a drafter directory (drafter.py) the MTP proposer loads.

Text files are tokenized and cut into windows of ``seq_len`` tokens; each step runs the target over
a batch of windows (no gradients) for its streams, then the layer over the same positions, on a
KV cache of its own made for the step, and takes the cross-entropy of its logits (through the
target's LM head) against the token after next. Where the checkpoint has no next-n layer the
layer starts from the target's last sliding-attention MoE block, random projections and the
target's mHC head. The held-out report runs the engine with the trained layer drafting over
prompts of an evaluation text and reads its mean acceptance length.
"""

from __future__ import annotations

import logging
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import EngineConfig
from ..forward import ForwardBatch
from ..loader import iter_checkpoint
from .draft_model import DraftSeq

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.*)$")
_HEAD = re.compile(r"^(?:model\.hc_head\.hc_|hc_head_)(fn|base|scale)$")


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


def initial_nextn(target, seed: int) -> dict[str, torch.Tensor]:
    """Next-n tensors to start from: the checkpoint's own, else its last sliding-attention MoE
    block, random e_proj/h_proj (std 0.02), unit norms and the target's mHC head."""
    if target.mtp:
        return dict(target.mtp)
    hf = target.config.hf
    from ..models.deepseek_v4.model import _normalised
    from ..models.deepseek_v4.attention import SLIDING

    norm = _normalised(hf)
    candidates = [i for i, (t, m) in enumerate(zip(norm["layer_types"], norm["mlp_layer_types"]))
                  if t == SLIDING and m == "moe"]
    if not candidates:
        raise ValueError("the checkpoint has no sliding-attention MoE layer to start a next-n layer from")
    source = candidates[-1]
    out: dict[str, torch.Tensor] = {}
    for name, tensor in iter_checkpoint(target.config.path, progress=False):
        if (m := _LAYER.match(name)) and int(m[1]) == source:
            out[f"mtp.0.{m[2]}"] = tensor.float().clone()
        elif m := _HEAD.match(name):
            out[f"mtp.0.hc_head_{m[1]}"] = tensor.float().clone()
    g = torch.Generator().manual_seed(seed)
    d = hf["hidden_size"]
    out.update({f"mtp.0.{n}.weight": torch.randn(d, d, generator=g) * 0.02 for n in ("e_proj", "h_proj")})
    out.update({f"mtp.0.{n}.weight": torch.ones(d) for n in ("enorm", "hnorm", "norm")})
    return out


def _step_batch(kv_manager, windows: list[list[int]], page_size: int, shift: int = 0):
    """A prefill batch of ``windows`` (from their token ``shift`` on) on pages of ``kv_manager``,
    and the draft sequences holding them (to free)."""
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
    return ForwardBatch.build(ids, [n] * len(windows), [0] * len(windows), tables, page_size, list(range(len(ids)))), seqs


def train_mtp(model: str, files: list[str], out: str, steps: int = 300, seq_len: int = 128, batch: int = 4,
              lr: float = 2e-3, max_tokens: int = 2_000_000, seed: int = 0, eval_file: str | None = None,
              num_speculative_tokens: int = 3, progress: bool = True) -> TrainReport:
    from ..models.deepseek_v4.nextn import NextN, build_nextn
    from ..startup import build, proposer_kv
    from ..tokenizer import Tokenizer
    from .drafter import save_drafter

    torch.manual_seed(seed)
    rng = random.Random(seed)
    page = 16
    config = EngineConfig(model=model, dtype="float32", page_size=page, num_pages=batch * -(-seq_len // page) + 8,
                          enforce_eager=True, enable_prefix_caching=False, warmup=False, max_model_len=seq_len + page)
    c = build(config, progress=progress)
    target = c.model
    target.requires_grad_(False)
    tokenizer = Tokenizer.from_dir(model)
    ids = corpus(tokenizer, files, max_tokens)
    if len(ids) < seq_len * batch:
        raise ValueError(f"the data has {len(ids)} tokens, fewer than a batch of {batch} windows of {seq_len}")
    logger.info("train-drafter: %d tokens from %d files", len(ids), len(files))
    start = initial_nextn(target, seed)
    layer: NextN = build_nextn(target, start)
    layer.train()
    # the attention's input projections run as one fused weight whose parts' parameters are views
    # of it: that weight is what trains
    fused = [w.data for w, names, _ in layer.attn.x_proj.groups if len(names) > 1]
    params = [p for p in layer.parameters() if all(p.data_ptr() != f.data_ptr() and not _inside(p, f) for f in fused)]
    params += fused
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    losses: list[float] = []
    started = time.monotonic()
    bar = tqdm(range(steps), desc="training the next-n layer", unit="step", disable=not progress)
    for _ in bar:
        windows = [ids[s:s + seq_len] for s in (rng.randrange(len(ids) - seq_len) for _ in range(batch))]
        with torch.inference_mode():
            b, seqs = _step_batch(c.kv_manager, windows, page)
            b.features = {}
            b.attn_metadata = target.prepare(b)
            target(b, c.kv)
        streams = b.features["streams"].clone()  # out of inference mode: autograd may keep it
        for s in seqs:
            c.kv_manager.free(s, cache=False)
        # the layer at positions 0..L-2 reads x[p + 1] and the streams at p, and predicts x[p + 2]
        cache, kv_manager = proposer_kv(config, layer, c.device, torch.float32, seq_len + page, 0)
        b, _ = _step_batch(kv_manager, windows, page, shift=1)
        rows = streams.view(batch, seq_len, *streams.shape[1:])[:, :-1].reshape(-1, *streams.shape[1:])
        _, hidden = layer(b, cache, rows)
        logits = target.compute_logits(hidden).view(batch, seq_len - 1, -1)[:, :-1]
        want = torch.tensor([w[2:] for w in windows])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), want.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    tenth = max(1, steps // 10)
    report = TrainReport(steps, steps * batch * seq_len, sum(losses[:tenth]) / tenth, sum(losses[-tenth:]) / tenth,
                         time.monotonic() - started)
    tensors = layer.export(list(start))
    save_drafter(out, "mtp", model, tensors, asdict(report))
    if eval_file is not None:
        report.acceptance_length = held_out_acceptance(model, out, eval_file, num_speculative_tokens, seed)
        report.num_speculative_tokens = num_speculative_tokens
        save_drafter(out, "mtp", model, tensors, asdict(report))
    return report


def _inside(p: torch.Tensor, whole: torch.Tensor) -> bool:
    """Whether ``p``'s memory lies within ``whole``'s."""
    a, n = whole.data_ptr(), whole.numel() * whole.element_size()
    return a <= p.data_ptr() < a + n


def held_out_acceptance(model: str, drafter: str, eval_file: str, k: int, seed: int, num_prompts: int = 16,
                        prompt_len: int = 64, max_tokens: int = 32) -> float:
    """Mean acceptance length of the drafter at ``k`` over greedy continuations of prompts cut from
    ``eval_file``, through the engine."""
    from ..llm import LLM
    from ..sampling_params import SamplingParams

    llm = LLM(model, dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": k,
                                                          "model": str(drafter)}, progress=False)
    text = Path(eval_file).read_text(errors="replace")
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    prompts = [ids[s:s + prompt_len] for s in (rng.randrange(len(ids) - prompt_len) for _ in range(num_prompts))]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return llm.engine.speculator.counters.mean_acceptance_length
