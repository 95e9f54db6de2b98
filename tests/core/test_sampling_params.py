import pytest

from engine.core.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.min_tokens) == (1, 1.0, 1.0, 0, 0.0, 16, 0)
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert p.skip_special_tokens and not p.include_stop_str_in_output and not p.ignore_eos
    assert not p.greedy


def test_normalization():
    p = SamplingParams(stop="###", top_k=-1, logit_bias={"5": 2, 7: -1.5}, temperature=0)
    assert p.stop == ["###"]
    assert p.top_k == 0
    assert p.logit_bias == {5: 2.0, 7: -1.5}
    assert p.greedy
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 1.5),
    ("temperature", -1), ("temperature", float("nan")),
    ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.1), ("min_p", 1.1),
    ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("repetition_penalty", 0), ("repetition_penalty", -1),
    ("seed", 1.5),
    ("stop", [""]), ("stop", ["ok", 3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["x"]),
    ("max_tokens", 0), ("max_tokens", -5),
    ("min_tokens", -1),
    ("logprobs", -1), ("prompt_logprobs", -2),
    ("logit_bias", {"abc": 1.0}), ("logit_bias", {3: 101.0}), ("logit_bias", [1, 2]),
])
def test_bad_field_is_named(field, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert str(e.value).startswith(field + " ")


def test_message_shape():
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1$"):
        SamplingParams(temperature=-1)


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"^min_tokens "):
        SamplingParams(min_tokens=20, max_tokens=10)
    assert SamplingParams(min_tokens=20, max_tokens=None).min_tokens == 20


def test_validate_against_vocab():
    SamplingParams(stop_token_ids=[0, 99], logit_bias={99: 1}, logprobs=100).validate_against(100)
    for kwargs, field in [({"stop_token_ids": [100]}, "stop_token_ids"), ({"logit_bias": {100: 1}}, "logit_bias"),
                          ({"logit_bias": {-1: 1}}, "logit_bias"), ({"logprobs": 101}, "logprobs"),
                          ({"prompt_logprobs": 101}, "prompt_logprobs")]:
        with pytest.raises(ValueError) as e:
            SamplingParams(**kwargs).validate_against(100)
        assert str(e.value).startswith(field + " ")
