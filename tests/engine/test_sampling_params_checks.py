"""vLLM's `SamplingParams._verify_args` held against ours: every rule, one case each.

The table follows vLLM's checks in order; each bad value must raise ValueError naming the
field, and each edge vLLM accepts must be accepted (with vLLM's normalisation). Over gRPC the
same rules reach the client as INVALID_ARGUMENT naming the field by its proto path
(tests/services/common/test_errors.py).
"""

from __future__ import annotations

import logging
import math

import pytest

from engine import SamplingParams

REFUSED = {
    "n 0": ({"n": 0}, "n"),
    "n not an int": ({"n": 1.5}, "n"),
    "presence_penalty > 2": ({"presence_penalty": 2.01}, "presence_penalty"),
    "presence_penalty < -2": ({"presence_penalty": -2.01}, "presence_penalty"),
    "frequency_penalty > 2": ({"frequency_penalty": 2.01}, "frequency_penalty"),
    "frequency_penalty < -2": ({"frequency_penalty": -2.01}, "frequency_penalty"),
    "repetition_penalty inf": ({"repetition_penalty": math.inf}, "repetition_penalty"),
    "repetition_penalty nan": ({"repetition_penalty": math.nan}, "repetition_penalty"),
    "repetition_penalty 0": ({"repetition_penalty": 0.0}, "repetition_penalty"),
    "temperature inf": ({"temperature": math.inf}, "temperature"),
    "temperature nan": ({"temperature": math.nan}, "temperature"),
    "temperature < 0": ({"temperature": -0.1}, "temperature"),
    "temperature > 2": ({"temperature": 2.01}, "temperature"),
    "top_p 0": ({"top_p": 0.0}, "top_p"),
    "top_p > 1": ({"top_p": 1.01}, "top_p"),
    "top_k < -1": ({"top_k": -2}, "top_k"),
    "top_k not an int": ({"top_k": 2.5}, "top_k"),
    "min_p < 0": ({"min_p": -0.1}, "min_p"),
    "min_p > 1": ({"min_p": 1.1}, "min_p"),
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens"),
    "min_tokens < 0": ({"min_tokens": -1}, "min_tokens"),
    "min_tokens > max_tokens": ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    "logprobs < 0": ({"logprobs": -2}, "logprobs"),
    "prompt_logprobs < 0": ({"prompt_logprobs": -2}, "prompt_logprobs"),
    "stop_token_ids not ints": ({"stop_token_ids": ["2"]}, "stop_token_ids"),
    "stop empty string": ({"stop": [""]}, "stop cannot contain an empty string"),
    "stop empty among others": ({"stop": ["a", ""]}, "stop cannot contain an empty string"),
    "stop without detokenize": ({"stop": ["a"], "detokenize": False}, "detokenize"),
    "bad_words empty string": ({"bad_words": [""]}, "bad_words"),
}


@pytest.mark.parametrize("kwargs, field", REFUSED.values(), ids=list(REFUSED))
def test_vllm_refuses_so_do_we(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_the_edges_vllm_accepts() -> None:
    for value in (-2.0, 2.0):
        SamplingParams(presence_penalty=value, frequency_penalty=value)
    assert SamplingParams(temperature=2.0).temperature == 2.0
    assert SamplingParams(top_k=-1).top_k == 0  # -1 and 0 both disable top-k
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(stop="a").stop == ["a"]
    assert SamplingParams(seed=-1).seed is None  # vLLM: -1 is "no seed"
    assert SamplingParams(seed=0).seed == 0


def test_a_tiny_temperature_is_raised_to_vllms_floor(caplog) -> None:
    """0 < temperature < 1e-2 overflows logits / temperature: vLLM raises it to 1e-2."""
    with caplog.at_level(logging.WARNING):
        params = SamplingParams(temperature=1e-4)
    assert params.temperature == pytest.approx(1e-2)
    assert SamplingParams(temperature=0.0).temperature == 0.0  # greedy stays greedy
    assert SamplingParams(temperature=0.5).temperature == 0.5
