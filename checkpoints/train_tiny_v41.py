"""Training the tiny DeepSeek-V4.1 kept as a test asset (tests/assets/tiny-dsv41-py).

HF transformers has no V4.1, so the engine's own model trains it: the native backends in fp32 on
KV pages made for each step (core/spec/train_drafter.py's windows and AdamW loop), initialised as
HF initialises V4 (normal 0.02, norms and mHC scales one, biases, sinks and mHC bases zero), from
Python sources tokenized by the byte-level tokenizer the tiny checkpoints share. Every V4.1
mechanism is present at small size: sliding-window layers, CSA2 ratio-2 and ratio-1 layers, KV
entries and index keys shared across layers, the candidate filter, Engram tables at two layers,
mHC, a hash-routed and routed MoE. What the loss cannot reach stays as initialised: the lightning
indexers (their top-k passes no gradient; DeepSeek trains them by distilling the attention) and
the routers' correction biases (a load-balancing rule moves those, not the loss).

    python -m engine.checkpoints.train_tiny_v41 --tokenizer DIR --data DIR --eval FILE --out DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

PAGE = 16
MAX_TOKENS = 20_000_000  # of training text read


def tiny_v41_hf(vocab_size: int) -> dict:
    """config.json of the tiny V4.1 in the published key layout: ten layers as V4.1-Flash's forty
    shrunk (two sliding-window, four ratio-2, four ratio-1; layer 6's entries serve the ratio-1
    layers, which pick their index candidates there), about 10M parameters."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "dtype": "bfloat16",
        "vocab_size": vocab_size, "hidden_size": 256, "num_hidden_layers": 10, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 128, "o_groups": 2,
        "o_lora_rank": 64, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 64, "num_hash_layers": 1, "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5, "norm_topk_prob": True, "swiglu_limit": 10.0, "hc_mult": 4,
        "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "sliding_window": 64, "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0, "max_position_embeddings": 4096, "index_n_heads": 16, "index_head_dim": 32,
        "index_topk": 16, "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1], "kv_source_layer_ids": [2, 4, 6],
        "index_source_layer_ids": [2, 4, 6, 8], "candidate_source_layer_id": 6, "candidate_topk_blocks": 8,
        "candidate_block_size": 8, "engram_layer_ids": [1, 5], "engram_max_ngram_size": 3, "engram_n_heads": 4,
        "engram_head_dim": 32, "engram_vocab_size": 4001, "engram_pad_token_id": 2, "num_nextn_predict_layers": 0,
        "bos_token_id": 0, "eos_token_id": 1, "initializer_range": 0.02,
    }


def initial_weights(model: torch.nn.Module, hf: dict, seed: int) -> dict[str, torch.Tensor]:
    """The model's parameters as HF initialises DeepSeek-V4's, hash routes drawn at random."""
    g = torch.Generator().manual_seed(seed)
    std, out = hf["initializer_range"], {}
    for name, t in model.state_dict().items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "tid2eid":
            w = torch.stack([torch.randperm(hf["n_routed_experts"], generator=g)[:hf["num_experts_per_tok"]]
                             for _ in range(t.shape[0])])
        elif "norm" in name or leaf.endswith(("scale", "q_weight", "k_weight")):
            w = torch.ones(t.shape)
        elif leaf.endswith(("base", "bias", "attn_sink", "ape")):
            w = torch.zeros(t.shape)
        else:
            w = torch.randn(t.shape, generator=g) * std
        out[name] = w.to(t.dtype).contiguous()
    return out


def write_initial(path: Path, hf: dict, tokenizer: Path, seed: int) -> None:
    """A checkpoint of the untrained model in ``path`` (its tokenizer beside it: Engram reads it)."""
    from ..core.models.deepseek_v4.publish import shaped_model, unstacked_experts

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**hf, "dtype": "float32"}, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, path / name)
    model = shaped_model(path)
    save_file(dict(unstacked_experts(initial_weights(model, hf, seed), hf["n_routed_experts"])),
              str(path / "model.safetensors"))


@dataclass
class Training:
    steps: int
    tokens: int
    seconds: float
    first_loss: float  # mean over the first tenth of the steps, nats a token
    last_loss: float  # mean over the last tenth
    held_out_loss: float  # on the evaluation file
    parameters: int
    device: str


class Trainee:
    """The checkpoint in ``path`` built by the engine in fp32 on the native backends, with its
    trainable tensors: every floating parameter, the fused input and query projections as the
    weights they run as (their parts are views of them)."""

    def __init__(self, path: Path, seq_len: int, batch: int, device: str) -> None:
        from ..core.config import EngineConfig
        from ..core.startup import build

        native = {f"{f}_backend": "native" for f in ("v4_attention", "mhc", "moe", "linear", "norm")}
        self.config = EngineConfig(model=str(path), dtype="float32", device=device, page_size=PAGE,
                                   num_pages=batch * -(-seq_len // PAGE) + 8, enforce_eager=True,
                                   enable_prefix_caching=False, warmup=False, max_model_len=seq_len + PAGE, **native)
        self.components = build(self.config, progress=False)
        self.model = self.components.model
        self.seq_len, self.batch = seq_len, batch
        fused = [w.data for layer in self.model.model.layers for proj in (layer.attn.x_proj, layer.attn.q_proj)
                 for w, names, _ in proj.groups if len(names) > 1]
        inside = {p.data_ptr() for p in self.model.parameters() for f in fused if _inside(p, f)}
        self.params = [p for p in self.model.parameters() if p.is_floating_point() and p.data_ptr() not in inside]
        self.params += fused
        for p in self.params:
            p.requires_grad_(True)

    def loss(self, windows: list[list[int]]) -> torch.Tensor:
        """Mean next-token cross-entropy over ``windows``, on KV pages made for them."""
        from ..core.spec.train_drafter import step_batch
        from ..core.startup import proposer_kv

        c, n = self.components, len(windows[0])
        cache, kv_manager = proposer_kv(self.config, self.model, c.device, torch.float32, n + PAGE, 0)
        b, _ = step_batch(kv_manager, windows, PAGE, c.device)
        b.attn_metadata = self.model.prepare(b)
        logits = self.model.compute_logits(self.model(b, cache)).view(len(windows), n, -1)[:, :-1]
        want = torch.tensor([w[1:] for w in windows], device=logits.device)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), want.reshape(-1))

    def export(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The trained weights under the checkpoint names ``names``, in bf16."""
        from ..core.models.weights import read_back

        out = {}
        for name in names:
            p = read_back(self.model, self.model.resolve(name))
            out[name] = p.to("cpu", torch.bfloat16 if p.is_floating_point() else p.dtype).contiguous()
        return out


def _inside(p: torch.Tensor, whole: torch.Tensor) -> bool:
    a, n = whole.data_ptr(), whole.numel() * whole.element_size()
    return a <= p.data_ptr() < a + n


def held_out(trainee: Trainee, ids: list[int], windows: int) -> float:
    """Mean loss over up to ``windows`` consecutive windows of ``ids``."""
    n, losses = trainee.seq_len, []
    with torch.no_grad():
        for s in range(0, min(len(ids) - n, windows * n), n * trainee.batch):
            batch = [ids[i:i + n] for i in range(s, s + n * trainee.batch, n) if i + n <= len(ids)]
            losses.append(trainee.loss(batch).item())
    return sum(losses) / len(losses)


def train(tokenizer: Path, data: list[str], eval_file: str, out: Path, minutes: float, seq_len: int, batch: int,
          lr: float, device: str, seed: int, progress: bool = True) -> Training:
    from safetensors import safe_open

    from ..core.spec.train_drafter import corpus, fit
    from ..core.tokenizer import Tokenizer

    torch.manual_seed(seed)
    tok = Tokenizer.from_dir(str(tokenizer))
    hf = tiny_v41_hf(tok.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        write_initial(Path(tmp), hf, tokenizer, seed)
        with safe_open(str(Path(tmp) / "model.safetensors"), "pt") as f:
            names = list(f.keys())
        trainee = Trainee(Path(tmp), seq_len, batch, device)
    ids = corpus(tok, data, MAX_TOKENS)
    if len(ids) < seq_len * batch:
        raise ValueError(f"the data has {len(ids)} tokens, fewer than a batch of {batch} windows of {seq_len}")
    logger.info("tiny V4.1: %d parameters, %d training tokens from %d files", sum(p.numel() for p in trainee.params),
                len(ids), len(data))
    g = torch.Generator().manual_seed(seed)

    def draw() -> torch.Tensor:
        starts = torch.randint(0, len(ids) - seq_len, (batch,), generator=g).tolist()
        return trainee.loss([ids[s:s + seq_len] for s in starts])

    for _ in range(2):  # a step to warm up, one timed to fit the steps in the minutes
        started = time.monotonic()
        trainee.loss([ids[:seq_len]] * batch).backward()
        for p in trainee.params:
            p.grad = None
    steps = max(20, int(minutes * 60 / max(time.monotonic() - started, 1e-3)))
    losses, seconds = fit(trainee.params, draw, steps, lr, "training the tiny V4.1", progress, 1.25 * minutes * 60)
    eval_ids = tok.encode(Path(eval_file).read_text(errors="replace"), add_special_tokens=False)
    steps = len(losses)
    tenth = max(1, steps // 10)
    result = Training(steps, steps * batch * seq_len, seconds, sum(losses[:tenth]) / tenth,
                      sum(losses[-tenth:]) / tenth, held_out(trainee, eval_ids, 64),
                      sum(p.numel() for p in trainee.params), torch.cuda.get_device_name() if device == "cuda" else device)
    out.mkdir(parents=True, exist_ok=True)
    save_file(trainee.export(names), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, out / name)
    (out / "training.json").write_text(json.dumps(asdict(result), indent=1))
    if not math.isfinite(result.last_loss):
        raise RuntimeError(f"training diverged: last loss {result.last_loss}")
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", type=Path, required=True, help="a directory with tokenizer.json (tiny-dsv4-py's)")
    p.add_argument("--data", type=Path, required=True, help="a directory of Python sources to train on")
    p.add_argument("--eval", required=True, help="held-out text for the reported loss")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--minutes", type=float, default=8.0, help="training time to fill (default 8)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    files = sorted(str(f) for f in a.data.rglob("*.py"))
    result = train(a.tokenizer, files, a.eval, a.out, a.minutes, a.seq_len, a.batch, a.lr, a.device, a.seed)
    print(json.dumps(asdict(result), indent=1))


if __name__ == "__main__":
    main()
