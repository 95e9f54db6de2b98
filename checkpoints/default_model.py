"""The embedded default model: a small random Qwen3 written once to the cache on first use.

It lets ``engine generate`` and ``engine serve`` run with no download. The directory name carries
a hash of everything that shapes its bytes, so a newer generator never reuses a stale copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from .presets import PRESETS
from .tokenizer import MERGE_TEXT
from .writer import GENERATOR_VERSION, write_checkpoint

logger = logging.getLogger(__name__)


def default_model_dir() -> Path:
    """``$ENGINE_CACHE_DIR`` (or ~/.cache/engine) / default-qwen3-<hash of preset and generator>."""
    root = Path(os.environ.get("ENGINE_CACHE_DIR") or "~/.cache/engine").expanduser()
    recipe = json.dumps({"version": GENERATOR_VERSION, "config": PRESETS["default"], "merge_text": MERGE_TEXT},
                        sort_keys=True)
    return root / f"default-qwen3-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"


def ensure_default_model(progress: bool = True) -> Path:
    """The default model's directory, written there first if absent (concurrent callers are safe)."""
    path = default_model_dir()
    if not (path / "config.json").is_file():
        logger.info("writing the embedded default model to %s", path)
        try:
            write_checkpoint(path, "default", progress=progress)
        except FileExistsError:  # another process published it first, or something else is in the way
            if not (path / "config.json").is_file():
                raise
    logger.warning("using the embedded default model at %s: its weights are RANDOM and the text it produces "
                   "is meaningless; pass --model DIR to serve a real model", path)
    return path
