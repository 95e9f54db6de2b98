import random
import tracemalloc

import pytest
import tokenizers

from engine.core.detokenizer import MAX_CHAR_BYTES, PROMPT_CONTEXT, IncrementalDetokenizer
from engine.core.sampling_params import SamplingParams
from engine.core.tokenizer import Tokenizer

EOS = 1


@pytest.fixture(scope="module")
def tok(tiny_qwen3) -> Tokenizer:
    return Tokenizer.from_dir(tiny_qwen3)


def stream(tok, prompt, ids, params, flush=True) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed ids one by one as the engine does; stop feeding once a stop string ended the sequence."""
    d = IncrementalDetokenizer(tok, prompt, params)
    deltas = []
    for t in ids:
        deltas.append(d.add(t))
        assert d.output_text == "".join(deltas)
        if d.finished_by_stop is not None:
            break
    if flush and d.finished_by_stop is None:
        deltas.append(d.flush())
    return d, deltas


def snippet(eval_text: str, n: int) -> str:
    start = random.randrange(len(eval_text) - n)
    return eval_text[start:start + n]


@pytest.mark.parametrize("skip", [True, False])
def test_deltas_concatenate_to_decode_for_random_tokens(tok, eval_text, seed, skip):
    for _ in range(60):
        ids = [random.randrange(tok.vocab_size) for _ in range(random.randrange(1, 60))]
        prompt = random.choice([[], tok.encode(snippet(eval_text, 40)), [0]])
        _, deltas = stream(tok, prompt, ids, SamplingParams(skip_special_tokens=skip, ignore_eos=True))
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def test_split_characters_never_emit_replacement(tok, eval_text, seed):
    lines = [line for line in eval_text.splitlines() if any(ord(c) > 127 for c in line)]
    texts = random.sample(lines, min(10, len(lines))) + ["日本語のテキスト🎉🐍 héllo — naïve café ±≠"]
    for text in texts:
        ids = tok.encode(text)
        assert any("\ufffd" in tok.decode([t]) for t in ids)  # some character really is split
        d, deltas = stream(tok, tok.encode("x = 1\n"), ids, SamplingParams())
        assert not any("\ufffd" in delta for delta in deltas)
        assert "".join(deltas) == d.output_text == text


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_are_cut_and_never_streamed(tok, eval_text, seed, include):
    straddled = 0
    for _ in range(80):
        text = snippet(eval_text, 300)
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        a, n = random.randrange(10, 280), random.randrange(2, 9)
        stop = text[a:a + n]
        absent = "\x00never\x00"
        at = text.find(stop)
        ends = [len(tok.decode(ids[:i])) for i in range(len(ids) + 1)]
        straddled += any(at < e < at + len(stop) for e in ends)
        params = SamplingParams(stop=[absent, stop], include_stop_str_in_output=include)
        d, deltas = stream(tok, [0], ids, params)
        assert d.finished_by_stop == stop
        assert "".join(deltas) == d.output_text == text[:at + len(stop) if include else at]
        if not include:
            assert not any(stop in delta for delta in deltas)
        assert d.add(ids[-1]) == "" and d.flush() == ""  # nothing after the stop
    assert straddled > 40  # most stops span a token boundary


def test_earliest_stop_wins(tok):
    text = "def foo(bar):\n    return bar + 1\n"
    d, deltas = stream(tok, [0], tok.encode(text), SamplingParams(stop=["+ 1", "return", "bar"]))
    assert d.finished_by_stop == "bar" and "".join(deltas) == "def foo("


def test_held_back_text_is_released(tok):
    params = SamplingParams(stop=["XYZ"])
    d, deltas = stream(tok, [0], tok.encode("abc XY"), params, flush=False)
    assert d.output_text == "abc " and "XY" not in "".join(deltas)
    assert d.flush() == "XY" and d.output_text == "abc XY" and d.finished_by_stop is None
    d, deltas = stream(tok, [0], tok.encode("abc XYq"), params, flush=False)
    assert d.output_text == "abc XYq"


def test_stop_token_ids_and_eos(tok):
    body = tok.encode("x = 1\ny = 2")
    stop_id = tok.encode(" =")[0]
    assert stop_id in body
    cut = body.index(stop_id)
    expected = tok.decode(body[:cut])
    d, _ = stream(tok, [0], body, SamplingParams(stop_token_ids=[stop_id]))
    assert d.output_text == expected and d.finished_by_stop is None
    d, _ = stream(tok, [0], body, SamplingParams(stop_token_ids=[stop_id], include_stop_str_in_output=True))
    assert d.output_text == tok.decode(body[:cut + 1])
    with_eos = body[:3] + [EOS] + body[3:]
    d, _ = stream(tok, [0], with_eos, SamplingParams(skip_special_tokens=False))
    assert d.output_text == tok.decode(body[:3])
    d, _ = stream(tok, [0], with_eos, SamplingParams(skip_special_tokens=False, ignore_eos=True))
    assert d.output_text == tok.decode(with_eos, skip_special_tokens=False)


def test_min_tokens_defers_stops(tok):
    ids = tok.encode("ab ab ab ab")
    first_ab = next(i for i in range(1, len(ids) + 1) if "ab" in tok.decode(ids[:i]))
    d, _ = stream(tok, [0], ids, SamplingParams(stop=["ab"], min_tokens=first_ab, max_tokens=None))
    assert d.finished_by_stop == "ab"
    assert d.output_text.startswith("ab") and d.output_text.endswith(" ") and len(d.output_text) > 2
    assert ids[1] == ids[2]  # "ab", " ab", " ab", ...: the second " ab" is the third token
    d, _ = stream(tok, [0], ids, SamplingParams(stop_token_ids=[ids[1]], min_tokens=3, max_tokens=None))
    assert d.output_text == tok.decode(ids[:2])


def test_stops_completed_by_one_token_take_the_earliest(tok):
    ids = tok.encode("def f(x):\n    return x\n")
    assert tok.decode([ids[6]]) == " return"
    d, deltas = stream(tok, [0], ids, SamplingParams(stop=["turn", "ret"]))
    assert d.finished_by_stop == "ret" and "".join(deltas) == "def f(x):\n    "


def test_stops_inside_min_tokens_text_are_ignored(tok):
    ids = tok.encode("ab bcd b")  # "ab", " b", "c", "d", " b"
    d, deltas = stream(tok, [0], ids, SamplingParams(stop=["b", "bcd"], min_tokens=2, max_tokens=None))
    assert d.finished_by_stop == "bcd" and "".join(deltas) == "ab "


def test_window_starts_in_the_prompt():
    """A Metaspace decoder drops the first token's leading space; the prompt context keeps it."""
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"▁a": 0, "▁Hello": 1, "<unk>": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    backend.decoder = tokenizers.decoders.Metaspace()
    tok = Tokenizer(backend, {}, {})
    assert tok.decode([1]) == "Hello" and tok.decode([0, 1]) == "a Hello"
    d = IncrementalDetokenizer(tok, [0], SamplingParams())
    assert d.add(1) == " Hello" and d.add(0) == " a"


def test_character_begun_in_the_prompt_is_emitted_whole(tok):
    ids = tok.encode("café au lait")
    split = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    d, deltas = stream(tok, ids[:split], ids[split:], SamplingParams())
    assert tok.decode(ids[:split]) == "caf\ufffd"
    assert "".join(deltas) == "é au lait"


class CountingTokenizer(Tokenizer):
    """The real tokenizer, counting the ids it is asked to decode: the detokenizer's work."""

    decoded = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return super().decode(ids, skip_special_tokens)


def byte_tokens(tok: Tokenizer) -> list[int]:
    """The id of each byte's own token in a byte-level BPE vocabulary (GPT-2's byte-to-character map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    ids = [tok._backend.token_to_id(chars[b]) for b in range(256)]
    assert None not in ids and tok.decode(ids[65:68]) == "ABC"
    return ids


def test_bytes_that_never_make_a_character_keep_the_window_bounded(tiny_qwen3):
    tok = CountingTokenizer.from_dir(tiny_qwen3)
    lone = byte_tokens(tok)[0x80]  # a continuation byte: no character, however many follow
    d = IncrementalDetokenizer(tok, tok.encode("x = 1\n"), SamplingParams())
    deltas = [d.add(lone) for _ in range(2000)]
    streamed = "".join(deltas)
    assert streamed == "\ufffd" * len(streamed) and len(streamed) >= 2000 - MAX_CHAR_BYTES  # out as it came
    assert tok.decoded < 2000 * 3 * (PROMPT_CONTEXT + 2 * MAX_CHAR_BYTES)  # unbounded, it was ~4M ids
    assert streamed + d.flush() == d.output_text == tok.decode([lone] * 2000)


def test_random_bytes_read_as_utf8_with_replacement(tiny_qwen3, seed):
    """Byte by byte, runs of bytes that make no character among characters split over their bytes."""
    tok = CountingTokenizer.from_dir(tiny_qwen3)
    of_byte = byte_tokens(tok)
    pieces = [b"\x80", b"\xbf\xbf\xbf", b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98", b"\xff", "é".encode(), "€".encode(),
              "😀".encode(), b"a", b" ", b"\n"]
    for _ in range(30):
        data = b"".join(random.choice(pieces) * random.choice([1, 1, 2, 7]) for _ in range(random.randrange(1, 120)))
        ids = [of_byte[b] for b in data]
        tok.decoded = 0
        d, deltas = stream(tok, random.choice([[], [0], tok.encode("café")]), ids, SamplingParams(ignore_eos=True))
        assert "".join(deltas) == data.decode("utf-8", errors="replace") == tok.decode(ids)
        assert tok.decoded <= len(ids) * 3 * (PROMPT_CONTEXT + 2 * MAX_CHAR_BYTES) + 50


@pytest.mark.parametrize("stop", [[], ["\x00never\x00"]])
def test_work_per_token_does_not_grow_with_the_text(tok, eval_text, stop):
    """Bytes allocated per token (what extending the text copies) stay flat over a long output."""
    ids = tok.encode(eval_text[:60000])[:4000]
    d = IncrementalDetokenizer(tok, [0], SamplingParams(stop=stop))
    per_token = []
    tracemalloc.start()
    try:
        for t in ids:
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            d.add(t)
            per_token.append(tracemalloc.get_traced_memory()[1] - before)
    finally:
        tracemalloc.stop()
    assert len(d.output_text) > 10000
    first, last = sum(per_token[:1000]) / 1000, sum(per_token[-1000:]) / 1000
    assert last < 1.5 * first + 100, (first, last)  # a copy of the text per token made it ~8x
