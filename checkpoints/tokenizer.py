"""The generator's tokenizer: byte-level BPE built in code, so no checkpoint needs a download.

The 256 byte tokens cover every string; the merges are learned from a short embedded text by a
plain BPE with a fixed tie-break (highest count, then the smallest pair), so the tokenizer is the
same on every machine and fills exactly :data:`TOKENIZER_SIZE` ids.
"""

from __future__ import annotations

import json
from collections import Counter

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
SPECIAL_IDS = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
IM_END_ID = 4
TOKENIZER_SIZE = 512

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

MERGE_TEXT = """\
The quick brown fox jumps over the lazy dog. A model reads the text one token at a time and
writes the next one; the more often a pair of characters appears together, the sooner it becomes
a single token. There is nothing to learn in these weights: they are random, and so is the text
they produce. Still, the shapes are real, the names are real, and every layer does the work it
would do in a trained network, which is what a test or a benchmark needs to measure.

def generate(prompt: str, max_tokens: int = 16) -> str:
    tokens = tokenizer.encode(prompt)
    for _ in range(max_tokens):
        logits = model(tokens)
        next_token = int(logits[-1].argmax())
        if next_token == tokenizer.eos_token_id:
            break
        tokens.append(next_token)
    return tokenizer.decode(tokens)

class Request:
    def __init__(self, request_id, prompt, sampling_params):
        self.request_id = request_id
        self.prompt = prompt
        self.sampling_params = sampling_params
        self.output_tokens = []

{"role": "user", "content": "What is the capital of France?"}
{"role": "assistant", "content": "The capital of France is Paris."}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 100 128 256 512 1024 2048 4096 8192, 3.14159, 2.71828.
"""


def _merge(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _learn_merges(words: Counter, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Merge the most frequent adjacent pair until the vocabulary is full."""
    merges = []
    while len(vocab) < TOKENIZER_SIZE:
        pairs: Counter = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            raise ValueError("MERGE_TEXT is too short to fill the vocabulary")
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        vocab.setdefault(best[0] + best[1], len(vocab))
        words = Counter({_merge(w, best): n for w, n in words.items()})
    return merges


def build_tokenizer() -> Tokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    words = Counter(tuple(piece) for piece, _ in byte_level.pre_tokenize_str(MERGE_TEXT))
    merges = _learn_merges(words, vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def tokenizer_files(model_max_length: int) -> dict[str, str]:
    """File name -> contents of the tokenizer files of a model directory."""
    config = {
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    return {
        "tokenizer.json": build_tokenizer().to_str(pretty=True) + "\n",
        "tokenizer_config.json": json.dumps(config, indent=2, sort_keys=True) + "\n",
    }
