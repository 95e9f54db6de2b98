"""/v1/completions echo as vLLM answers it: max_tokens 0 scores the prompt, and a streamed echo
carries the prompt's logprobs and the same absolute text offsets as the whole answer."""

from __future__ import annotations

import json
import random

import httpx
import pytest


def _prompt(rng: random.Random) -> str:
    words = ["def", "return", "class", "import", "value", "list", "print", "for", "in", "range", "self"]
    return " ".join(rng.choice(words) for _ in range(rng.randrange(3, 12)))


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=120)


def _streamed(server, body: dict) -> dict[int, dict]:
    """Each choice's text, logprobs lists and finish_reason joined over the stream, and the usage."""
    out: dict[int, dict] = {}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True,
                      "stream_options": {"include_usage": True}}, headers=server.headers, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            for ch in chunk["choices"]:
                acc = out.setdefault(ch["index"], {"text": "", "logprobs": None, "finish_reason": None})
                acc["text"] += ch["text"]
                if ch["logprobs"] is not None:
                    acc["logprobs"] = {k: (acc["logprobs"] or {}).get(k, []) + v for k, v in ch["logprobs"].items()}
                acc["finish_reason"] = ch["finish_reason"] or acc["finish_reason"]
    return out


def _same_logprobs(a: dict, b: dict) -> None:
    assert a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"]
    assert a["token_logprobs"] == pytest.approx(b["token_logprobs"], abs=1e-4)
    assert [t and sorted(t) for t in a["top_logprobs"]] == [t and sorted(t) for t in b["top_logprobs"]]


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(tiny_server, seed):
    rng = random.Random(seed)
    prompts = [_prompt(rng), _prompt(rng)]
    body = {"prompt": prompts, "echo": True, "max_tokens": 0, "logprobs": 2, "temperature": 1.0}
    r = _post(tiny_server, body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["usage"]["completion_tokens"] == 0
    longer = _post(tiny_server, {**body, "max_tokens": 2, "temperature": 0}).json()
    for ch, prompt in zip(answer["choices"], prompts):
        assert ch["text"] == prompt and ch["finish_reason"] == "length"
        lp = ch["logprobs"]
        assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]) == prompt
        assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
        # the same prompt logprobs as an echo that also generates
        head = {k: v[:len(lp["tokens"])] for k, v in longer["choices"][ch["index"]]["logprobs"].items()}
        _same_logprobs(lp, head)
    streamed = _streamed(tiny_server, body)
    assert streamed["usage"]["completion_tokens"] == 0
    for ch in answer["choices"]:
        got = streamed[ch["index"]]
        assert (got["text"], got["finish_reason"]) == (ch["text"], "length")
        _same_logprobs(got["logprobs"], ch["logprobs"])
    assert _post(tiny_server, {**body, "echo": False}).status_code == 400  # max_tokens 0 is for scoring only


def test_streamed_echo_with_logprobs_equals_the_whole_answer(tiny_server, seed):
    rng = random.Random(seed)
    prompts = [_prompt(rng), _prompt(rng)]
    body = {"prompt": prompts, "echo": True, "max_tokens": 5, "logprobs": 2, "temperature": 0, "ignore_eos": True}
    whole = _post(tiny_server, body).json()
    streamed = _streamed(tiny_server, body)
    for ch, prompt in zip(whole["choices"], prompts):
        got = streamed[ch["index"]]
        assert got["text"] == ch["text"] and ch["text"].startswith(prompt)
        assert got["logprobs"]["tokens"][:1] and got["logprobs"]["token_logprobs"][0] is None  # the prompt's
        assert len(got["logprobs"]["tokens"]) == len(ch["logprobs"]["tokens"])
        _same_logprobs(got["logprobs"], ch["logprobs"])
    assert streamed["usage"] == whole["usage"]
