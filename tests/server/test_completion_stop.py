"""The API process's completion state: a stop string the final flush reveals ends it as a stop."""

from __future__ import annotations

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.sampling_params import SamplingParams
from engine.core.tokenizer import Tokenizer
from engine.core.output_processor import Completion
from engine.core.outputs import CompletionDelta


def test_a_stop_string_in_the_flushed_text_is_a_stop(tiny_qwen3):
    tok = Tokenizer.from_dir(tiny_qwen3)
    first_byte = tok.encode("é")[0]  # alone: an unfinished character, held back until the end
    c = Completion(0, IncrementalDetokenizer(tok, [0], SamplingParams(max_tokens=1, stop=["\ufffd"])))
    u = c.apply(CompletionDelta(0, [first_byte], None, "length", None))
    assert (u.text, u.num_tokens, u.finished, u.stop_string, c.text) == ("", 1, True, False, "")
    assert (c.finish_reason, c.stop_reason) == ("stop", "\ufffd")
