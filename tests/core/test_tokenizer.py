import json
import random
import shutil

import pytest
import tokenizers
import tokenizers.processors

from engine.core.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

AWKWARD = [
    "", " ", "\t\t\n\n  ", "  leading and trailing  ", "héllo wörld — naïve café", "日本語のテキスト 🎉🐍 \u00a0x",
    "x<|eos|>y<|bos|>", "\r\n\r\n\tdef f():\n\t\treturn '\\u00e9'\n", "a" * 300, "😀" * 7,
]


@pytest.fixture(scope="module")
def ours(tiny_qwen3):
    return Tokenizer.from_dir(tiny_qwen3)


@pytest.fixture(scope="module")
def hf(tiny_qwen3):
    return transformers.AutoTokenizer.from_pretrained(str(tiny_qwen3))


def _texts(eval_text: str) -> list[str]:
    lines = eval_text.splitlines(keepends=True)
    picked = random.sample(lines, 300)
    starts = [random.randrange(len(eval_text) - 800) for _ in range(20)]
    return picked + [eval_text[s:s + random.randrange(1, 800)] for s in starts] + AWKWARD


def test_encode_matches_hf(ours, hf, eval_text, seed):
    for text in _texts(eval_text):
        assert ours.encode(text) == hf.encode(text), repr(text)
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), repr(text)


def test_decode_matches_hf(ours, hf, eval_text, seed):
    for text in _texts(eval_text)[:100]:
        ids = ours.encode(text)
        assert ours.decode(ids) == hf.decode(ids) == text.replace("<|eos|>", "").replace("<|bos|>", "")
    for _ in range(50):
        ids = [random.randrange(ours.vocab_size) for _ in range(random.randrange(1, 40))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


def test_special_tokens_match_hf(ours, hf):
    assert ours.vocab_size == len(hf)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (hf.bos_token_id, hf.eos_token_id,
                                                                        hf.pad_token_id)
    assert ours.all_special_ids == sorted(hf.all_special_ids)
    assert ours.eos_token_ids == {1}
    assert ours.chat_template is None
    assert ours.convert_ids_to_tokens(1) == "<|eos|>"


def _copy_with_configs(tiny_qwen3, tmp_path, tok_config: dict, gen_config: dict | None, bos_template=False):
    if bos_template:  # a tokenizer.json whose post-processor prepends BOS, as Llama 3's does
        backend = tokenizers.Tokenizer.from_file(str(tiny_qwen3 / "tokenizer.json"))
        backend.post_processor = tokenizers.processors.TemplateProcessing(
            single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", 0)])
        backend.save(str(tmp_path / "tokenizer.json"))
    else:
        shutil.copy(tiny_qwen3 / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    if gen_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(gen_config))
    return tmp_path


@pytest.mark.parametrize("bos_template", [False, True])
def test_config_variants_match_hf(tiny_qwen3, tmp_path, eval_text, seed, bos_template):
    added = {"__type": "AddedToken", "content": "<|bos|>", "lstrip": False, "rstrip": False,
             "normalized": False, "single_word": False, "special": True}
    path = _copy_with_configs(tiny_qwen3, tmp_path, {
        "tokenizer_class": "TokenizersBackend", "bos_token": added, "eos_token": dict(added, content="<|eos|>"),
        "pad_token": None, "add_bos_token": True, "add_eos_token": True,
        "chat_template": [{"name": "default", "template": "{{ messages }}"}, {"name": "tool_use", "template": "T"}],
    }, {"eos_token_id": [1, 2], "bos_token_id": 0}, bos_template)
    ours = Tokenizer.from_dir(path)
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    for text in _texts(eval_text)[:50]:
        ids = ours.encode(text)
        assert ids == hf.encode(text)  # tokenizer.json's post-processor decides, not add_bos_token
        assert (ids[:1] == [0]) == bos_template and ids[-1:] != [1]
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert ours.eos_token_ids == {1, 2}
    assert ours.pad_token_id is None
    assert ours.chat_template == "{{ messages }}"
    assert ours.chat_templates == {"default": "{{ messages }}", "tool_use": "T"}


def test_chat_template_file_and_no_generation_config(tiny_qwen3, tmp_path):
    path = _copy_with_configs(tiny_qwen3, tmp_path, {"eos_token": {"content": "<|pad|>"}}, None)
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template="loses to the file")))
    tok = Tokenizer.from_dir(path)
    assert tok.chat_template.startswith("{% for m")
    assert tok.eos_token_ids == {2}
    assert tok.bos_token_id is None


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_unknown_special_token(tiny_qwen3, tmp_path):
    path = _copy_with_configs(tiny_qwen3, tmp_path, {"eos_token": "<|nope|>"}, None)
    with pytest.raises(ValueError, match="eos_token"):
        Tokenizer.from_dir(path)
