"""Writing a random-weight checkpoint: deterministic bytes, bounded memory, all or nothing.

Each tensor draws from its own generator, seeded from (seed, tensor name), so a tensor's values do
not depend on which other tensors the model has or on the order they are written. Tensors are
generated in blocks of rows and streamed straight into safetensors files whose headers are known
up front, so even a 30B model needs one block in memory. Everything goes to a temporary directory
that is renamed into place only when complete.
"""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import shutil
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import torch
from tqdm import tqdm

from ..core.config import parse_dtype
from .layout import Shapes, tensor_shapes
from .presets import PRESETS
from .tokenizer import IM_END_ID, SPECIAL_IDS, TOKENIZER_SIZE, tokenizer_files

GENERATOR_VERSION = 1  # bump whenever the bytes written for the same arguments change
INIT_STD = 0.02
_BLOCK_ELEMENTS = 2**24  # rows are drawn in blocks of about this many values; part of the byte layout
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def resolve_preset(preset: str | dict[str, Any]) -> dict[str, Any]:
    """A preset name or an HF config dict -> a fresh config dict using the embedded tokenizer's ids."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
        preset = PRESETS[preset]
    config = {**copy.deepcopy(preset), **SPECIAL_IDS}
    if config["vocab_size"] < TOKENIZER_SIZE:
        raise ValueError(f"vocab_size {config['vocab_size']} is below the tokenizer's {TOKENIZER_SIZE} tokens")
    return config


def _tensor_seed(seed: int, name: str) -> int:
    """32 bits, all that torch's CPU generator (mt19937) keeps of a seed."""
    return zlib.crc32(f"{seed}:{name}".encode())


def _write_tensor(f: BinaryIO, name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> None:
    if name.endswith("norm.weight"):  # RMSNorm gains of 1 keep activations at unit scale
        f.write(torch.ones(shape, dtype=dtype).view(torch.uint8).numpy())
        return
    gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
    row = math.prod(shape[1:])
    step = max(1, _BLOCK_ELEMENTS // row)
    for start in range(0, shape[0], step):
        block = torch.empty((min(step, shape[0] - start), *shape[1:])).normal_(0.0, INIT_STD, generator=gen)
        f.write(block.to(dtype).view(torch.uint8).numpy())


def _header(tensors: Shapes, dtype: torch.dtype) -> bytes:
    """A safetensors header: little-endian length, then JSON padded with spaces to 8 bytes."""
    itemsize = dtype.itemsize
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        end = offset + math.prod(shape) * itemsize
        meta[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _plan_shards(tensors: Shapes, itemsize: int, shard_bytes: int) -> list[Shapes]:
    """Consecutive tensors packed greedily; a tensor larger than ``shard_bytes`` gets a shard alone."""
    shards: list[Shapes] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _write_weights(out: Path, tensors: Shapes, dtype: torch.dtype, seed: int, shard_bytes: int,
                   progress: bool) -> None:
    shards = _plan_shards(tensors, dtype.itemsize, shard_bytes)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    with tqdm(total=len(tensors), desc="writing random weights", unit="tensor", disable=not progress) as bar:
        for file_name, shard in zip(names, shards):
            with open(out / file_name, "wb") as f:
                f.write(_header(shard, dtype))
                for name, shape in shard:
                    _write_tensor(f, name, shape, dtype, seed)
                    bar.update(1)
    if n > 1:
        total = sum(math.prod(shape) for _, shape in tensors) * dtype.itemsize
        _write_json(out / "model.safetensors.index.json", {
            "metadata": {"total_size": total},
            "weight_map": {name: file_name for file_name, shard in zip(names, shards) for name, _ in shard},
        })


def _occupied(path: Path) -> bool:
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


def _publish(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the complete ``tmp`` to ``out``; a non-empty ``out`` wins unless ``overwrite``."""
    if overwrite and out.exists():
        old = tmp.with_name(tmp.name + ".replaced")
        os.rename(out, old)
        os.rename(tmp, out)
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
        return
    try:
        os.rename(tmp, out)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
            raise FileExistsError(f"{out} already exists (pass overwrite=True to replace it)") from e
        raise


def write_checkpoint(out_dir: str | Path, preset: str | dict[str, Any], dtype: str | torch.dtype = torch.bfloat16,
                     seed: int = 0, shard_bytes: int = 2 * 2**30, overwrite: bool = False,
                     progress: bool = True) -> Path:
    """Write an HF-layout checkpoint with random weights to ``out_dir``; same arguments, same bytes."""
    out = Path(out_dir).expanduser()
    dtype = parse_dtype(dtype)
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(str, _SAFETENSORS_DTYPES))}; got {dtype}")
    config = resolve_preset(preset)
    config["dtype"] = str(dtype).removeprefix("torch.")
    tensors = tensor_shapes(config)
    if _occupied(out) and not overwrite:
        raise FileExistsError(f"{out} already exists (pass overwrite=True to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        tmp.chmod(0o755)
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json",
                    {**SPECIAL_IDS, "eos_token_id": [SPECIAL_IDS["eos_token_id"], IM_END_ID]})
        for file_name, text in tokenizer_files(config["max_position_embeddings"]).items():
            (tmp / file_name).write_text(text)
        _write_weights(tmp, tensors, dtype, seed, shard_bytes, progress)
        _publish(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
