"""A model directory's tokenizer, read with the ``tokenizers`` library alone.

The API process and the engine both tokenize, and neither should need transformers for it. So
this reads what ``AutoTokenizer`` reads for a fast tokenizer: tokenizer.json for the pipeline,
tokenizer_config.json for the special tokens and the chat template (chat_template.jinja wins
over it, as in transformers), and
generation_config.json for the ids that end generation. Which special tokens ``encode`` adds is
tokenizer.json's post-processor alone: transformers 5 drops ``add_bos_token``/``add_eos_token``
from the config whenever tokenizer.json is there, and encodings must equal its.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _Backend

_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_EXTRA_SPECIAL = ("additional_special_tokens", "extra_special_tokens")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _content(token) -> str | None:
    """tokenizer_config.json writes a token as a string or as an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def _int_set(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}


class Tokenizer:
    def __init__(self, backend: _Backend, config: dict, generation_config: dict,
                 chat_template: str | None = None, chat_templates: dict[str, str] | None = None) -> None:
        self._backend = backend
        self.config = config
        self.bos_token_id = self._special_id("bos_token")
        self.eos_token_id = self._special_id("eos_token")  # the tokenizer's own; generation may end on more
        self.pad_token_id = self._special_id("pad_token")
        self.eos_token_ids: set[int] = _int_set(generation_config.get("eos_token_id")) | _int_set(self.eos_token_id)
        self.chat_template = chat_template
        self.chat_templates = chat_templates or {}
        named = {self._special_id(k) for k in _NAMED_SPECIAL}
        extra = {self._token_id(_content(t), k) for k in _EXTRA_SPECIAL for t in config.get(k) or []}
        flagged = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}  # what decode skips
        self.all_special_ids: list[int] = sorted((named | extra | flagged) - {None})

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path).expanduser()
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} is missing: the tokenizer is read from tokenizer.json "
                                    "(the HF fast-tokenizer format)")
        config = _read_json(path / "tokenizer_config.json")
        template = config.get("chat_template")
        named: dict[str, str] = {}
        if isinstance(template, list):  # [{"name": ..., "template": ...}], "default" being the default
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        jinja = path / "chat_template.jinja"
        if jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        return cls(_Backend.from_file(str(tok_file)), config, _read_json(path / "generation_config.json"),
                   template, named)

    def _token_id(self, token: str | None, field: str) -> int | None:
        if token is None:
            return None
        tid = self._backend.token_to_id(token)
        if tid is None:
            raise ValueError(f"tokenizer_config.json: {field} {token!r} is not in tokenizer.json's vocabulary")
        return tid

    def _special_id(self, field: str) -> int | None:
        return self._token_id(_content(self.config.get(field)), field)

    @property
    def backend(self) -> _Backend:
        """The ``tokenizers`` pipeline itself (the grammar compiler reads its vocabulary)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer knows, added tokens included (HF's ``len(tokenizer)``)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        return [self._backend.id_to_token(i) for i in ids]
