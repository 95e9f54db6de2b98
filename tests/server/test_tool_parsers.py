"""Tool-call parsers on hand-written outputs in each format: calls read back with their arguments,
malformed markup left as content (never an error), the same answer when the text comes in pieces
as a stream (cut anywhere, or at the tiny tokenizer's tokens), a call's name and then its arguments
streamed while it is being written, and every well-formed output accepted by the grammar that forces
that format."""

from __future__ import annotations

import json
import random

import pytest

from engine.server.chat_output import ChatOutputParser
from engine.server.reasoning import ReasoningSplitter, constraint_prefix
from engine.server.tool_parsers import FORMATS, ToolCall, detect_tool_call_format, joined_calls, tool_call_format

NAMES = {"get_weather", "search"}
PARIS = ToolCall("get_weather", '{"city": "Paris", "days": 3}')
CATS = ToolCall("search", '{"query": "cats <b>", "limit": null}')
DS_CALLS = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
CB, CE, B, E = DS_CALLS
SEP = "<｜tool▁sep｜>"
D = "｜DSML｜"


def _hermes(name, args):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def _v3(name, args):
    return f"{B}function{SEP}{name}\n```json\n{args}\n```{E}"


def _v31(name, args):
    return f"{B}{name}{SEP}{args}{E}"


def _v4(name, params):
    body = "".join(f'<{D}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                   f'{v if isinstance(v, str) else json.dumps(v)}</{D}parameter>\n' for k, v in params.items())
    return f'<{D}invoke name="{name}">\n{body}</{D}invoke>\n'


def _v4_block(*calls, block="tool_calls"):
    return f"\n\n<{D}{block}>\n{''.join(calls)}</{D}{block}>"


P_ARGS, C_ARGS = '{"city": "Paris", "days": 3}', '{"query": "cats <b>", "limit": null}'
P_PARAMS, C_PARAMS = {"city": "Paris", "days": 3}, {"query": "cats <b>", "limit": None}

# (format, model output, expected content, expected calls)
CASES = [
    ("hermes", "Let me look.\n" + _hermes("get_weather", P_ARGS), "Let me look.", [PARIS]),
    ("hermes", _hermes("get_weather", P_ARGS) + "\n" + _hermes("search", C_ARGS), "", [PARIS, CATS]),
    ("hermes", "no calls here, only <tool text", "no calls here, only <tool text", []),
    # a call whose header read has gone out by name: its arguments are what the model wrote
    ("hermes", _hermes("get_weather", '{"city": "Par'), "", [ToolCall("get_weather", '{"city": "Par')]),
    ("hermes", '<tool_call>\n{"name": "get_weather" "arguments": {}}\n</tool_call>', None, []),  # no comma
    ("hermes", _hermes("unknown_tool", P_ARGS), None, []),
    ("hermes", '<tool_call>\n{"name": "search", "arguments": [1]}\n</tool_call>', None, []),  # not an object
    ("hermes", '<tool_call>\n{"name": "search", "arguments": "{\\"q\\": 1}"}\n</tool_call>', "",
     [ToolCall("search", '{"q": 1}')]),  # arguments as a JSON string
    ("hermes", "A\n" + _hermes("search", C_ARGS)[:-len("</tool_call>")], "A", [CATS]),  # closed by the end
    ("hermes", "A\n" + _hermes("search", C_ARGS)[:-1], "A", [CATS]),  # cut short in its end marker
    ("hermes", _hermes("bad", "{}") + " then " + _hermes("search", C_ARGS),
     _hermes("bad", "{}") + " then", [CATS]),
    ("deepseek_v3", "Sure." + CB + _v3("get_weather", P_ARGS) + "\n" + _v3("search", C_ARGS) + CE, "Sure.",
     [PARIS, CATS]),
    ("deepseek_v3", CB + f"{B}function{SEP}get_weather\n{P_ARGS}{E}" + CE, f"{B}function{SEP}get_weather\n{P_ARGS}{E}",
     []),  # no ```json fence: the call's text is content (the block's own markers are not)
    ("deepseek_v3", CB + _v3("get_weather", P_ARGS), "", [PARIS]),  # the block left open
    ("deepseek_v31", CB + _v31("get_weather", P_ARGS) + _v31("search", C_ARGS) + CE + " done", " done",
     [PARIS, CATS]),
    ("deepseek_v31", CB + _v31("get_weather", "{oops}") + _v31("search", C_ARGS) + CE, "",
     [ToolCall("get_weather", "{oops}"), CATS]),
    ("deepseek_v31", CB + _v31("nothing", "{}") + CE, _v31("nothing", "{}"), []),
    ("deepseek_v31", "x" + CB + "junk" + CE, "xjunk", []),
    ("deepseek_v4", "Checking." + _v4_block(_v4("get_weather", P_PARAMS), _v4("search", C_PARAMS)), "Checking.",
     [PARIS, CATS]),
    ("deepseek_v4", _v4_block(f'<{D}invoke name="get_weather">\n<{D}parameter name="days" string="false">'
                              f'three</{D}parameter>\n</{D}invoke>\n'), "",
     [ToolCall("get_weather", '{"days": "three"}')]),  # not JSON where string="false": a string
    ("deepseek_v4", _v4_block(_v4("search", {"query": 'a "quoted"\nline', "filters": {"k": [1, 2]}})), "",
     [ToolCall("search", '{"query": "a \\"quoted\\"\\nline", "filters": {"k": [1, 2]}}')]),
    ("deepseek_v4", _v4_block(_v4("nope", P_PARAMS)), "\n\n\n" + _v4("nope", P_PARAMS).rstrip(), []),
    ("deepseek_v32", "Checking." + _v4_block(_v4("get_weather", P_PARAMS), _v4("search", C_PARAMS),
                                             block="function_calls"), "Checking.", [PARIS, CATS]),
    ("deepseek_v32", _v4_block(_v4("get_weather", P_PARAMS)), _v4_block(_v4("get_weather", P_PARAMS)),
     []),  # V4's block name is not V3.2's
]


def _expected_content(text: str, content: str | None) -> str:
    return text.strip() if content is None else content  # None: all of the output is content


def _read(fmt: str, text: str, pieces: list[str] | None = None, parallel: bool = True):
    """(content, calls) of ``text`` fed whole, or in ``pieces`` as a stream."""
    scanner = tool_call_format(fmt).scanner(NAMES, None if parallel else 1)
    content, deltas, so_far = "", [], ""
    for k, piece in enumerate(pieces or [text]):
        so_far += piece
        c, new = scanner.feed(so_far, k == len(pieces or [text]) - 1)
        content += c
        deltas += new
    return content, joined_calls(deltas)


def _random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 30)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("fmt,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_outputs_read_into_content_and_calls(fmt, text, content, calls):
    got_content, got_calls = _read(fmt, text)
    assert got_calls == calls
    assert got_content == _expected_content(text, content)


@pytest.mark.parametrize("fmt,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_streamed_pieces_add_up_to_the_whole(fmt, text, content, calls, seed):
    rng = random.Random(seed)
    whole = _read(fmt, text)
    for _ in range(20):
        assert _read(fmt, text, _random_pieces(text, rng)) == whole
    assert _read(fmt, text, list(text)) == whole  # a character at a time
    for cut in range(1, len(text)):  # every split point
        assert _read(fmt, text, [text[:cut], text[cut:]]) == whole


# pieces of every format's markup, whole and broken, and what goes between: soups of them must read
# the same however they are cut (no format may lose or duplicate text at a cut, nor hang)
SOUP = ["<tool_call>", "</tool_call>", "<tool_", "\n", " ", '{"name": "get_weather", "arguments": ', P_ARGS, "}", "{",
        '"', "x", CB, CE, B, E, SEP, f"function{SEP}search\n```json\n", "\n```", f"search{SEP}",
        f"<{D}tool_calls>", f"</{D}tool_calls>", f"<{D}function_calls>", f"</{D}function_calls>",
        f'<{D}invoke name="search">', f"</{D}invoke>", f'<{D}parameter name="query" string="true">',
        f'<{D}parameter name="limit" string="false">', f"</{D}parameter>", f"<{D}", "[1]"]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_marker_soups_read_the_same_however_cut(fmt, seed):
    rng = random.Random(seed)
    for _ in range(150):
        text = "".join(rng.choice(SOUP) for _ in range(rng.randint(1, 12)))
        for parallel in (True, False):
            whole = _read(fmt, text, parallel=parallel)
            assert _read(fmt, text, list(text), parallel=parallel) == whole, text
            assert _read(fmt, text, _random_pieces(text, rng), parallel=parallel) == whole, text


@pytest.fixture(scope="module")
def tokenizer(shared_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(shared_dir / "models" / "tiny-qwen3-py" / "tokenizer.json"))


@pytest.mark.parametrize("fmt,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_token_streams_add_up_to_the_whole(fmt, text, content, calls, tokenizer):
    """The text in the pieces a model writes it in: the tiny tokenizer's tokens (the markers are
    no special tokens there, so they arrive split over several)."""
    ends = sorted({end for _, end in tokenizer.encode(text, add_special_tokens=False).offsets} - {0} | {len(text)})
    pieces = [text[a:b] for a, b in zip([0, *ends], ends)]
    assert len(pieces) > 5 and _read(fmt, text, pieces) == _read(fmt, text)


STREAMED = [("hermes", "Hm. " + _hermes("search", C_ARGS)), ("deepseek_v3", CB + _v3("search", C_ARGS) + CE),
            ("deepseek_v31", CB + _v31("search", C_ARGS) + CE),
            ("deepseek_v4", _v4_block(_v4("search", C_PARAMS))),
            ("deepseek_v32", _v4_block(_v4("search", C_PARAMS), block="function_calls"))]


@pytest.mark.parametrize("fmt,text", STREAMED, ids=[f for f, _ in STREAMED])
def test_arguments_stream_while_the_call_is_written(fmt, text):
    """A call's name goes out once its header is in, then its arguments grow with the text, before
    the call closes: every prefix's arguments begin the final ones, and the string in them streams."""
    scanner = tool_call_format(fmt).scanner(NAMES)
    sent: list = []
    at_cats = None
    for cut in range(1, len(text) + 1):
        sent += scanner.feed(text[:cut], cut == len(text))[1]
        if at_cats is None and text[:cut].endswith("cats <"):
            at_cats = list(sent)
    assert sent[0].name == "search" and all(d.name is None for d in sent[1:])
    assert joined_calls(sent) == [CATS]
    args_then = "".join(d.arguments for d in at_cats)
    assert at_cats[0].name == "search" and args_then.startswith('{"query": "cats') and CATS.arguments.startswith(args_then)
    assert len(sent) > 10  # in many pieces


def test_only_the_first_call_where_parallel_calls_are_off():
    text = _hermes("get_weather", P_ARGS) + "\n" + _hermes("search", C_ARGS)
    content, calls = _read("hermes", text, parallel=False)
    assert calls == [PARIS] and content == "\n" + _hermes("search", C_ARGS)
    # in a block: the block's end is no content, a second call is
    one = _v4_block(_v4("get_weather", P_PARAMS))
    for text in (one, one + " done"):
        assert _read("deepseek_v4", text, list(text), parallel=False) == _read("deepseek_v4", text, parallel=False)
        assert _read("deepseek_v4", text, parallel=False) == (text[len(one):], [PARIS])
    two = _v4_block(_v4("get_weather", P_PARAMS), _v4("search", C_PARAMS))
    for pieces in (None, list(two)):
        assert _read("deepseek_v4", two, pieces, parallel=False) == ("\n" + _v4("search", C_PARAMS).rstrip(), [PARIS])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_forcing_grammar_accepts_what_the_parser_reads(fmt):
    """Each format's structural tag (as forced calls run) accepts its well-formed outputs, and the
    parser reads them back: the two sides of a format agree."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    weather = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
               "required": ["city", "days"]}
    schemas = {"get_weather": weather, "search": None}
    one = {"hermes": _hermes("get_weather", P_ARGS), "deepseek_v3": CB + _v3("get_weather", P_ARGS) + CE,
           "deepseek_v31": CB + _v31("get_weather", P_ARGS) + CE,
           "deepseek_v4": _v4_block(_v4("get_weather", P_PARAMS)).lstrip(),
           "deepseek_v32": _v4_block(_v4("get_weather", P_PARAMS), block="function_calls").lstrip()}[fmt]
    f = FORMATS[fmt]
    for forced in ("get_weather", None):
        for state, prefix in (("closed", ""), ("open", "a thought</think>"), ("maybe", "<think>a thought</think>")):
            tag = f.structural_tag(schemas, forced, True, constraint_prefix(state))
            grammar = xgr.Grammar.from_structural_tag(json.dumps(tag))
            assert _is_grammar_accept_string(grammar, prefix + one)  # and may end there (EOS after the last call)
            if f.block_start is not None:  # after the block only the end
                assert not _is_grammar_accept_string(grammar, prefix + one + "\n", require_termination=False)
            assert not _is_grammar_accept_string(grammar, prefix + one.replace("3", "x3"))
            parser = ChatOutputParser(ReasoningSplitter(state), f.scanner(set(schemas)))
            out = parser.feed(prefix + one, True)
            assert out.tool_calls()[0][1] == PARIS and out.content == "" and out.reasoning == ("a thought" if prefix else "")
    bad = {**schemas, "get_weather": {"type": "object", "properties": {"days": {"type": "integer"}},
                                      "required": ["days"], "additionalProperties": False}}
    assert not _is_grammar_accept_string(xgr.Grammar.from_structural_tag(
        json.dumps(f.structural_tag(bad, "get_weather", True))), one)  # "city" is not allowed there


@pytest.mark.parametrize("template,tokens,name", [
    ("{% for t in tools %}<tool_call>{{ t | tojson }}</tool_call>{% endfor %}", [], "hermes"),
    (f"{CB}{B}function{SEP}{{{{ name }}}}\n```json\n", [], "deepseek_v3"),
    (f"{CB}{B}{{{{ name }}}}{SEP}", [], "deepseek_v31"),
    (None, ["<｜DSML｜", "<think>"], "deepseek_v4"),
    ("{{ '<｜DSML｜function_calls>' }}", [], "deepseek_v32"),
    ("{{ messages }}", [], None),
])
def test_the_format_is_detected_from_the_template_or_the_tokens(template, tokens, name):
    fmt = detect_tool_call_format(template, tokens)
    assert (fmt.name if fmt else None) == name


def test_an_unknown_parser_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="hermes"):
        tool_call_format("nonsense")


def test_the_flags_take_known_names_auto_and_none():
    import argparse

    from engine.server.serve_args import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    args = p.parse_args(["--tool-call-parser", "deepseek_v4", "--reasoning-parser", "none"])
    assert (args.tool_call_parser, args.reasoning_parser) == ("deepseek_v4", "none")
    assert p.parse_args([]).tool_call_parser == "auto"
    for flag in ("--tool-call-parser", "--reasoning-parser"):
        with pytest.raises(SystemExit):
            p.parse_args([flag, "nonsense"])
