"""What renders a model's chat prompts: ``--chat-template`` (a Jinja file, or a built-in encoding by
name), else the tokenizer's template, else the encoding of the checkpoint's architecture where its
makers ship it as Python instead of a template (DeepSeek-V4), else plain ``role: content`` lines."""

from __future__ import annotations

import json
from pathlib import Path

from .chat_template import ChatTemplate
from .deepseek_v4_chat import DeepSeekV4Chat

ChatRenderer = ChatTemplate | DeepSeekV4Chat

ENCODINGS = {"deepseek_v4": DeepSeekV4Chat}
BY_ARCHITECTURE = {"DeepseekV4ForCausalLM": "deepseek_v4"}


def architecture(model_dir: str | Path) -> str | None:
    """``config.json``'s first architecture, if it names one."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return None
    return next(iter(json.loads(config.read_text()).get("architectures") or []), None)


def check_chat_template(choice: str) -> str:
    """``--chat-template``: a built-in encoding's name or a readable file; ValueError otherwise."""
    if choice not in ENCODINGS and not Path(choice).expanduser().is_file():
        raise ValueError(f"{choice!r} is neither a file nor a built-in chat encoding ({', '.join(ENCODINGS)})")
    return choice


def chat_renderer(choice: str | None, model_dir: str | Path, template: str | None,
                  bos_token: str | None = None, eos_token: str | None = None) -> ChatRenderer:
    """The renderer for the model in ``model_dir`` whose tokenizer has ``template`` (None: none)."""
    if choice is not None and choice not in ENCODINGS:
        return ChatTemplate(Path(choice).expanduser().read_text(encoding="utf-8"), bos_token, eos_token)
    name = choice or (None if template else BY_ARCHITECTURE.get(architecture(model_dir)))
    return ENCODINGS[name]() if name else ChatTemplate(template, bos_token, eos_token)
