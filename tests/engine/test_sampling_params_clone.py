"""SamplingParams.clone: an equal copy that shares no container with the original (the
engine fills the copy's EOS sets; a caller may change its own params later), and shares
logits processors (callables) as before."""

from __future__ import annotations

from engine import SamplingParams
from engine.structured_output import StructuredOutputsParams


def _processor(token_ids, logits):
    return logits


def test_clone_is_equal_and_shares_no_container() -> None:
    original = SamplingParams(
        stop=["END"],
        stop_token_ids=[7],
        logit_bias={3: 1.5},
        allowed_token_ids=[3, 4, 7],
        bad_words=["no"],
        logits_processors=[_processor],
        structured_outputs=StructuredOutputsParams(json={"type": "object"}),
    )
    original.bad_words_token_ids = [[11, 12]]
    copy = original.clone()
    assert copy == original and copy is not original
    assert copy.logits_processors[0] is _processor

    copy.update_from_generation_config({2})  # what the engine does to its copy
    copy.stop.append("MORE")
    copy.stop_token_ids.append(8)
    copy.logit_bias[4] = 2.0
    copy.allowed_token_ids.append(9)
    copy.bad_words.append("never")
    copy.bad_words_token_ids[0].append(13)
    copy.logits_processors.append(_processor)
    copy.structured_outputs.json["type"] = "array"

    assert original.stop == ["END"] and original.stop_token_ids == [7]
    assert original.all_stop_token_ids == {7} and original.eos_token_ids == set()
    assert copy.all_stop_token_ids == {2, 7} and copy.eos_token_ids == {2}
    assert original.logit_bias == {3: 1.5} and original.allowed_token_ids == [3, 4, 7]
    assert original.bad_words == ["no"] and original.bad_words_token_ids == [[11, 12]]
    assert original.logits_processors == [_processor]
    assert original.structured_outputs.json == {"type": "object"}


def test_clone_of_defaults() -> None:
    original = SamplingParams()
    copy = original.clone()
    assert copy == original
    copy.update_from_generation_config({0})
    assert original.all_stop_token_ids == set() and copy.all_stop_token_ids == {0}
