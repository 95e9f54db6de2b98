"""The tiny V4.1's training (checkpoints/train_tiny_v41.py) at a smaller size: the loss reaches
every weight it can, training moves the model, and the written checkpoint is the trained model."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.checkpoints.train_tiny_v41 import Trainee, tiny_v41_hf, write_initial

SMALL = {"hidden_size": 32, "num_attention_heads": 2, "head_dim": 16, "qk_rope_head_dim": 8, "q_lora_rank": 16,
         "o_lora_rank": 8, "moe_intermediate_size": 16, "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4,
         "engram_head_dim": 8, "engram_vocab_size": 31, "sliding_window": 8, "candidate_topk_blocks": 2,
         "candidate_block_size": 4}
# what no gradient reaches: the indexers' top-k picks entries, the routers' correction biases move by a
# balancing rule, hash routes are integers
UNREACHED = ("indexer.", "gate.bias", "tid2eid")


@pytest.fixture(scope="module")
def trainee(tmp_path_factory, shared_dir):
    path = tmp_path_factory.mktemp("tiny-v41")
    hf = {**tiny_v41_hf(4096), **SMALL}
    write_initial(path, hf, Path(shared_dir) / "models" / "tiny-dsv4-py", seed=int(torch.randint(1 << 30, ())))
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    return Trainee(path, seq_len=24, batch=2, device="cpu"), stored


def test_the_loss_reaches_every_trainable_weight(trainee):
    t, _ = trainee
    ids = torch.randint(3, 4096, (2, 24)).tolist()
    for p in t.params:
        p.grad = None
    t.loss(ids).backward()
    names = {p.data_ptr(): n for n, p in t.model.named_parameters()}
    missed = [names.get(p.data_ptr(), "a fused projection") for p in t.params
              if p.grad is None or not p.grad.any()]
    assert [n for n in missed if not any(u in n for u in UNREACHED)] == []


def test_export_is_the_model_under_its_checkpoint_names(trainee):
    t, stored = trainee
    exported = t.export(list(stored))
    assert set(exported) == set(stored)
    for name, tensor in stored.items():  # nothing trained yet: the export is the checkpoint, in bf16 where floating
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert torch.equal(exported[name], want), name
    ids = torch.randint(3, 4096, (2, 24)).tolist()
    opt = torch.optim.SGD(t.params, lr=0.5)
    opt.zero_grad()
    t.loss(ids).backward()
    opt.step()
    moved = t.export(list(stored))
    for part in ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "ffn.experts.0.w1.weight", "embed_tokens"):
        name = next(n for n in stored if part in n)  # fused projections' parts included: their views moved
        assert not torch.equal(moved[name], exported[name]), name
