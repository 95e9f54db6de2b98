"""Reading a checkpoint directory: sharded safetensors, memory-mapped, one tensor at a time."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

logger = logging.getLogger(__name__)


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a model directory, from its index when it has one."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def iter_checkpoint(path: str | Path, progress: bool = True,
                    part: Callable[[str], tuple[int, int, int] | bool | None] | None = None,
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor, read from the memory-mapped files. ``part(name)``:
    (dim, index, count) to read only chunk ``index`` of ``count`` along ``dim`` (a tensor-parallel
    rank's slice), None for the whole tensor, False to skip it (nothing reads it)."""
    files = checkpoint_files(path)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    total = sum(len(list(h.keys())) for h in handles)
    bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress)
    try:
        for f, h in zip(files, handles):
            for name in h.keys():
                want = part(name) if part is not None else None
                if want is not False:
                    yield name, _read(h, name, want)
                bar.update(1)
    finally:
        bar.close()
    logger.info("read %d tensors from %d file(s) in %s", total, len(files), path)


def _read(handle, name: str, part: tuple[int, int, int] | None) -> torch.Tensor:
    if part is None or part[2] == 1:
        return handle.get_tensor(name)
    dim, index, count = part
    view = handle.get_slice(name)
    shape = view.get_shape()
    if dim >= len(shape) or shape[dim] % count:
        return handle.get_tensor(name)  # not this part's shape: the loader names the mismatch
    size = shape[dim] // count
    return view[(slice(None),) * dim + (slice(index * size, (index + 1) * size),)]
