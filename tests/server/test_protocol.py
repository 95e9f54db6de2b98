"""Request validation and translation, and responses the official OpenAI client accepts."""

from __future__ import annotations

import random

import pydantic
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk as OpenAIChatChunk

from engine.server.errors import APIError, error_body, invalid
from engine.server.limits import Limits
from engine.server.protocol import (ChatChoice, ChatChoiceLogprobs, ChatChunkChoice, ChatCompletionChunk,
                                    ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatResponseMessage,
                                    ChatTokenLogprob, CompletionChoice, CompletionChunk, CompletionLogprobs,
                                    CompletionRequest, CompletionResponse, TopLogprob, Usage, prompt_token_lists,
                                    pydantic_error_to_api, to_sampling_params)

VOCAB = 1000
LIMITS = Limits()


def completion(**kw) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **kw})


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})


def refused(fn, *args) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    assert info.value.status_code == 400 and info.value.type == "invalid_request_error"
    return info.value


def validation_param(model, body) -> str | None:
    with pytest.raises(pydantic.ValidationError) as info:
        model.model_validate(body)
    err = pydantic_error_to_api(info.value)
    assert err.status_code == 400
    return err.param


def test_error_body_has_openai_shape():
    err = invalid("n", "n must be in [1, 16], got 17")
    assert error_body(err) == {"error": {"message": "n must be in [1, 16], got 17", "type": "invalid_request_error",
                                         "param": "n", "code": None}}
    assert str(err) == err.message


@pytest.mark.parametrize("make", [completion, chat])
@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", LIMITS.max_n + 1), ("stop", ["x"] * (LIMITS.max_stop_sequences + 1)),
    ("stop", "s" * (LIMITS.max_stop_length + 1)), ("stop", [""]), ("max_tokens", 0), ("temperature", -0.5),
    ("top_p", 0.0), ("min_p", 1.5), ("presence_penalty", 2.5),
    ("stop_token_ids", [VOCAB]), ("stop_token_ids", [-1]), ("logit_bias", {str(VOCAB): 1.0}),
    ("logit_bias", {"-3": 1.0}), ("logit_bias", {"abc": 1.0}), ("logit_bias", {"5": 500.0}),
])
def test_bad_sampling_fields_name_the_field(make, field, value):
    assert refused(to_sampling_params, make(**{field: value}), LIMITS, VOCAB).param == field


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
@pytest.mark.parametrize("field, value", [("repetition_penalty", 0.0), ("repetition_penalty", 1e-300),
                                          ("temperature", 1e300), ("seed", 2**63), ("top_k", -2**63 - 1)])
def test_numbers_the_engine_cannot_hold_are_refused_by_the_model(model, field, value):
    base = {"prompt": "hi"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "hi"}]}
    assert validation_param(model, {**base, field: value}) == field


@pytest.mark.parametrize("make", [completion, chat])
def test_min_tokens_above_max_tokens(make):
    assert refused(to_sampling_params, make(max_tokens=4, min_tokens=5), LIMITS, VOCAB).param == "min_tokens"


def test_completion_logprobs_limits():
    for bad in (-1, LIMITS.max_logprobs + 1):
        assert refused(to_sampling_params, completion(logprobs=bad), LIMITS, VOCAB).param == "logprobs"
    assert to_sampling_params(completion(logprobs=LIMITS.max_logprobs), LIMITS, VOCAB).logprobs == LIMITS.max_logprobs


def test_chat_logprobs_limits_and_field_names():
    for bad in (-1, LIMITS.max_logprobs + 1):
        err = refused(to_sampling_params, chat(logprobs=True, top_logprobs=bad), LIMITS, VOCAB)
        assert err.param == "top_logprobs"
    assert refused(to_sampling_params, chat(top_logprobs=2), LIMITS, VOCAB).param == "top_logprobs"
    assert refused(to_sampling_params, chat(max_completion_tokens=0), LIMITS, VOCAB).param == "max_completion_tokens"


def test_tighter_limits_apply():
    tight = Limits(max_n=2, max_logprobs=1, max_stop_sequences=1, max_stop_length=3)
    assert refused(to_sampling_params, completion(n=3), tight, VOCAB).param == "n"
    assert refused(to_sampling_params, completion(logprobs=2), tight, VOCAB).param == "logprobs"
    assert refused(to_sampling_params, completion(stop=["a", "b"]), tight, VOCAB).param == "stop"
    assert refused(to_sampling_params, completion(stop="abcd"), tight, VOCAB).param == "stop"
    assert to_sampling_params(completion(n=2, stop="abc"), tight, VOCAB).n == 2


def test_completion_maps_to_sampling_params():
    rng = random.Random()
    n, seed, top_k = rng.randint(1, LIMITS.max_n), rng.randrange(2**31), rng.randint(1, 50)
    temp, top_p = round(rng.uniform(0.1, 2.0), 3), round(rng.uniform(0.1, 1.0), 3)
    stop_ids = rng.sample(range(VOCAB), 3)
    bias_tok = rng.randrange(VOCAB)
    p = to_sampling_params(completion(
        n=n, seed=seed, top_k=top_k, temperature=temp, top_p=top_p, min_p=0.05, stop="END", stop_token_ids=stop_ids,
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, logprobs=3, max_tokens=40,
        min_tokens=2, ignore_eos=True, skip_special_tokens=False, logit_bias={str(bias_tok): -100},
        user="u"), LIMITS, VOCAB)
    assert (p.n, p.seed, p.top_k, p.temperature, p.top_p, p.min_p) == (n, seed, top_k, temp, top_p, 0.05)
    assert p.stop == ["END"] and p.stop_token_ids == stop_ids
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (p.logprobs, p.prompt_logprobs, p.max_tokens, p.min_tokens) == (3, None, 40, 2)
    assert p.ignore_eos and not p.skip_special_tokens and p.logit_bias == {bias_tok: -100.0}
    assert not p.greedy


def test_completion_defaults_and_echo():
    p = to_sampling_params(completion(), LIMITS, VOCAB)
    assert p.max_tokens == 16 and p.logprobs is None and p.n == 1 and p.temperature == 1.0
    assert to_sampling_params(completion(echo=True, logprobs=2), LIMITS, VOCAB).prompt_logprobs == 2
    assert to_sampling_params(completion(echo=True), LIMITS, VOCAB).prompt_logprobs is None


def test_greedy_with_temperature_zero():
    assert to_sampling_params(completion(temperature=0), LIMITS, VOCAB).greedy
    assert to_sampling_params(chat(temperature=0.0), LIMITS, VOCAB).greedy


def test_chat_maps_to_sampling_params():
    p = to_sampling_params(chat(max_tokens=10, max_completion_tokens=7), LIMITS, VOCAB)
    assert p.max_tokens == 7
    assert to_sampling_params(chat(max_tokens=10), LIMITS, VOCAB).max_tokens == 10
    assert to_sampling_params(chat(), LIMITS, VOCAB).max_tokens is None
    k = random.randint(0, LIMITS.max_logprobs)
    assert to_sampling_params(chat(logprobs=True, top_logprobs=k), LIMITS, VOCAB).logprobs == k
    assert to_sampling_params(chat(logprobs=True), LIMITS, VOCAB).logprobs == 0
    assert to_sampling_params(chat(logprobs=False), LIMITS, VOCAB).logprobs is None
    p = to_sampling_params(chat(n=3, stop=["a", "b"], seed=9, min_tokens=1, ignore_eos=True), LIMITS, VOCAB)
    assert (p.n, p.stop, p.seed, p.min_tokens, p.ignore_eos) == (3, ["a", "b"], 9, 1, True)


def test_chat_messages_and_parts():
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "developer", "content": "x"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok"}]})
    assert [m.text for m in req.messages] == ["be brief", "x", "ab", "ok"]
    assert req.stream is False and req.stream_options is None
    req = chat(stream=True, stream_options={"include_usage": True})
    assert req.stream and req.stream_options.include_usage


@pytest.mark.parametrize("field, value", [("chat_template", "{{ x }}"), ("chat_template_kwargs", {"messages": []}),
                                          ("chat_template_kwargs", {"not a name": 1})])
def test_chat_refuses_client_templates_and_the_servers_own_template_variables(field, value):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    assert validation_param(ChatCompletionRequest, body) == field


def test_chat_template_kwargs_pass():
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                "chat_template_kwargs": {"enable_thinking": False}})
    assert req.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "a", "type": "function",
                                                                    "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0.tool_calls"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x"}], "n": "2"}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
])
def test_chat_type_errors_name_the_field(body, param):
    assert validation_param(ChatCompletionRequest, {"model": "m", **body}) == param


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"), ({"prompt": [1, "a"]}, "prompt"), ({"prompt": 7}, "prompt"), ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "logprobs": True}, "logprobs"), ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "logit_bias": {"1": "big"}}, "logit_bias.1"), ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
])
def test_completion_type_errors_name_the_field(body, param):
    assert validation_param(CompletionRequest, {"model": "m", **body}) == param


@pytest.mark.parametrize("request_model, body, param", [
    (CompletionRequest, {"prompt": "x", "logprob": 2}, "logprob"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "max_completion_token": 3},
     "max_completion_token"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x", "tool_call": []}]}, "messages.0.tool_call"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "stream_options": {"usage": True}},
     "stream_options.usage"),
])
def test_unknown_fields_are_refused_by_name(request_model, body, param):
    with pytest.raises(pydantic.ValidationError) as exc:
        request_model.model_validate({"model": "m", **body})
    err = pydantic_error_to_api(exc.value)
    assert err.status_code == 400 and err.param == param and "unknown field" in err.message


def test_prompt_shapes():
    ids = [random.randrange(VOCAB) for _ in range(5)]
    assert prompt_token_lists(completion(prompt="abc"), VOCAB) == ["abc"]
    assert prompt_token_lists(completion(prompt=["a", "b"]), VOCAB) == ["a", "b"]
    assert prompt_token_lists(completion(prompt=ids), VOCAB) == [ids]
    assert prompt_token_lists(completion(prompt=[ids, ids[:2]]), VOCAB) == [ids, ids[:2]]


@pytest.mark.parametrize("prompt, says", [
    ("", "empty"), ([], "empty"), ([""], "empty"), ([[]], "empty"), ([[1, 2], []], "empty"),
    ([3, -1], ">= 0"), ([[3], [VOCAB]], "out of vocabulary"), ([VOCAB + 5], "out of vocabulary"),
])
def test_bad_prompts(prompt, says):
    err = refused(prompt_token_lists, completion(prompt=prompt), VOCAB)
    assert err.param == "prompt" and says in err.message


def test_completion_response_parses_with_openai_client():
    resp = CompletionResponse(model="m", choices=[
        CompletionChoice(index=0, text="hello", finish_reason="length", logprobs=CompletionLogprobs(
            text_offset=[0], token_logprobs=[-0.5], tokens=["hello"], top_logprobs=[{"hello": -0.5, "hi": -1.0}])),
        CompletionChoice(index=1, text="bye", finish_reason="stop")],
        usage=Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5))
    parsed = Completion.model_validate_json(resp.model_dump_json())
    assert parsed.id.startswith("cmpl-") and parsed.object == "text_completion" and parsed.model == "m"
    assert [c.text for c in parsed.choices] == ["hello", "bye"]
    assert parsed.choices[0].finish_reason == "length" and parsed.choices[0].logprobs.top_logprobs[0]["hi"] == -1.0
    assert parsed.usage.total_tokens == 5
    last = CompletionChunk(model="m", choices=[CompletionChoice(index=0, text="!", finish_reason="stop")])
    assert Completion.model_validate_json(last.model_dump_json()).choices[0].text == "!"


def test_chat_response_and_chunks_parse_with_openai_client():
    lp = ChatChoiceLogprobs(content=[ChatTokenLogprob(token="Hi", logprob=-0.1, bytes=[72, 105],
                                                      top_logprobs=[TopLogprob(token="Hi", logprob=-0.1)])])
    resp = ChatCompletionResponse(model="m", choices=[ChatChoice(
        index=0, message=ChatResponseMessage(content="Hi"), logprobs=lp, finish_reason="stop")],
        usage=Usage(prompt_tokens=4, completion_tokens=1, total_tokens=5))
    parsed = ChatCompletion.model_validate_json(resp.model_dump_json())
    assert parsed.id.startswith("chatcmpl-") and parsed.object == "chat.completion"
    assert parsed.choices[0].message.role == "assistant" and parsed.choices[0].message.content == "Hi"
    assert parsed.choices[0].logprobs.content[0].top_logprobs[0].token == "Hi"
    assert parsed.usage.prompt_tokens == 4

    chunks = [ChatCompletionChunk(id="c1", model="m", choices=[ChatChunkChoice(index=0, delta=ChatDelta(role="assistant", content=""))]),
              ChatCompletionChunk(id="c1", model="m", choices=[ChatChunkChoice(index=0, delta=ChatDelta(content="Hi"), logprobs=lp)]),
              ChatCompletionChunk(id="c1", model="m", choices=[ChatChunkChoice(index=0, delta=ChatDelta(), finish_reason="length")]),
              ChatCompletionChunk(id="c1", model="m", choices=[], usage=Usage(prompt_tokens=4, completion_tokens=1, total_tokens=5))]
    parsed = [OpenAIChatChunk.model_validate_json(c.model_dump_json()) for c in chunks]
    assert all(c.object == "chat.completion.chunk" and c.id == "c1" for c in parsed)
    assert "".join(c.choices[0].delta.content or "" for c in parsed[:3]) == "Hi"
    assert parsed[0].choices[0].delta.role == "assistant" and parsed[1].choices[0].finish_reason is None
    assert parsed[2].choices[0].finish_reason == "length" and parsed[3].usage.total_tokens == 5
