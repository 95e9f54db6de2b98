"""A trained drafter's directory (``engine train-drafter`` writes one, ``speculative_config.model``
names one): its tensors and a ``drafter.json`` saying which method it serves and for which target,
so a drafter trained for another model is refused at start-up.

The target is named by a fingerprint of its config.json and tokenizer.json: the same architecture
and shapes with the same vocabulary (weights are not read: a drafter is trained on a checkpoint's
hidden states, and a retrained checkpoint of one config keeps its fingerprint, which the held-out
acceptance report then shows).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

DRAFTER_CONFIG = "drafter.json"
WEIGHTS = "drafter.safetensors"


def target_fingerprint(model_dir: str | Path) -> str:
    path = Path(model_dir)
    h = hashlib.sha256(json.dumps(json.loads((path / "config.json").read_text()), sort_keys=True).encode())
    tokenizer = path / "tokenizer.json"
    if tokenizer.is_file():
        h.update(tokenizer.read_bytes())
    return h.hexdigest()


def drafter_reasons(drafter_dir: str | Path, method: str, target_dir: str | Path) -> list[str]:
    """Why ``drafter_dir`` cannot draft by ``method`` for the model in ``target_dir`` (empty: it can)."""
    path = Path(drafter_dir)
    config = path / DRAFTER_CONFIG
    if not config.is_file() or not (path / WEIGHTS).is_file():
        return [f"speculative_config.model: {path} is not a drafter directory ({DRAFTER_CONFIG} and {WEIGHTS}; "
                f"engine train-drafter writes one)"]
    meta = json.loads(config.read_text())
    if meta.get("method") != method:
        return [f"speculative_config.model: {path} is a {meta.get('method')!r} drafter, not {method!r}"]
    if meta.get("target") != target_fingerprint(target_dir):
        return [f"speculative_config.model: {path} is a drafter for another model ({meta.get('target_name')}), "
                f"not for {Path(target_dir).name} (its config or tokenizer differ)"]
    return []


def save_drafter(out_dir: str | Path, method: str, target_dir: str | Path, tensors: dict[str, torch.Tensor],
                 report: dict) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(out / WEIGHTS))
    meta = {"method": method, "target": target_fingerprint(target_dir), "target_name": Path(target_dir).name,
            **report}
    (out / DRAFTER_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def load_drafter(drafter_dir: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(drafter_dir) / WEIGHTS))
